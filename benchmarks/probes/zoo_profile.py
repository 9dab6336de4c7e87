"""Where a zoo row's time goes: Inductor's kernels next to torchfuse's, by torch.profiler.

    python benchmarks/probes/zoo_profile.py --only resnet18 --mode train [--top 15] [--steps 5]
    python benchmarks/probes/zoo_profile.py --device cpu --only llama --mode train
    python benchmarks/probes/zoo_profile.py --only pyg_gcn --mode infer    # a --zoo library row

For each backend (eager, Inductor, torchfuse) the row's step is compiled, warmed up, then profiled
for --steps steps.  Printed per backend: wall ms per step (back-to-back, host included), GPU ms
per step (sum of kernel times) and the --top kernels by GPU time per step, with their call
counts; so a gap shows up as the kernels one compiler spends more on.  On CPU (zoo "cpu" size)
the table is self CPU time per op: ATen ops, and torchfuse's C++ kernels by name (the wrapper
names each call for the profiler).
"""
from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

import torchfuse  # noqa: E402,F401  (registers the backend)
from zoo import TrainStep, compile_with  # noqa: E402
from zoo_models import BY_NAME  # noqa: E402


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _step(name: str, mode: str, dtype: torch.dtype, backend: str, device: str):
    zm = BY_NAME.get(name) or _library_row(name)
    model, inputs = zm.make("gpu" if device == "cuda" else "cpu", device, dtype)
    if mode == "train":
        model.train()
        step = TrainStep(model, compile_with(backend, model), zm.loss, inputs)
        return step
    compiled = compile_with(backend, model)

    def infer():
        with torch.no_grad():
            return compiled(*inputs)
    return infer


def _library_row(name: str):
    """A row of `zoo.py --zoo library` (timm, torchvision, torch_geometric, ... models)."""
    from zoo_library import LIBRARY_BY_NAME
    return LIBRARY_BY_NAME[name]


def profile(name: str, mode: str, dtype: torch.dtype, backend: str, steps: int, top: int,
            device: str = "cuda", host: int = 0) -> str:
    torch._dynamo.reset()
    if backend == "inductor" and device == "cpu":
        # Name Inductor's C++ kernels in the profile too, so the tables compare kernel by kernel.
        import torch._inductor.config as inductor_config
        inductor_config.cpp.enable_kernel_profile = True
    fn = _step(name, mode, dtype, backend, device)
    for _ in range(3):
        fn()
    _sync(device)
    t = time.perf_counter()
    for _ in range(steps):
        fn()
    _sync(device)
    wall = (time.perf_counter() - t) / steps * 1e3
    from torch.profiler import ProfilerActivity, profile as tprofile
    activity = ProfilerActivity.CUDA if device == "cuda" else ProfilerActivity.CPU
    with tprofile(activities=[activity]) as prof:
        for _ in range(steps):
            fn()
        _sync(device)
    if device == "cuda":
        kernels = cuda_kernels(prof, steps)
    else:   # self time, so that a kernel's time is not also counted in the call around it
        kernels = {avg.key: [avg.self_cpu_time_total / 1e3 / steps, avg.count / steps] for avg in prof.key_averages()}
    busy = sum(v[0] for v in kernels.values())
    lines = [f"## {name} {mode} {dtype} {backend}: wall {wall:.2f} ms/step, {device.upper()} {busy:.2f} ms/step, "
             f"{sum(v[1] for v in kernels.values()):.0f} {'kernels' if device == 'cuda' else 'ops'}/step"]
    if host:      # the host's Python by own time: what the wall clock spends beyond the kernels
        from profile_text import cprofile_text
        lines.append(f"  host, {steps} steps:")
        lines += ["  " + line for line in cprofile_text(fn, steps, host, host).splitlines()]
    return "\n".join(lines + top_lines(kernels, top))


def cuda_kernels(prof, steps: int) -> dict[str, list[float]]:
    """{kernel name: [ms per step, calls per step]} of the CUDA kernels a torch.profiler run saw."""
    kernels: dict[str, list[float]] = {}
    for evt in prof.events():
        if evt.device_type == torch.autograd.DeviceType.CUDA:
            k = kernels.setdefault(evt.name, [0.0, 0])
            k[0] += evt.device_time / 1e3 / steps
            k[1] += 1 / steps
    return kernels


def top_lines(kernels: dict[str, list[float]], top: int) -> list[str]:
    return [f"  {ms:8.3f} ms  {calls:5.0f}x  {name[:110]}"
            for name, (ms, calls) in sorted(kernels.items(), key=lambda kv: -kv[1][0])[:top]]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", required=True, help="comma-separated zoo model names")
    ap.add_argument("--mode", choices=("train", "infer"), default="train")
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    ap.add_argument("--backends", default="eager,inductor,torchfuse")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--top", type=int, default=15)
    ap.add_argument("--out", help="append the report to this file")
    ap.add_argument("--host", type=int, default=0, metavar="N",
                    help="also a cProfile of --steps steps: the N functions with the most own time")
    args = ap.parse_args()
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    for name in args.only.split(","):
        for backend in args.backends.split(","):
            try:
                text = profile(name, args.mode, dtype, backend, args.steps, args.top, args.device, args.host)
            except Exception as e:  # one failing backend must not lose the others' profiles
                text = f"## {name} {args.mode} {backend}: failed: {type(e).__name__}: {str(e)[:300]}"
            print(text, flush=True)
            if args.out:
                with open(args.out, "a") as f:
                    f.write(text + "\n")


if __name__ == "__main__":
    main()
