"""Where a zoo row's host time goes (GPU probe): per backend, ms per call back to back, the
host's enqueue time per call, and for torchfuse a cProfile of its calls by own time.

    python benchmarks/probes/zoo_host.py --only gru,distilbert --dtype fp32 [--calls 20]

A row is host-bound when its enqueue time is close to its back-to-back time: then the
cProfile table says which Python calls of the wrapper, the launchers or Dynamo's guards cost it.
"""
from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

import torchfuse  # noqa: E402,F401  (registers the backend)
from zoo import compile_with  # noqa: E402
from zoo_models import BY_NAME  # noqa: E402


def _row(name: str, dtype: torch.dtype, backend: str, calls: int, top: int) -> str:
    torch._dynamo.reset()
    model, inputs = BY_NAME[name].make("gpu", "cuda", dtype)
    model.eval()
    fn = compile_with(backend, model)
    with torch.no_grad():
        for _ in range(3):
            fn(*inputs)
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(calls):
            fn(*inputs)
        torch.cuda.synchronize()
        wall = (time.perf_counter() - t) / calls * 1e3
        # enqueue time: the host's own cost per call, measured while the GPU is busy elsewhere
        # would be ideal; a synchronize before each call bounds it from above instead
        enqueue = 0.0
        for _ in range(calls):
            torch.cuda.synchronize()
            t = time.perf_counter()
            fn(*inputs)
            enqueue += time.perf_counter() - t
        torch.cuda.synchronize()
        text = f"## {name} {dtype} {backend}: {wall:.3f} ms/call back to back, host enqueue {enqueue / calls * 1e3:.3f} ms/call\n"
        if backend == "torchfuse":
            pr = cProfile.Profile()
            pr.enable()
            for _ in range(calls):
                fn(*inputs)
            pr.disable()
            torch.cuda.synchronize()
            s = io.StringIO()
            pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(top)
            text += s.getvalue()
    return text


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", required=True)
    ap.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    ap.add_argument("--backends", default="inductor,torchfuse")
    ap.add_argument("--calls", type=int, default=20)
    ap.add_argument("--top", type=int, default=25)
    args = ap.parse_args()
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
    for name in args.only.split(","):
        for backend in args.backends.split(","):
            print(_row(name, dtype, backend, args.calls, args.top), flush=True)


if __name__ == "__main__":
    main()
