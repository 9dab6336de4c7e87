"""Does a backend's cold first call depend on what the process compiled before it?  The zoo
compiles eager's, Inductor's and torchfuse's rows in one process; `compile_bench.py` gives each a
fresh one.  Here the backends named by --order compile one zoo row in turn, in one process (after
the tiny warm-up compile the zoo does), and each first call is reported with the Triton compiles
this process ran itself (a worker's binary the parent compiles again means their cache keys
differ), torchfuse's stage seconds, and any Triton setting the backend's compile changed.

    python benchmarks/probes/compile_order.py --only mobilenet_v3 --mode train --order inductor,torchfuse
"""
from __future__ import annotations

import os
import sys
import time

sys.path[:0] = [os.path.dirname(os.path.dirname(os.path.abspath(__file__))), os.path.dirname(os.path.abspath(__file__))]

import zoo  # noqa: E402  (first: fresh compile caches)
from compile_profile import _count_triton_compiles, row_parser, zoo_row  # noqa: E402
import torch  # noqa: E402

import torchfuse  # noqa: E402
from torchfuse.backends.triton.compile_workers import triton_settings  # noqa: E402


def main() -> None:
    ap = row_parser(__doc__)
    ap.add_argument("--order", default="inductor,torchfuse", help="backends, compiled in this order")
    args = ap.parse_args()
    order = tuple(args.order.split(","))
    zoo.warm_up(tuple(set(order)), args.device)
    in_process = _count_triton_compiles()
    lines = []
    for backend in order:
        torch._dynamo.reset()
        zoo.free_memory()
        torchfuse.counters.seconds.clear()
        before_compiles, before, settings = in_process[0], dict(torchfuse.counters), triton_settings()
        zm, model, inputs = zoo_row(args)
        if args.mode == "train":
            model.train()
            call = zoo.TrainStep(model, zoo.compile_with(backend, model), zm.loss, inputs).first
        else:
            compiled = zoo.compile_with(backend, model)

            def call() -> None:
                with torch.no_grad():
                    compiled(*inputs)
        zoo._sync(args.device)
        start = time.perf_counter()
        call()
        zoo._sync(args.device)
        took = time.perf_counter() - start
        counts = {k: torchfuse.counters[k] - before.get(k, 0)
                  for k in ("kernels_generated", "kernels_compiled_in_workers") if torchfuse.counters[k] - before.get(k, 0)}
        stages = ", ".join(f"{k} {v:.2f}" for k, v in sorted(torchfuse.counters.seconds.items(), key=lambda kv: -kv[1]))
        lines.append(f"| {backend} | {took:.2f} | {in_process[0] - before_compiles} | {counts} | {stages} |")
        print(lines[-1], flush=True)
        env, knobs, _ = triton_settings()
        changed = {k: v for k, v in env.items() if settings[0].get(k) != v} | {
            ".".join(k): v for k, v in knobs.items() if settings[1].get(k) != v}
        if changed:
            print(f"  {backend} changed Triton's settings: {changed}", flush=True)
    _same_kernel_twice(os.environ["TRITON_CACHE_DIR"])
    if args.device == "cuda":      # what Triton keys binaries by: the ptxas version it read first, and the one named now
        from triton.backends.nvidia.compiler import get_ptxas_version
        arch = torch.cuda.get_device_capability()[0] * 10 + torch.cuda.get_device_capability()[1]
        print(f"TRITON_PTXAS_PATH={os.environ.get('TRITON_PTXAS_PATH')}; ptxas version read first: "
              f"{get_ptxas_version(arch).strip().splitlines()[-1]}; now: "
              f"{get_ptxas_version.__wrapped__(arch).strip().splitlines()[-1]}")
    print(f"\n{args.only} {args.mode}-{args.dtype}, order {args.order}\n| backend | first call s | Triton compiles in "
          "this process | torchfuse counts | torchfuse stages |\n|---|---|---|---|---|\n" + "\n".join(lines))


def _same_kernel_twice(cache: str, show: int = 3) -> None:
    """Kernels that have two binaries in Triton's cache (a worker's and the parent's, when their
    keys differ): what their metadata says differs."""
    import json
    by_name: dict[str, list[dict]] = {}
    for entry in sorted(os.listdir(cache)) if os.path.isdir(cache) else []:
        for f in os.listdir(os.path.join(cache, entry)):
            if f.endswith(".json") and not f.startswith("__grp__"):
                with open(os.path.join(cache, entry, f)) as fh:
                    by_name.setdefault(f[:-5], []).append(json.load(fh))
    twice = {name: metas for name, metas in by_name.items() if len(metas) > 1}
    print(f"{len(twice)} of {len(by_name)} kernels have more than one binary in Triton's cache")
    for name, metas in list(twice.items())[:show]:
        keys = sorted(set().union(*metas))
        print(f"  {name}: " + "; ".join(f"{k}: " + " | ".join(str(m.get(k))[:200] for m in metas)
                                       for k in keys if len({json.dumps(m.get(k), sort_keys=True) for m in metas}) > 1))


if __name__ == "__main__":
    main()
