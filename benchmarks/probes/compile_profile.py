"""Where a cold first call's time goes: a cProfile of one zoo model's first call under torchfuse
(Dynamo, AOTAutograd, torchfuse's stages, the first run), in a process whose caches are fresh.

    python benchmarks/probes/compile_profile.py --only gpt2 --dtype bf16 [--mode train] [--top 40]

Printed: the first call's seconds, torchfuse's stage seconds, how many Triton kernels were
compiled in worker processes and how many in this process (a kernel compiled here after the
workers compiled it means the parent's cache key differed from the worker's), then the profile
by cumulative time (functions of torchfuse, AOTAutograd, FX, fake tensors and Triton: --filter)
and by own time.  As compile_bench,
a tiny function is compiled first, so imports and CUDA start-up are not counted.  With
`--caches=DIR` the caches live in DIR: run twice, and the second run profiles a warm start.
"""
from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

_warm = next((a.split("=", 1)[1] for a in sys.argv if a.startswith("--caches=")), None)
import zoo  # noqa: E402  (first: it points every compile cache at fresh folders)
if _warm:   # a warm start: every cache in the given folder (made by an earlier run of this probe)
    os.environ.update(zoo.cache_dirs(_warm))
import torch  # noqa: E402

import torchfuse  # noqa: E402
from zoo_models import BY_NAME, SIZES  # noqa: E402


def _count_triton_compiles() -> list[int]:
    """Count the Triton compiles this process runs itself (a disk-cache hit runs no stage)."""
    calls = [0]
    try:
        from triton.backends.nvidia.compiler import CUDABackend
    except ImportError:
        return calls
    make_ttir = CUDABackend.make_ttir

    def counted(*args, **kwargs):
        calls[0] += 1
        return make_ttir(*args, **kwargs)
    CUDABackend.make_ttir = staticmethod(counted)
    return calls


def row_parser(doc: str) -> argparse.ArgumentParser:
    """The arguments naming one zoo row (model, device, dtype, mode, size), for the probes."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", required=True, help="one zoo model")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    ap.add_argument("--mode", choices=("infer", "train"), default="infer")
    ap.add_argument("--size", choices=SIZES, help='model size (default: "gpu" on cuda, "cpu" on cpu)')
    return ap


def zoo_row(args: argparse.Namespace) -> tuple[Any, torch.nn.Module, tuple[torch.Tensor, ...]]:
    """(zoo model, model, example inputs) for the row `row_parser`'s arguments name."""
    zm = BY_NAME[args.only]
    model, inputs = zm.make(args.size or ("gpu" if args.device == "cuda" else "cpu"), args.device,
                            torch.bfloat16 if args.dtype == "bf16" else torch.float32)
    return zm, model, inputs


def main() -> None:
    ap = row_parser(__doc__)
    ap.add_argument("--save", help="also write the profile here (pstats format)")
    ap.add_argument("--top", type=int, default=40)
    ap.add_argument("--caches", help="keep the compile caches in this folder (a second run is a warm start)")
    ap.add_argument("--filter", default="torchfuse|_functorch|_inductor|triton|fx/|_subclasses",
                    help="regex: the cumulative table lists only functions whose file matches")
    args = ap.parse_args()
    device = args.device
    tiny = torch.compile(torch.nn.Linear(4, 4).to(device), backend="torchfuse")
    tiny(torch.randn(2, 4, device=device)).sum().backward()
    torch._dynamo.reset()
    torchfuse.counters.seconds.clear()
    before = dict(torchfuse.counters)
    in_process = _count_triton_compiles()
    zm, model, inputs = zoo_row(args)
    if args.mode == "train":
        model.train()
        call = zoo.TrainStep(model, zoo.compile_with("torchfuse", model), zm.loss, inputs)
    else:
        compiled = zoo.compile_with("torchfuse", model)

        def call() -> None:
            with torch.no_grad():
                compiled(*inputs)
    profile = cProfile.Profile()
    start = time.perf_counter()
    profile.enable()
    call()
    if device == "cuda":
        torch.cuda.synchronize()
    profile.disable()
    total = time.perf_counter() - start
    if args.save:
        profile.dump_stats(args.save)
    counts = {k: torchfuse.counters[k] - before.get(k, 0)
              for k in ("graphs_compiled", "kernels_generated", "kernels_precompiled", "kernels_compiled_in_workers")}
    print(f"# {args.only} {args.mode}-{args.dtype} on {device}: first call {total:.2f} s (under cProfile)")
    print("stages: " + ", ".join(f"{k} {v:.2f}" for k, v in sorted(torchfuse.counters.seconds.items(),
                                                                      key=lambda kv: -kv[1])))
    print(f"counts: {counts}, Triton compiles in this process: {in_process[0]}")
    for order, restrictions in (("cumulative", (args.filter, args.top)), ("tottime", (25,))):
        text = io.StringIO()
        stats = pstats.Stats(profile, stream=text).sort_stats(order)
        stats.print_stats(*restrictions)
        print(f"\n## by {order}\n" + "\n".join(line for line in text.getvalue().splitlines()
                                               if line.strip() and not line.startswith("   Ordered")))


if __name__ == "__main__":
    main()
