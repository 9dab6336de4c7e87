"""Which row tile should a scatter with atomics use on the GPU?  torchfuse's scatter kernels
against Inductor's, over tile heights and warp counts, for graph-network scatters.

    PYTHONPATH=src python benchmarks/probes/scatter_tiles.py [--graphs gcn,gin,gat] [--dtypes fp32,bf16]
        [--widths 256,128,47] [--nodes 100000] [--edges 1000000]

Graphs (one layer's message passing, the linear layers left out so that the scatter dominates):

    gcn   out = zeros.index_add(0, dst, x[src] * w[:, None])       (GCNConv: per-edge weight)
    gin   out = x + zeros.index_add(0, dst, x[src])                (GINConv / sum aggregation)
    gat   out = zeros.index_add(0, dst, x[src].view(E, 4, F/4) * a[:, :, None])   (GATConv, 4 heads)

For each graph, dtype and feature width: Inductor's time per call, torchfuse's with its own rule
(`launch.row_tile_blocks`), and torchfuse's with each candidate [YBLOCK, XBLOCK] tile and warp
count forced (x = the rule's row width, y and warps varied).  Times are medians of CUDA-event
samples of one call each (gpu_bench.bench).  Prints, per case, the rule's choice, the best candidate, and
Inductor / torchfuse for both; the table last.
"""
from __future__ import annotations

import argparse
import gc
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import gpu_bench  # noqa: E402  (fresh caches, first calls wait for kernels; before torch is imported)
import torch  # noqa: E402

from torchfuse.backends.triton import launch  # noqa: E402


def graphs(n: int, e: int, width: int, dtype: torch.dtype) -> dict:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, width, generator=g).to("cuda", dtype)
    src = torch.randint(0, n, (e,), generator=g).cuda()
    dst = torch.randint(0, n, (e,), generator=g).cuda()
    w = torch.rand(e, generator=g).to("cuda", dtype)
    heads = 4 if width % 4 == 0 else 1
    a = torch.rand(e, heads, generator=g).to("cuda", dtype)

    def gcn(x, src, dst, w):
        return torch.zeros_like(x).index_add(0, dst, x[src] * w[:, None])

    def gin(x, src, dst):
        return x + torch.zeros_like(x).index_add(0, dst, x[src])

    def gat(x, src, dst, a):
        msg = (x[src].view(-1, heads, width // heads) * a[:, :, None]).view(-1, width)
        return torch.zeros_like(x).index_add(0, dst, msg)

    return {"gcn": (gcn, (x, src, dst, w)), "gin": (gin, (x, src, dst)), "gat": (gat, (x, src, dst, a))}


def timed(fn, args) -> float:
    """Median ms per call by CUDA events, one call a sample (the tiles' differences are in the
    kernel, and a scatter's atomics do not overlap the next call's)."""
    return gpu_bench.bench(fn, *args, reps=40, inner=1)


def _clear_plans() -> None:
    """Forget the block sizes chosen for every generated kernel (they are cached on the kernel)."""
    for obj in gc.get_objects():
        try:
            if isinstance(getattr(obj, "__dict__", None), dict) and "_tf_plans" in obj.__dict__:
                del obj.__dict__["_tf_plans"]
        except Exception:
            continue


def torchfuse_ms(fn, args, forced: tuple[int, int] | None) -> tuple[float, tuple | None]:
    """(ms per call, the (XBLOCK, YBLOCK, warps) the row tiles got) with (YBLOCK, warps) forced."""
    rule = launch.row_tile_blocks
    seen: list[tuple] = []

    def patched(xnumel: int, ynumel: int, itemsize: int = 4) -> tuple[int, int, int]:
        x, y, w = rule(xnumel, ynumel, itemsize)
        if forced is not None:
            y, w = forced
        seen.append((x, y, w))
        return x, y, w

    launch.row_tile_blocks = patched
    try:
        torch._dynamo.reset()
        _clear_plans()
        compiled = torch.compile(fn, backend="torchfuse")
        ms = timed(compiled, args)
    finally:
        launch.row_tile_blocks = rule
    return ms, (seen[0] if seen else None)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--graphs", default="gcn,gin,gat")
    p.add_argument("--dtypes", default="fp32,bf16")
    p.add_argument("--widths", default="256,128,47")
    p.add_argument("--nodes", type=int, default=100000)
    p.add_argument("--edges", type=int, default=1000000)
    p.add_argument("--heights", default="4,8,16,32,64")
    p.add_argument("--warps", default="2,4,8")
    a = p.parse_args()
    cands = [(y, w) for y in map(int, a.heights.split(",")) for w in map(int, a.warps.split(","))]
    rows = []
    for dname in a.dtypes.split(","):
        dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[dname]
        for width in map(int, a.widths.split(",")):
            cases = graphs(a.nodes, a.edges, width, dtype)
            for gname in a.graphs.split(","):
                fn, args = cases[gname]
                torch._dynamo.reset()
                ind = timed(torch.compile(fn), args)
                ours, tile = torchfuse_ms(fn, args, None)
                best, best_ms, grid = None, float("inf"), {}
                for cand in cands:
                    try:
                        ms, _ = torchfuse_ms(fn, args, cand)
                    except Exception as e:       # a tile that does not compile (registers) is skipped
                        print(f"  {gname} {dname} {width} {cand}: {type(e).__name__}", flush=True)
                        continue
                    grid[cand] = ms
                    if ms < best_ms:
                        best, best_ms = cand, ms
                row = dict(graph=gname, dtype=dname, width=width, ind=ind, rule=tile, rule_ms=ours,
                           best=best, best_ms=best_ms,
                           grid=" ".join(f"y{y}w{w} {ms:.3f}" for (y, w), ms in grid.items()))
                rows.append(row)
                print(f"{gname} {dname} {width}: Ind {ind:.3f}, rule {tile} {ours:.3f}; {row['grid']}", flush=True)
    print(f"\n{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {__import__('triton').__version__}, "
          f"{a.nodes} nodes, {a.edges} edges")
    print(f"{'graph':5} {'dtype':5} {'width':>5} {'Ind ms':>7} {'rule (x,y,w)':>14} {'rule ms':>7} {'Ind/rule':>8} "
          f"{'best (y,w)':>10} {'best ms':>7} {'Ind/best':>8}")
    for r in rows:
        print(f"{r['graph']:5} {r['dtype']:5} {r['width']:5d} {r['ind']:7.3f} {str(r['rule']):>14} {r['rule_ms']:7.3f} "
              f"{r['ind'] / r['rule_ms']:8.2f} {str(r['best']):>10} {r['best_ms']:7.3f} {r['ind'] / r['best_ms']:8.2f}")


if __name__ == "__main__":
    main()
