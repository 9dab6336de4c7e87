"""Where mode="reduce-overhead" puts its peak: the allocations alive at the peak of the first
calls (warm-up, capture, first replays) of cudagraph_bench's inference rows, by site, for
torchfuse with and without CUDA graphs (and Inductor's reduce-overhead).

    python benchmarks/probes/cudagraph_memory.py [--rows "llama bf16 4x128,gpt2 fp32 2x96"]
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

from cudagraph_bench import compiled, decoder  # noqa: E402
from zoo_memory import MiB, live_at_peak  # noqa: E402

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def measure(kind: str, dtype: torch.dtype, batch: int, seq: int, backend: str, calls: int, top: int) -> list[str]:
    torch._dynamo.reset()
    torch.cuda.empty_cache()
    model = decoder(kind).cuda().eval().to(dtype)
    ids = torch.randint(0, 30000, (batch, seq), device="cuda")
    fn = compiled(backend, model)
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    torch.cuda.memory._record_memory_history(max_entries=400000, stacks="python")
    peaks = []
    for _ in range(calls):
        with torch.no_grad():
            fn(ids)
        torch.cuda.synchronize()
        peaks.append((torch.cuda.max_memory_allocated() - base) / MiB)
    snap = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    lines = [f"## {kind} {str(dtype)[6:]} {batch}x{seq} {backend}: peak after each call "
             + ", ".join(f"{p:.1f}" for p in peaks) + " MiB"]
    lines += live_at_peak(snap, top)
    del fn, model
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="llama bf16 4x128,gpt2 fp32 2x96")
    ap.add_argument("--backends", default="torchfuse,torchfuse-ro,inductor-ro")
    ap.add_argument("--calls", type=int, default=4)
    ap.add_argument("--top", type=int, default=14)
    ap.add_argument("--out", help="write the report here too")
    args = ap.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False
    report = []
    for spec in args.rows.split(","):
        kind, dt, shape = spec.split()
        batch, seq = (int(v) for v in shape.split("x"))
        for backend in args.backends.split(","):
            lines = measure(kind, DTYPES[dt], batch, seq, backend, args.calls, args.top)
            print("\n".join(lines), flush=True)
            report += lines
    if args.out:
        with open(args.out, "w") as f:
            f.write("\n".join(report) + "\n")


if __name__ == "__main__":
    main()
