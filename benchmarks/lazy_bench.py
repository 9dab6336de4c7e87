"""Benchmark of torchfuse.lazy (eager micro-fusion) on CPU.

    python benchmarks/lazy_bench.py            # full run (a few minutes on 2 cores)
    python benchmarks/lazy_bench.py --quick    # smaller sizes and fewer repeats
    python benchmarks/lazy_bench.py --device cuda

Four parts, printed as one markdown table:
  1. interception overhead: microseconds per op on a tiny tensor, eager vs the floor (a
     TorchDispatchMode that only runs each op) vs recorded inside a lazy block (recording only:
     the flush is outside the timed region; a program seen before, so the ops are predicted);
  1b. per-flush cost: a 6-op chain on a tiny tensor, time to record it and time to flush it
     (a replayed flush: running the cached compiled graph, publishing the result);
  2. a 6-op pointwise chain on a large tensor: eager vs lazy (steady state: the compiled graph
     comes from the cache) vs torch.compile(backend="torchfuse");
  3. GPT-2 (HuggingFace, random weights) inference under no_grad at three batch x sequence
     sizes: eager vs floor vs lazy (the model compiled from its second call in a block,
     lazy/capture.py) vs lazy recording every op (capture_modules=False) vs
     torch.compile(backend="torchfuse");
  4. a GPT-2 training step: eager vs lazy vs lazy recording every op.
Times are medians over interleaved repeats; "lazy vs eager" is eager time / lazy time.
"""
from __future__ import annotations

import os
import tempfile

_CACHE_ROOT = tempfile.mkdtemp(prefix="torchfuse_lazy_bench_")
os.environ.setdefault("TORCHFUSE_CACHE_DIR", os.path.join(_CACHE_ROOT, "torchfuse"))

import argparse  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
import warnings  # noqa: E402
from typing import Callable  # noqa: E402

os.environ.setdefault("TORCHFUSE_FIRST_CALLS", "wait")   # timings are of compiled graphs, not the ATen tier
import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

import torchfuse  # noqa: E402


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def timeit(fns: dict[str, Callable[[], object]], device: str, repeats: int, inner: int) -> dict[str, float]:
    """Median seconds per call of each fn, measured round-robin so that machine load hits all."""
    for fn in fns.values():
        fn()
        fn()
    sync(device)
    samples: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            sync(device)
            t0 = time.perf_counter()
            for _ in range(inner):
                fn()
            sync(device)
            samples[name].append((time.perf_counter() - t0) / inner)
    return {k: statistics.median(v) for k, v in samples.items()}


# --------------------------------------------------------------------------------------------
# 1. interception overhead
# --------------------------------------------------------------------------------------------

OPS: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "add scalar (x + 1.0)": lambda x, y: x + 1.0,
    "mul tensor (x * y)": lambda x, y: x * y,
    "relu": lambda x, y: x.relu(),
    "sum(-1) (reduction)": lambda x, y: x.sum(-1),
    "view (x.view(-1))": lambda x, y: x.view(-1),
}


class Floor(TorchDispatchMode):
    """The floor of any design that intercepts aten ops at the dispatcher: a mode that only runs
    each op.  Its handler is assigned after the class body, as torchfuse.lazy's is (one defined in
    the body is wrapped by torch._disable_dynamo, about 0.5 us more per op)."""


def _run_op(self: Floor, func: Callable, types: object, args: tuple = (), kwargs: dict | None = None) -> object:
    return func(*args, **(kwargs or {}))


Floor.__torch_dispatch__ = _run_op  # type: ignore[method-assign]


