"""GPU probe for torchfuse.lazy: where a lazy block's time goes on a CUDA device.

    python benchmarks/probes/lazy_gpu_probe.py            # CUDA (about 1-3 minutes)
    python benchmarks/probes/lazy_gpu_probe.py --device cpu --quick   # smoke test of the script

Rows (each one independent: a failure prints its error and the probe goes on):
  1. recording overhead per op on a tiny tensor (host only, nothing runs on the GPU);
  2. per-flush host cost: a 6-op chain on a tiny tensor, split into record / flush time, and
     host syncs seen during a flush (torch.cuda.set_sync_debug_mode);
  3. the 6-op pointwise chain on 64M fp32 elements: eager vs lazy vs
     torch.compile(backend="torchfuse"), steady state, with recompiles counted and the lazy
     call's host-only (enqueue) time next to its GPU time;
  4. GPT-2 small (12 layers, 768 wide, random weights, no_grad) at batch 1 seq 128 (host-bound)
     and batch 8 seq 512 (GPU-bound): eager vs lazy (default: CUDA pipelining where the work is
     large) vs lazy(pipeline_ops=0) (off) vs lazy(pipeline_ops=128) (always) vs a dispatch
     mode that does nothing (the floor of the design),
     flushes/ops/kernels/host syncs per forward and first-call time; then new sequence
     lengths, graphs compiled per length.
Prints a short table; with $OUT set writes lazy_gpu_probe.json (all numbers, errors, GPT-2's
flush log) there.  Times are medians of interleaved repeats, synchronized.
"""
from __future__ import annotations

import os
import tempfile

os.environ.setdefault("TORCHFUSE_CACHE_DIR", tempfile.mkdtemp(prefix="torchfuse_lazy_probe_"))

import argparse  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402
import warnings  # noqa: E402
from typing import Any, Callable  # noqa: E402

import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "src"))
import torchfuse  # noqa: E402
from torchfuse import counters  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from lazy_bench import interception_overhead, sync, timeit  # noqa: E402  (the same measurements)

START = time.perf_counter()
BUDGET_S = 420.0
ROWS: list[tuple[str, str, str, str, str]] = []     # name, eager, lazy, compiled, note
DETAILS: dict[str, Any] = {}


def row(name: str, fn: Callable[[], None]) -> None:
    left = BUDGET_S - (time.perf_counter() - START)
    if left < 10:
        ROWS.append((name, "-", "-", "-", "skipped: time budget"))
        return
    try:
        fn()
    except Exception as e:      # one row failing must not lose the others
        ROWS.append((name, "-", "-", "-", f"ERROR {type(e).__name__}: {str(e)[:120]}"))
        DETAILS[f"error: {name}"] = traceback.format_exc()


def chain6(x: torch.Tensor) -> torch.Tensor:
    return ((x * 1.25 + 0.5).relu() - 0.125).exp().sigmoid()


# --------------------------------------------------------------------------------------------

def per_op(device: str, quick: bool) -> None:
    n, reps = (100, 5) if quick else (200, 11)
    out = {}
    for name, e, lz in interception_overhead(device, n, reps):
        out[name] = {"eager_us": e, "lazy_record_us": lz}
        ROWS.append((f"overhead/op: {name}", f"{e:.1f} us", f"{lz:.1f} us", "-", "recording only (host)"))
    DETAILS["per_op"] = out


