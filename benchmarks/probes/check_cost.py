"""What the run-time index checks cost on gather-heavy kernels (codegen/checks.py): each case
compiled twice, with the checks (the default) and with `runtime_checks=False`, timed in
interleaved rounds in one process.

    python benchmarks/probes/check_cost.py [--rounds 30] [--threads 1] [--only embedding,relpos]
    python benchmarks/probes/check_cost.py --device cuda       # Triton (host and device time)

Cases: an embedding lookup + GELU, a GNN edge gather (both ends of every edge), a decode step
(a KV cache written at the step's position, rotary tables gathered at it), and a relative-position
bias (a table gathered by a relative-index matrix, Swin-style) added to attention scores before a
softmax.  Per case: min and median ms per block of calls, checks on / off, and the cost
(on / off - 1) from the min and the median.  One thread by default (the checks' cost per element
is what is measured; threads only divide it).
"""
from __future__ import annotations

import argparse
import gc
import statistics
import time
from typing import Callable

import torch
import torch.nn.functional as F

import torchfuse  # noqa: F401  (registers the backend)


def embedding_gelu(dev: str) -> tuple[Callable, tuple]:
    table = torch.randn(32000, 512, device=dev)
    ids = torch.randint(0, 32000, (8, 129), device=dev)
    return (lambda t, i: F.gelu(F.embedding(i, t))), (table, ids)


def gnn_gather(dev: str) -> tuple[Callable, tuple]:
    x = torch.randn(10007, 64, device=dev)
    edges = torch.randint(0, 10007, (2, 50021), device=dev)
    return (lambda x, e: torch.relu(x[e[0]] + x[e[1]])), (x, edges)


def decode(dev: str) -> tuple[Callable, tuple]:
    heads, dim, maxlen = 16, 64, 1024
    k_cache = torch.randn(4, heads, maxlen, dim, device=dev)
    cos, sin = torch.randn(maxlen, dim, device=dev), torch.randn(maxlen, dim, device=dev)
    k = torch.randn(4, heads, 1, dim, device=dev)
    pos = torch.tensor([517], device=dev)

    def step(k_cache, k, cos, sin, pos):
        c, s = cos[pos], sin[pos]                                 # [1, dim]
        k1, k2 = k.chunk(2, -1)
        k = k * c + torch.cat([-k2, k1], -1) * s
        k_cache.index_copy_(2, pos, k)
        return k_cache.sum(-1)
    return step, (k_cache, k, cos, sin, pos)


def relpos_softmax(dev: str) -> tuple[Callable, tuple]:
    win, heads, windows = 7, 4, 64
    n = win * win
    coords = torch.stack(torch.meshgrid(torch.arange(win), torch.arange(win), indexing="ij")).flatten(1)
    rel = (coords[:, :, None] - coords[:, None, :]).permute(1, 2, 0) + (win - 1)
    index = (rel[..., 0] * (2 * win - 1) + rel[..., 1]).to(dev)          # [n, n], in range
    table = torch.randn((2 * win - 1) ** 2, heads, device=dev)
    scores = torch.randn(windows, heads, n, n, device=dev)

    def attn(scores, table, index):
        bias = table[index.view(-1)].view(n, n, heads).permute(2, 0, 1)
        return torch.softmax(scores + bias, -1)
    return attn, (scores, table, index)


CASES = {"embedding": embedding_gelu, "gnn": gnn_gather, "decode": decode, "relpos": relpos_softmax}


def _block(fn: Callable, args: tuple, calls: int, sync: Callable) -> float:
    sync()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn(*args)
    sync()
    return (time.perf_counter() - t0) / calls


def measure(name: str, dev: str, rounds: int) -> dict[str, list[float]]:
    fn, args = CASES[name](dev)
    sync = torch.cuda.synchronize if dev == "cuda" else (lambda: None)
    compiled = {}
    for label, opts in (("on", {}), ("off", {"runtime_checks": False})):
        torch._dynamo.reset()
        c = torch.compile(fn, backend="torchfuse", options=opts)
        fresh = tuple(a.clone() for a in args)
        want = fn(*tuple(a.clone() for a in args))
        got = c(*fresh)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
        compiled[label] = (c, fresh)
    est = min(_block(c, a, 3, sync) for c, a in compiled.values())
    calls = max(1, int(0.005 / max(est, 1e-7)))   # ~5 ms blocks: many short rounds, min of them
    out: dict[str, list[float]] = {"on": [], "off": []}
    gc.disable()
    try:
        for r in range(rounds):
            for label in (("on", "off") if r % 2 == 0 else ("off", "on")):
                c, a = compiled[label]
                out[label].append(_block(c, a, calls, sync))
    finally:
        gc.enable()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--only", default="", help="comma-separated cases: " + ",".join(CASES))
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    names = [n for n in a.only.split(",") if n] or list(CASES)
    print(f"{a.device}, {a.threads} thread(s), {a.rounds} interleaved rounds; ms per call")
    print(f"| case | on min | off min | cost (min) | on median | off median | cost (median) |")
    print("|---|---|---|---|---|---|---|")
    with torch.no_grad():
        for name in names:
            t = measure(name, a.device, a.rounds)
            on, off = min(t["on"]) * 1e3, min(t["off"]) * 1e3
            mon, moff = statistics.median(t["on"]) * 1e3, statistics.median(t["off"]) * 1e3
            print(f"| {name} | {on:.4f} | {off:.4f} | {100 * (on / off - 1):+.1f}% | {mon:.4f} | {moff:.4f} | "
                  f"{100 * (mon / moff - 1):+.1f}% |", flush=True)


if __name__ == "__main__":
    main()