def interception_overhead(device: str, n: int, repeats: int) -> list[tuple[str, float, float, float]]:
    """(op, eager us/op, floor us/op, lazy-recorded us/op).  Each measurement applies the op `n`
    times to a tiny tensor; the lazy block records them (max_nodes large enough that nothing
    flushes inside the timed region), then its exit flushes outside the timed region.  The
    repeats after the first record a program seen before: the ops are predicted (trace.py)."""
    x = torch.randn(4, 8, device=device)
    y = torch.randn(4, 8, device=device)
    rows = []
    for name, op in OPS.items():
        eager, floor, lazy = [], [], []
        for _ in range(repeats):
            sync(device)
            t0 = time.perf_counter()
            for _ in range(n):
                op(x, y)
            sync(device)
            eager.append((time.perf_counter() - t0) / n)
            with Floor():
                t0 = time.perf_counter()
                for _ in range(n):
                    op(x, y)
                sync(device)
                floor.append((time.perf_counter() - t0) / n)
            with torchfuse.lazy(max_nodes=10 * n):
                a, b = x + 0.0, y * 1.0          # pending inputs: the common case inside a block
                t0 = time.perf_counter()
                outs = [op(a, b) for _ in range(n)]
                lazy.append((time.perf_counter() - t0) / n)
                del outs
        rows.append((name, *(1e6 * statistics.median(v) for v in (eager, floor, lazy))))
    return rows


def flush_cost(device: str, repeats: int) -> tuple[float, float, float]:
    """(eager us, record us, flush us) of `chain6` on a 4x8 tensor, medians."""
    x = torch.randn(4, 8, device=device)
    ctx = torchfuse.lazy()
    for _ in range(3):
        with ctx:
            y = chain6(x)            # held: a dropped value is never computed
    rec, fl, eager = [], [], []
    for _ in range(repeats * 20):
        t0 = time.perf_counter()
        ctx.__enter__()
        y = chain6(x)
        t1 = time.perf_counter()
        ctx.__exit__(None, None, None)
        sync(device)
        t2 = time.perf_counter()
        chain6(x)
        sync(device)
        t3 = time.perf_counter()
        rec.append(t1 - t0)
        fl.append(t2 - t1)
        eager.append(t3 - t2)
    del y
    return tuple(1e6 * statistics.median(v) for v in (eager, rec, fl))  # type: ignore[return-value]


# --------------------------------------------------------------------------------------------
# 2. pointwise chain, 3. GPT-2
# --------------------------------------------------------------------------------------------

def chain6(x: torch.Tensor) -> torch.Tensor:
    return ((x * 1.25 + 0.5).relu() - 0.125).exp().sigmoid()


def pointwise_chain(device: str, numel: int, repeats: int) -> dict[str, float]:
    x = torch.randn(numel, device=device)
    lazy_chain = torchfuse.lazy(chain6)
    compiled = torchfuse.compile(chain6)     # = torch.compile(chain6, backend="torchfuse")
    torch.testing.assert_close(lazy_chain(x), chain6(x))
    torch.testing.assert_close(compiled(x), chain6(x))
    return timeit({"eager": lambda: chain6(x), "lazy": lambda: lazy_chain(x),
                   "torch.compile(torchfuse)": lambda: compiled(x)}, device, repeats, inner=5)