def per_flush(device: str, quick: bool) -> None:
    x = torch.randn(4, 8, device=device)
    ctx = torchfuse.lazy()
    for _ in range(3):
        with ctx:
            y = chain6(x)          # held: a dropped value is never computed
    n = 200 if quick else 1000
    rec, fl = [], []
    before = dict(counters)
    sync(device)
    t_all = time.perf_counter()
    for _ in range(n):
        t0 = time.perf_counter()
        ctx.__enter__()
        y = chain6(x)
        t1 = time.perf_counter()
        ctx.__exit__(None, None, None)
        t2 = time.perf_counter()
        rec.append(t1 - t0)
        fl.append(t2 - t1)
    sync(device)
    total = (time.perf_counter() - t_all) / n    # mean, GPU included
    d = {k: counters[k] - before.get(k, 0) for k in counters if counters[k] != before.get(k, 0)}
    syncs = None
    if device == "cuda":
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                with ctx:
                    y = chain6(x)
                del y           # the result is dropped inside the sync-checked window
            finally:
                torch.cuda.set_sync_debug_mode("default")
        syncs = [f"{w.filename}:{w.lineno}: {str(w.message)[:160]}" for w in caught
                 if "synchroniz" in str(w.message).lower()]
    r, f = 1e6 * statistics.median(rec), 1e6 * statistics.median(fl)
    eager = timeit({"eager": lambda: chain6(x)}, device, 5, 50)["eager"]
    DETAILS["per_flush"] = {"record_6_ops_us": r, "flush_us": f, "block_total_us": 1e6 * total,
                            "eager_chain_us": 1e6 * eager, "counters": d, "host_syncs_in_flush": syncs}
    ROWS.append(("per-flush host cost (6-op chain, 4x8)", f"{1e6 * eager:.1f} us", f"{1e6 * total:.1f} us", "-",
                 f"record {r:.1f} us + flush {f:.1f} us; {len(syncs) if syncs is not None else '-'} host syncs; "
                 f"{d.get('lazy_compiles', 0)} compiles, {d.get('lazy_cache_hits', 0)} hits"))


def big_chain(device: str, quick: bool) -> None:
    numel = (1 << 20) if quick or device != "cuda" else 64 * (1 << 20)
    x = torch.randn(numel, device=device)
    lazy_chain = torchfuse.lazy(chain6)
    compiled = torchfuse.compile(chain6)
    torch.testing.assert_close(lazy_chain(x), chain6(x))
    torch.testing.assert_close(compiled(x), chain6(x))
    before = dict(counters)
    reps = 5 if quick else 15
    t = timeit({"eager": lambda: chain6(x), "lazy": lambda: lazy_chain(x),
                "compiled": lambda: compiled(x)}, device, reps, inner=5)
    d = {k: counters[k] - before.get(k, 0) for k in counters if counters[k] != before.get(k, 0)}
    # host-only time of a lazy call (enqueue: record + flush + launch), the GPU still running
    sync(device)
    host = []
    for _ in range(20):
        t0 = time.perf_counter()
        lazy_chain(x)
        host.append(time.perf_counter() - t0)
        sync(device)
    host_ms = 1e3 * statistics.median(host)
    gbps = {k: 2 * 4 * numel / v / 1e9 for k, v in t.items()}
    DETAILS["chain"] = {"numel": numel, "ms": {k: 1e3 * v for k, v in t.items()}, "GB/s_min_traffic": gbps,
                        "lazy_host_only_ms": host_ms, "counters_during_timing": d,
                        "flushes": [str(f) for f in lazy_chain.lazy_context.flushes[-3:]]}
    ROWS.append((f"6-op chain, {numel:,} fp32", f"{1e3 * t['eager']:.3f} ms", f"{1e3 * t['lazy']:.3f} ms",
                 f"{1e3 * t['compiled']:.3f} ms",
                 f"lazy {t['eager'] / t['lazy']:.2f}x eager, compile {t['eager'] / t['compiled']:.2f}x; lazy host-only "
                 f"{host_ms:.3f} ms; recompiles in timing: {d.get('lazy_compiles', 0)}"))


class _NoopMode(TorchDispatchMode):
    """The floor of any TorchDispatchMode design: a mode that only runs each op."""


