"""How far fp32 scatter sums land from fp64 when many indices hit few rows: eager, Inductor and
torchfuse side by side, each as a relative RMSE against the same sum in fp64.

    python benchmarks/probes/scatter_accuracy.py [--device cuda] [--backends eager,inductor,torchfuse]

Cases (random values, random indices): an embedding's backward (a T5 relative-position bias
table: 32 buckets x 12 heads gathered over 512 x 512 query/key pairs, then the gradient summed
back into the 32 rows), the same into a 32000-row vocabulary, index_add and scatter_add over a
GNN's edges.  Atomics add in whatever order the threads arrive, each add rounded to fp32: a row
with n colliding adds carries up to ~n roundings, where eager's sort-based CUDA embedding
backward sums a sorted run in short partial sums first.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def cases(device: str) -> dict:
    g = torch.Generator().manual_seed(0)

    def emb_backward(rows: int, dim: int, shape: tuple) -> tuple:
        idx = torch.randint(0, rows, shape, generator=g)
        grad = torch.randn(*shape, dim, generator=g)
        return (lambda gr, i: torch.ops.aten.embedding_dense_backward(gr, i, rows, -1, False)), (grad, idx)

    def index_add(rows: int, dim: int, n: int) -> tuple:
        idx = torch.randint(0, rows, (n,), generator=g)
        src = torch.randn(n, dim, generator=g)
        return (lambda s, i: torch.zeros(rows, dim, dtype=s.dtype, device=s.device).index_add_(0, i, s)), (src, idx)

    def scatter_add(rows: int, dim: int, n: int) -> tuple:
        idx = torch.randint(0, rows, (n, 1), generator=g).expand(n, dim)
        src = torch.randn(n, dim, generator=g)
        return (lambda s, i: torch.zeros(rows, dim, dtype=s.dtype, device=s.device).scatter_add(0, i, s)), (src, idx)

    out = {
        "t5 bias backward 512x512 -> 32 x 12": emb_backward(32, 12, (512, 512)),
        "embedding backward 8x512 -> 32000 x 768": emb_backward(32000, 768, (8, 512)),
        "embedding backward 8x512 -> 100 x 256": emb_backward(100, 256, (8, 512)),
        "index_add 1M edges -> 100k x 64": index_add(100000, 64, 1000000),
        "index_add 1M edges -> 1k x 64": index_add(1000, 64, 1000000),
        "scatter_add 1M edges -> 10k x 16": scatter_add(10000, 16, 1000000),
    }
    return {k: (f, tuple(a.to(device) for a in args)) for k, (f, args) in out.items()}


def compiled(backend: str, fn):
    if backend == "eager":
        return fn
    if backend == "inductor":
        return torch.compile(fn, backend="inductor")
    return torch.compile(fn, backend="torchfuse", options={"strict": True})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--backends", default="eager,inductor,torchfuse")
    a = ap.parse_args()
    import torchfuse  # noqa: F401  (registers the backend)
    backends = a.backends.split(",")
    print(f"| case | {' | '.join(backends)} |  (relative RMSE vs fp64)")
    print("|---|" + "---|" * len(backends))
    for name, (fn, args) in cases(a.device).items():
        ref = fn(*(x.double() if x.is_floating_point() else x for x in args))
        errs = []
        for b in backends:
            torch._dynamo.reset()
            out = compiled(b, fn)(*args)
            errs.append(((out.double() - ref).pow(2).mean().sqrt() / ref.pow(2).mean().sqrt()).item())
        print(f"| {name} | " + " | ".join(f"{e:.2e}" for e in errs) + " |", flush=True)


if __name__ == "__main__":
    main()