def gpt2(device: str, layers: int, embd: int, seq: int, batch: int, repeats: int) -> dict[str, float] | None:
    try:
        import transformers
    except ImportError:
        return None
    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=layers, n_embd=embd, n_head=max(1, embd // 64), vocab_size=2048,
                                  n_positions=max(seq, 64))
    model = transformers.GPT2LMHeadModel(cfg).eval().to(device)
    ids = torch.randint(0, 2048, (batch, seq), device=device)
    compiled = torchfuse.compile(model)      # = torch.compile(model, backend="torchfuse")

    def eager() -> torch.Tensor:
        with torch.no_grad():
            return model(ids).logits

    def lazy() -> torch.Tensor:
        with torch.no_grad(), torchfuse.lazy():
            out = model(ids).logits
        return out

    def lazy_recording() -> torch.Tensor:
        with torch.no_grad(), torchfuse.lazy(capture_modules=False):
            out = model(ids).logits
        return out

    def lazy_eager_mm() -> torch.Tensor:
        with torch.no_grad(), torchfuse.lazy(defer_matmuls=False, capture_modules=False):
            out = model(ids).logits
        return out

    def comp() -> torch.Tensor:
        with torch.no_grad():
            return compiled(ids).logits

    def floor() -> torch.Tensor:
        with torch.no_grad(), Floor():
            return model(ids).logits

    ref = eager()
    for _ in range(2):       # the first call is recorded, the second compiles the model (capture.py)
        torch.testing.assert_close(lazy(), ref, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(lazy_recording(), ref, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(lazy_eager_mm(), ref, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(comp(), ref, atol=1e-3, rtol=1e-3)
    return timeit({"eager": eager, "floor": floor, "lazy": lazy, "lazy(capture_modules=False)": lazy_recording,
                   "lazy(defer_matmuls=False)": lazy_eager_mm, "torch.compile(torchfuse)": comp},
                  device, repeats, inner=2)


def gpt2_training(device: str, layers: int, embd: int, seq: int, batch: int, repeats: int) -> dict[str, float]:
    """A training step (forward, loss, backward, SGD step, zero_grad): eager, lazy (the model's
    calls compiled from the second step), lazy recording every op."""
    import transformers
    torch.manual_seed(0)
    # (no dropout: compiled code draws other random numbers than eager, and the losses are compared)
    cfg = transformers.GPT2Config(n_layer=layers, n_embd=embd, n_head=max(1, embd // 64), vocab_size=2048,
                                  n_positions=max(seq, 64), resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    models = {k: transformers.GPT2LMHeadModel(cfg).train().to(device) for k in ("eager", "lazy", "recording")}
    for m in models.values():
        m.load_state_dict(models["eager"].state_dict())
    opts = {k: torch.optim.SGD(m.parameters(), lr=1e-3) for k, m in models.items()}
    ids = torch.randint(0, 2048, (batch, seq), device=device)
    blocks = {"lazy": torchfuse.lazy(), "recording": torchfuse.lazy(capture_modules=False)}

    def step(k: str) -> torch.Tensor:
        loss = models[k](ids, labels=ids).loss
        loss.backward()
        opts[k].step()
        opts[k].zero_grad()
        return loss.detach()

    def runner(k: str) -> Callable[[], torch.Tensor]:
        if k == "eager":
            return lambda: step(k)

        def run() -> torch.Tensor:
            with blocks[k]:
                return step(k)
        return run
    fns = {k: runner(k) for k in models}
    for _ in range(2):
        losses = {k: fn() for k, fn in fns.items()}
        torch.testing.assert_close(losses["lazy"], losses["eager"], atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(losses["recording"], losses["eager"], atol=1e-4, rtol=1e-4)
    return timeit({"eager": fns["eager"], "lazy": fns["lazy"], "lazy(capture_modules=False)": fns["recording"]},
                  device, repeats, inner=1)


def lazy_flush_profile(device: str, layers: int, embd: int, seq: int, batch: int, defer: bool = True) -> str:
    import transformers
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=layers, n_embd=embd, n_head=max(1, embd // 64), vocab_size=2048,
                                  n_positions=max(seq, 64))
    model = transformers.GPT2LMHeadModel(cfg).eval().to(device)
    ids = torch.randint(0, 2048, (batch, seq), device=device)
    with torch.no_grad():
        with torchfuse.lazy(defer_matmuls=defer, capture_modules=False):
            out = model(ids).logits          # held: dropped values are never computed
        with torchfuse.lazy(defer_matmuls=defer, capture_modules=False) as ctx:
            out = model(ids).logits
    del out
    ops = sum(f.ops for f in ctx.flushes)
    return (f"{len(ctx.flushes)} flushes, {ops} recorded ops, {ctx.kernels} kernel launches, "
            f"{sum(f.cache_hit for f in ctx.flushes)}/{len(ctx.flushes)} cache hits")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=0, help="torch.set_num_threads (0: leave as is)")
    args = ap.parse_args()
    device = args.device
    if args.threads:
        torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore")
    quick = args.quick
    reps = 5 if quick else 15
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, device {device}\n")

    lines = ["| benchmark | eager | floor | lazy | torch.compile(torchfuse) | lazy vs eager | note |",
             "|---|---|---|---|---|---|---|"]
    for name, e, fl, lz in interception_overhead(device, 100 if quick else 200, reps):
        lines.append(f"| overhead/op: {name} | {e:.1f} us | {fl:.1f} us | {lz:.1f} us | - | - | "
                     f"recording only, {lz / fl:.2f}x the floor |")

    e, r, f = flush_cost(device, reps)
    lines.append(f"| per-flush: 6-op chain, 4x8 (record / flush) | {e:.1f} us | - | {r:.1f} + {f:.1f} us | - | - | "
                 f"record 6 ops, then flush: replayed, run, publish |")

    numel = (1 << 20) if quick else (1 << 24)
    t = pointwise_chain(device, numel, reps)
    lines.append(f"| 6-op pointwise chain, {numel:,} fp32 | {1e3 * t['eager']:.2f} ms | - | {1e3 * t['lazy']:.2f} ms | "
                 f"{1e3 * t['torch.compile(torchfuse)']:.2f} ms | {t['eager'] / t['lazy']:.2f}x | "
                 f"1 kernel, cached graph |")

    layers, embd = (2, 128) if quick else (4, 256)
    shapes = ((1, 32), (2, 64), (4, 128)) if quick else ((1, 64), (4, 128), (8, 256))
    for batch, seq in shapes:
        t = gpt2(device, layers, embd, seq, batch, reps)
        if t is None:
            lines.append("| GPT-2 | - | - | - | - | - | transformers not installed |")
            break
        prof = lazy_flush_profile(device, layers, embd, seq, batch)
        lines.append(f"| GPT-2 inference (n_layer={layers}, n_embd={embd}, batch={batch}, seq={seq}) | "
                     f"{1e3 * t['eager']:.2f} ms | {1e3 * t['floor']:.2f} ms | {1e3 * t['lazy']:.2f} ms | "
                     f"{1e3 * t['torch.compile(torchfuse)']:.2f} ms | {t['eager'] / t['lazy']:.2f}x | "
                     f"model compiled from its 2nd call |")
        t1 = t["lazy(capture_modules=False)"]
        lines.append(f"| same, lazy(capture_modules=False) | {1e3 * t['eager']:.2f} ms | - | {1e3 * t1:.2f} ms | - | "
                     f"{t['eager'] / t1:.2f}x | every op recorded: {prof} |")
        if (batch, seq) == shapes[1]:
            prof = lazy_flush_profile(device, layers, embd, seq, batch, defer=False)
            t2 = t["lazy(defer_matmuls=False)"]
            lines.append(f"| same, lazy(defer_matmuls=False, capture_modules=False) | {1e3 * t['eager']:.2f} ms | - | "
                         f"{1e3 * t2:.2f} ms | - | {t['eager'] / t2:.2f}x | {prof} |")
    if t is not None:
        batch, seq = shapes[1]
        t = gpt2_training(device, layers, embd, seq, batch, reps)
        lines.append(f"| GPT-2 training step (n_layer={layers}, n_embd={embd}, batch={batch}, seq={seq}) | "
                     f"{1e3 * t['eager']:.2f} ms | - | {1e3 * t['lazy']:.2f} ms | - | {t['eager'] / t['lazy']:.2f}x | "
                     f"forward and backward compiled from the 2nd step |")
        t1 = t["lazy(capture_modules=False)"]
        lines.append(f"| same, lazy(capture_modules=False) | {1e3 * t['eager']:.2f} ms | - | {1e3 * t1:.2f} ms | - | "
                     f"{t['eager'] / t1:.2f}x | every op recorded |")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
