"""Pointwise launch configurations against Inductor's (GPU probe).

    python benchmarks/probes/pointwise_config.py [--shapes 4096x3072,32768x768] [--dtype bfloat16]

For GELU-tanh (a compute-heavy pointwise kernel) and a plain chain on each shape: Inductor's
time and the XBLOCK / num_warps its generated kernel uses, torchfuse's default time, and
torchfuse's time with each (XBLOCK, warps) of a small grid forced through its launch plan.
"""
from __future__ import annotations

import argparse
import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import gpu_bench  # noqa: E402  (GPU-only timing by CUDA-graph replay, shared with the kernel table)
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from torchfuse.backends.triton import launch as triton_launch  # noqa: E402

FNS = {"gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
       "chain": lambda x: ((x * 1.5 + 0.3).relu() * 0.7).sigmoid()}


def inductor_config(fn, *args) -> str:
    """The launch config of Inductor's (last) kernel for fn(*args), from its autotuner's run."""
    from torch._inductor.runtime import triton_heuristics
    seen: list[str] = []
    original = triton_heuristics.CachingAutotuner.run

    def run(self, *args, **kwargs):
        result = original(self, *args, **kwargs)
        for launcher in getattr(self, "launchers", [])[:1]:
            seen.append(str(getattr(launcher, "config", "?")))
        return result
    triton_heuristics.CachingAutotuner.run = run
    try:
        torch._dynamo.reset()
        torch.compile(fn)(*args)
    finally:
        triton_heuristics.CachingAutotuner.run = original
    return re.sub(r"\s+", " ", seen[-1]) if seen else "?"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="4096x3072,32768x768,16384x1000,8192x8192")
    ap.add_argument("--dtype", default="bfloat16")
    a = ap.parse_args()
    dtype = getattr(torch, a.dtype)
    rows = []
    grid = [(512, 4), (1024, 4), (1024, 8), (2048, 4), (2048, 8), (4096, 8)]
    original = triton_launch._pointwise_plan
    for name, fn in FNS.items():
        for shape in a.shapes.split(","):
            x = torch.randn(*map(int, shape.split("x")), device="cuda", dtype=dtype)
            torch._dynamo.reset()
            ind = torch.compile(fn)
            t_ind = gpu_bench.bench_graph(ind, x)
            cfg = inductor_config(fn, x)
            torch._dynamo.reset()
            t_tf = gpu_bench.bench_graph(torch.compile(fn, backend="torchfuse"), x)
            forced = []
            for xblock, warps in grid:
                def plan(kernel, xnumel, big, args, xblock=xblock, warps=warps):
                    return (kernel, ((xnumel + xblock - 1) // xblock, 1, 1), (xnumel, 1), (xblock, 1, big), warps,
                            ("XBLOCK", "RBLOCK", "BIG"))
                triton_launch._pointwise_plan = plan
                triton_launch._modules.clear()      # fresh kernel objects: launch plans are memoized on them
                try:
                    torch._dynamo.reset()
                    forced.append(gpu_bench.bench_graph(torch.compile(fn, backend="torchfuse"), x))
                finally:
                    triton_launch._pointwise_plan = original
            gb = 2 * x.numel() * x.element_size() / 1e9
            best = min(range(len(grid)), key=lambda i: forced[i])
            rows.append(f"| {name} | {shape} | {t_ind * 1e3:.1f} ({gb / (t_ind / 1e3):.0f} GB/s) | {cfg} | "
                        f"{t_tf * 1e3:.1f} | " + " | ".join(f"{t * 1e3:.1f}" for t in forced)
                        + f" | {grid[best]} {t_ind / forced[best]:.2f}x |")
    head = ("| fn | shape | inductor us | inductor config | torchfuse us | "
            + " | ".join(f"{b}/{w}w" for b, w in grid) + " | best, inductor/best |")
    text = "\n".join([f"dtype {a.dtype}", head, "|" + "---|" * (6 + len(grid))] + rows)
    if os.environ.get("OUT"):
        open(os.path.join(os.environ["OUT"], "pointwise_config.md"), "w").write(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