def _noop_dispatch(self: Any, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
    return func(*args, **(kwargs or {}))


_NoopMode.__torch_dispatch__ = _noop_dispatch     # outside the class body: no Dynamo wrapper


def _syncs_during(device: str, fn: Callable[[], Any]) -> list[str] | None:
    if device != "cuda":
        fn()
        return None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return [f"{w.filename}:{w.lineno}: {str(w.message)[:160]}" for w in caught
            if "synchroniz" in str(w.message).lower()]


def gpt2(device: str, quick: bool) -> None:
    """GPT-2 small under lazy(): a host-bound shape (batch 1, seq 128) and a GPU-bound one
    (batch 8, seq 512), each against eager and against the floor of a dispatch mode that
    does nothing; lazy with its default CUDA pipelining and with it off; then new sequence
    lengths (compiles counted)."""
    try:
        import transformers
    except ImportError:
        ROWS.append(("GPT-2 small", "-", "-", "-", "transformers not importable"))
        return
    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    if quick:
        cfg = transformers.GPT2Config(n_layer=2, n_embd=128, n_head=2, vocab_size=2048, n_positions=128)
        shapes = [(1, 64), (2, 96)]
    else:
        cfg = transformers.GPT2Config()          # GPT-2 small: 12 layers, 768, 12 heads, 50257
        shapes = [(1, 128), (8, 512)]
    model = transformers.GPT2LMHeadModel(cfg).eval().to(device)
    DETAILS["gpt2"] = {"config": f"n_layer={cfg.n_layer} n_embd={cfg.n_embd} vocab={cfg.vocab_size}"}

    def fwd(ids: torch.Tensor) -> torch.Tensor:
        return model(ids, use_cache=False).logits

    for batch, seq in shapes:
        ids = torch.randint(0, cfg.vocab_size, (batch, seq), device=device)
        blocks = {"lazy": torchfuse.lazy(), "lazy_no_pipeline": torchfuse.lazy(pipeline_ops=0),
                  "lazy_pipeline_always": torchfuse.lazy(pipeline_ops=128)}
        if (batch, seq) == shapes[0]:
            blocks["lazy_eager_matmuls"] = torchfuse.lazy(defer_matmuls=False)

        def runner(block: Any) -> Callable[[], torch.Tensor]:
            def run() -> torch.Tensor:
                with torch.no_grad(), block:
                    out = fwd(ids)
                return out
            return run

        def noop() -> torch.Tensor:
            with torch.no_grad(), _NoopMode():
                return fwd(ids)

        with torch.no_grad():
            ref = fwd(ids)
        fns = {"eager": lambda: torch.no_grad()(fwd)(ids), "dispatch_mode_floor": noop}
        first, profile = {}, {}
        for name, block in blocks.items():
            sync(device)
            t0 = time.perf_counter()
            got = runner(block)()
            sync(device)
            first[name] = time.perf_counter() - t0
            torch.testing.assert_close(got, ref, atol=2e-3, rtol=2e-3)
            n0 = len(block.flushes)
            syncs = _syncs_during(device, runner(block))
            new = block.flushes[n0:]
            profile[name] = {"flushes": len(new), "ops": sum(f.ops for f in new),
                             "kernel_launches": sum(f.kernels for f in new),
                             "cache_hits": sum(f.cache_hit for f in new), "host_syncs": syncs,
                             "reasons": [f.reason for f in new]}
            fns[name] = runner(block)
        reps = 5 if quick else 10
        t = timeit(fns, device, reps, inner=2)
        # host-only time of a lazy forward (record + flush + launch), GPU still running
        host = {}
        for name in ("eager", "lazy", "lazy_no_pipeline"):
            vals = []
            for _ in range(5):
                sync(device)
                t0 = time.perf_counter()
                fns[name]()
                vals.append(time.perf_counter() - t0)
            host[name] = 1e3 * statistics.median(vals)
        DETAILS["gpt2"][f"b{batch}_s{seq}"] = {"ms": {k: 1e3 * v for k, v in t.items()}, "first_call_s": first,
                                              "host_only_ms": host, "profile": profile}
        p = profile["lazy"]
        ROWS.append((f"GPT-2 ({cfg.n_layer}L, {cfg.n_embd}) batch {batch} seq {seq}: lazy",
                     f"{1e3 * t['eager']:.2f} ms", f"{1e3 * t['lazy']:.2f} ms", "-",
                     f"{t['eager'] / t['lazy']:.2f}x eager (overhead {100 * (t['lazy'] / t['eager'] - 1):+.0f}%, "
                     f"anchor +38%); {p['flushes']} flushes, {p['ops']} ops, {p['kernel_launches']} kernels; "
                     f"{len(p['host_syncs'] or [])} host syncs; first call {first['lazy']:.1f} s"))
        ROWS.append(("  same, lazy(pipeline_ops=0)", f"{1e3 * t['eager']:.2f} ms",
                     f"{1e3 * t['lazy_no_pipeline']:.2f} ms", "-",
                     f"{t['eager'] / t['lazy_no_pipeline']:.2f}x eager; {profile['lazy_no_pipeline']['flushes']} flush(es)"))
        ROWS.append(("  same, lazy(pipeline_ops=128): pipelined whatever the work", f"{1e3 * t['eager']:.2f} ms",
                     f"{1e3 * t['lazy_pipeline_always']:.2f} ms", "-",
                     f"{t['eager'] / t['lazy_pipeline_always']:.2f}x eager; "
                     f"{profile['lazy_pipeline_always']['flushes']} flush(es)"))
        ROWS.append(("  same, a dispatch mode that does nothing", f"{1e3 * t['eager']:.2f} ms",
                     f"{1e3 * t['dispatch_mode_floor']:.2f} ms", "-",
                     f"{t['eager'] / t['dispatch_mode_floor']:.2f}x eager: the floor of interception at the dispatcher"))
        if "lazy_eager_matmuls" in t:
            q = profile["lazy_eager_matmuls"]
            ROWS.append(("  same, lazy(defer_matmuls=False)", f"{1e3 * t['eager']:.2f} ms",
                         f"{1e3 * t['lazy_eager_matmuls']:.2f} ms", "-",
                         f"{t['eager'] / t['lazy_eager_matmuls']:.2f}x eager; {q['flushes']} flushes"))

    # new sequence lengths: the size-free cache should compile nothing
    block = torchfuse.lazy()
    compiles = []
    for seq in ((48, 80, 100, 77, 130) if not quick else (40, 50, 70)):
        ids = torch.randint(0, cfg.vocab_size, (2, seq), device=device)
        before = counters["lazy_compiles"]
        with torch.no_grad(), block:
            out = fwd(ids)
        with torch.no_grad():
            torch.testing.assert_close(out, fwd(ids), atol=2e-3, rtol=2e-3)
        compiles.append(counters["lazy_compiles"] - before)
    DETAILS["gpt2"]["new_seq_compiles"] = compiles
    ROWS.append(("GPT-2 lazy, batch 2, new sequence lengths", "-", "-", "-",
                 f"graphs compiled per new length: {compiles}"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    device = args.device
    if device == "cuda" and not torch.cuda.is_available():
        print("CUDA is not available; use --device cpu for a smoke test")
        return
    warnings.filterwarnings("ignore")
    name = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    print(f"torch {torch.__version__}, device {name}")
    row("per-op", lambda: per_op(device, args.quick))
    row("per-flush", lambda: per_flush(device, args.quick))
    row("6-op chain", lambda: big_chain(device, args.quick))
    row("GPT-2", lambda: gpt2(device, args.quick))
    print("\n| benchmark | eager | lazy | torch.compile(torchfuse) | note |\n|---|---|---|---|---|")
    for r in ROWS:
        print("| " + " | ".join(r) + " |")
    print(f"\n({time.perf_counter() - START:.0f} s)")
    out = os.environ.get("OUT")
    if out:
        DETAILS["rows"] = ROWS
        DETAILS["device"] = name
        with open(os.path.join(out, "lazy_gpu_probe.json"), "w") as f:
            json.dump(DETAILS, f, indent=1, default=str)
        print(f"details: {os.path.join(out, 'lazy_gpu_probe.json')}")


if __name__ == "__main__":
    main()
