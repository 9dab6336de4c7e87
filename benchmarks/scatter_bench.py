"""CPU benchmark of scatter-heavy programs: eager vs Inductor vs torchfuse in one process.

    python benchmarks/scatter_bench.py                 # all four workloads (a few minutes on 2 cores)
    python benchmarks/scatter_bench.py --only gcn,kv   # some of them
    python benchmarks/scatter_bench.py --budget 3      # seconds of timing per workload
    python benchmarks/scatter_bench.py --threads 1     # torch.set_num_threads before compiling
                                                       # (Inductor fixes its thread count then)

Workloads (random data, fixed seed):
  gcn     a GCN layer (degree by scatter_add, gather-multiply messages, index_add, normalized
          self loop) on a random graph of 10k nodes and 100k edges, 64 features
  gat     a GAT layer (per-edge scores, softmax over each node's incoming edges by scatter amax
          and scatter_add, weighted index_add of messages) on the same graph
  embbag  an EmbeddingBag-style sum: 4096 bags of 20 rows of a [100k, 64] table gathered and
          summed into their bags by index_add, and the table's gradient (embedding backward)
  kv      a decode step with a static KV cache ([4, 8, 1024, 64] keys and values, written at a
          tensor position with `cache[:, :, pos] = k` and `index_copy_`), attention over it

Each is compiled with `torch.compile` (Inductor) and `torch.compile(backend="torchfuse")`, checked
against eager, and timed with cpu_bench's interleaved timer (median per call; other load on the
machine is reported and the quietest of a few tries kept).  Ratios > 1: torchfuse is faster.
"""
from __future__ import annotations

import os
import sys
import tempfile

_CACHE_ROOT = tempfile.mkdtemp(prefix="torchfuse_scatter_bench_")
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", os.path.join(_CACHE_ROOT, "inductor"))
os.environ.setdefault("TORCHFUSE_CACHE_DIR", os.path.join(_CACHE_ROOT, "torchfuse"))

import argparse  # noqa: E402
import shutil  # noqa: E402
import time  # noqa: E402
from typing import Any, Callable  # noqa: E402

os.environ.setdefault("TORCHFUSE_FIRST_CALLS", "wait")   # timings are of compiled graphs, not the ATen tier
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import torchfuse  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cpu_bench import _time_quietly  # noqa: E402

NODES, EDGES, FEAT = 10_000, 100_000, 64


def gcn(x, src, dst, w):
    h = x @ w
    deg = torch.zeros(x.shape[0]).scatter_add_(0, dst, torch.ones(dst.shape[0])) + 1
    norm = deg.rsqrt()
    out = torch.zeros_like(h).index_add_(0, dst, h[src] * (norm[src] * norm[dst])[:, None])
    return F.relu(out + h / deg[:, None])


def gat(x, src, dst, w, a_s, a_d):
    n = x.shape[0]
    h = x @ w
    e = F.leaky_relu((h * a_s).sum(-1)[src] + (h * a_d).sum(-1)[dst], 0.2)
    m = torch.full((n,), float("-inf")).scatter_reduce(0, dst, e, "amax", include_self=True)
    p = (e - m[dst]).exp()
    s = torch.zeros(n).scatter_add(0, dst, p)
    return F.elu(torch.zeros_like(h).index_add_(0, dst, h[src] * (p / (s[dst] + 1e-16))[:, None]))


def embbag(table, idx, bag, grad):
    bags = torch.zeros(grad.shape[0], table.shape[1]).index_add_(0, bag, table[idx])
    table_grad = torch.ops.aten.embedding_dense_backward(grad[bag], idx, table.shape[0], -1, False)
    return bags, table_grad


class KVDecode(torch.nn.Module):
    def __init__(self, b=4, h=8, s=1024, d=64):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.register_buffer("k", torch.randn(b, h, s, d, generator=g))
        self.register_buffer("v", torch.randn(b, h, s, d, generator=g))

    def forward(self, pos, k, v, q):
        self.k[:, :, pos] = k
        self.v.index_copy_(2, pos, v)
        att = (q @ self.k.transpose(-1, -2) * 0.125).softmax(-1)
        return att @ self.v


