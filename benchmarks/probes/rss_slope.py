"""Resident-memory growth per compile, torchfuse next to Dynamo alone: which part of a
long-running process's growth is torchfuse's?

    python benchmarks/probes/rss_slope.py --backends eager,aot_eager,torchfuse,torchfuse-nogc --compiles 250

Each backend runs in its own process: N compiles of one softmax function at N distinct shapes
(dynamic=False), each followed by `torch._dynamo.reset()` and a clear of torch's cache-artifact
recorder, the resident set sampled every 25 compiles; the slope is a least-squares fit over the
samples after the first 100 compiles (warm-up: imports, lazily built tables).  "eager" is
Dynamo's trace alone; "torchfuse-nogc" is torchfuse with its graph cache off.
"""
from __future__ import annotations

import argparse
import subprocess
import sys

CHILD = r'''
import gc, sys, statistics, torch, torchfuse
backend, n = sys.argv[1], int(sys.argv[2])
options = {}
if backend.startswith("torchfuse"):
    options = {"options": {"memory_cache_size": 8, "graph_cache": backend != "torchfuse-nogc"}}
    backend = "torchfuse"
try:
    from torch.compiler._cache import CacheArtifactManager
except ImportError:
    CacheArtifactManager = None

def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096

def fn(x):
    return torch.softmax(x * 2 + 1, -1).sum(0)

xs, ys = [], []
with torch._dynamo.config.patch(cache_size_limit=64, accumulated_cache_size_limit=1024):
    for i in range(n):
        x = torch.randn(3, 5 + i)
        torch.testing.assert_close(torch.compile(fn, backend=backend, dynamic=False, **options)(x), fn(x))
        torch._dynamo.reset()
        if CacheArtifactManager is not None:
            CacheArtifactManager.clear()
        if i % 25 == 24:
            gc.collect()
            xs.append(i)
            ys.append(rss())
sx, sy = xs[4:], ys[4:]
mx, my = statistics.mean(sx), statistics.mean(sy)
print("SLOPE", sum((a - mx) * (b - my) for a, b in zip(sx, sy)) / sum((a - mx) ** 2 for a in sx) / 1024)
'''


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backends", default="eager,aot_eager,torchfuse,torchfuse-nogc")
    ap.add_argument("--compiles", type=int, default=250)
    args = ap.parse_args()
    assert args.compiles >= 150, "the fit starts after 100 compiles"
    rows = []
    for backend in args.backends.split(","):
        proc = subprocess.run([sys.executable, "-c", CHILD, backend, str(args.compiles)], capture_output=True, text=True)
        slope = next((line.split()[1] for line in proc.stdout.splitlines() if line.startswith("SLOPE")), None)
        rows.append((backend, "error: " + proc.stderr.strip().splitlines()[-1][:200] if slope is None
                     else f"{float(slope):.0f}"))
        print(*rows[-1], flush=True)
    print("\n| backend | RSS growth KB per compile |\n|---|---|")
    for backend, slope in rows:
        print(f"| {backend} | {slope} |")


if __name__ == "__main__":
    main()