def make(name: str) -> tuple[dict[str, Callable], tuple, Callable]:
    """(a callable per implementation, args, eager reference)."""
    g = torch.Generator().manual_seed(0)
    if name in ("gcn", "gat"):
        x = torch.randn(NODES, FEAT, generator=g)
        src, dst = (torch.randint(0, NODES, (EDGES,), generator=g) for _ in range(2))
        w = torch.randn(FEAT, FEAT, generator=g) / 8
        fn = gcn if name == "gcn" else gat
        args = (x, src, dst, w) if name == "gcn" else (x, src, dst, w, torch.randn(FEAT, generator=g),
                                                        torch.randn(FEAT, generator=g))
        return {"eager": fn, "inductor": torch.compile(fn), "torchfuse": torch.compile(fn, backend="torchfuse")}, \
            args, fn
    if name == "embbag":
        table = torch.randn(100_000, FEAT, generator=g)
        idx = torch.randint(0, 100_000, (4096 * 20,), generator=g)
        bag = torch.arange(4096).repeat_interleave(20)
        grad = torch.randn(4096, FEAT, generator=g)
        fns = {"eager": embbag, "inductor": torch.compile(embbag), "torchfuse": torch.compile(embbag, backend="torchfuse")}
        return fns, (table, idx, bag, grad), embbag
    if name == "kv":
        mods = {impl: KVDecode() for impl in ("eager", "inductor", "torchfuse", "reference")}
        fns = {"eager": mods["eager"], "inductor": torch.compile(mods["inductor"]),
               "torchfuse": torch.compile(mods["torchfuse"], backend="torchfuse")}
        b, h, _, d = mods["eager"].k.shape
        args = (torch.tensor([517]), torch.randn(b, h, 1, d, generator=g), torch.randn(b, h, 1, d, generator=g),
                torch.randn(b, h, 1, d, generator=g))
        return fns, args, mods["reference"]
    raise ValueError(name)


def _max_err(a: Any, b: Any) -> float:
    if isinstance(a, (tuple, list)):
        return max(_max_err(x, y) for x, y in zip(a, b))
    return (a.float() - b.float()).abs().max().item()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", default="gcn,gat,embbag,kv")
    ap.add_argument("--budget", type=float, default=4.0, help="seconds of timing per workload")
    ap.add_argument("--threads", type=int, default=0, help="torch.set_num_threads (0: as is)")
    opts = ap.parse_args(argv)
    if opts.threads:
        torch.set_num_threads(opts.threads)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    print("| workload | eager ms | inductor ms | torchfuse ms | vs eager | vs inductor | torchfuse kernels / ATen ops "
          "| max err | other load |")
    print("|---|---|---|---|---|---|---|---|---|")
    try:
        for name in opts.only.split(","):
            torch._dynamo.reset()
            with torch.no_grad():
                fns, args, ref = make(name)
                expected = ref(*args)
                before = dict(torchfuse.counters)
                compile_s = {}
                for impl in ("inductor", "torchfuse"):
                    t0 = time.perf_counter()
                    out = fns[impl](*args)
                    compile_s[impl] = time.perf_counter() - t0
                    err = _max_err(out, expected)
                kernels = torchfuse.counters["kernels_generated"] - before.get("kernels_generated", 0)
                aten = torchfuse.counters["fallback_ops"] - before.get("fallback_ops", 0)
                times, load = _time_quietly(fns, args, opts.budget, max_wait_s=10.0, attempts=3)
            e, i, t = (times[k] * 1e3 for k in ("eager", "inductor", "torchfuse"))
            print(f"| {name} | {e:.3f} | {i:.3f} | {t:.3f} | {e / t:.2f}x | {i / t:.2f}x | {kernels} / {aten} "
                  f"| {err:.1e} | {'-' if load is None else f'{load:.2f}'} |", flush=True)
    finally:
        shutil.rmtree(_CACHE_ROOT, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
