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
  4. GPT-2 small and a Llama-style decoder (random weights, no_grad) in bf16 at batch 8 seq 512
     (GPU-bound) and batch 1 seq 64 (host-bound), GPT-2 in fp32 at batch 1 seq 64: eager vs
     lazy (the model compiled from its second call, lazy/capture.py) vs lazy recording every
     op (capture_modules=False) vs a dispatch mode that does nothing (the floor of recording);
     flushes, ops, kernels, host syncs per forward, first- and second-call time;
  5. a training step (forward, backward, SGD, zero_grad; fp32, batch 4 seq 256) of both models,
     lazy and lazy recording every op;
  6. new batch sizes and sequence lengths: graphs compiled per new size (the first call is
     recorded, the second compiles the model).
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
BUDGET_S = 540.0
ROWS: list[tuple[str, str, str, str, str]] = []     # name, eager, lazy, compiled, note
DETAILS: dict[str, Any] = {}
ONLY: set[str] = set()        # --only: the rows to run


def row(name: str, fn: Callable[[], None]) -> None:
    left = BUDGET_S - (time.perf_counter() - START)
    if left < 10:
        ROWS.append((name, "-", "-", "-", "skipped: time budget"))
        return
    if ONLY and name not in ONLY:
        return
    n0 = len(ROWS)
    try:
        fn()
    except Exception as e:      # one row failing must not lose the others
        ROWS.append((name, "-", "-", "-", f"ERROR {type(e).__name__}: {str(e)[:120]}"))
        DETAILS[f"error: {name}"] = traceback.format_exc()
    for r in ROWS[n0:]:         # as they come: a run cut off by a time limit keeps them
        print("| " + " | ".join(r) + " |", flush=True)


def chain6(x: torch.Tensor) -> torch.Tensor:
    return ((x * 1.25 + 0.5).relu() - 0.125).exp().sigmoid()


# --------------------------------------------------------------------------------------------

def per_op(device: str, quick: bool) -> None:
    n, reps = (100, 5) if quick else (200, 11)
    out = {}
    for name, e, fl, lz in interception_overhead(device, n, reps):
        out[name] = {"eager_us": e, "floor_us": fl, "lazy_record_us": lz}
        ROWS.append((f"overhead/op: {name}", f"{e:.1f} us", f"{lz:.1f} us", "-",
                     f"recording only (host); floor {fl:.1f} us, lazy {lz / fl:.2f}x the floor"))
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


def _model(kind: str, quick: bool, device: str, dtype: torch.dtype) -> tuple[Any, int]:
    """A HuggingFace model from config, random weights: GPT-2 small (12 layers, 768, 50257) or
    a Llama-style decoder (RMSNorm, SwiGLU, rotary embeddings, grouped-query attention)."""
    import transformers
    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    if kind == "gpt2":
        cfg = (transformers.GPT2Config(n_layer=2, n_embd=128, n_head=2, vocab_size=2048, n_positions=128)
               if quick else transformers.GPT2Config())
        cfg.attn_pdrop = cfg.resid_pdrop = cfg.embd_pdrop = 0.0
        model = transformers.GPT2LMHeadModel(cfg)
    else:
        cfg = transformers.LlamaConfig(
            vocab_size=2048 if quick else 32000, hidden_size=128 if quick else 768,
            intermediate_size=256 if quick else 2048, num_hidden_layers=2 if quick else 12,
            num_attention_heads=4 if quick else 12, num_key_value_heads=2 if quick else 4,
            max_position_embeddings=1024)
        model = transformers.LlamaForCausalLM(cfg)
    DETAILS[f"{kind}_config"] = cfg.to_json_string()
    return model.to(device=device, dtype=dtype), cfg.vocab_size


def inference(kind: str, device: str, quick: bool, dtype: torch.dtype, shapes: list[tuple[int, int]]) -> None:
    """Forward under no_grad: eager vs lazy vs a dispatch mode that does nothing (the floor of
    the design); flushes/ops/kernels/host syncs per forward and first-call time."""
    model, vocab = _model(kind, quick, device, dtype)
    model.eval()

    def fwd(ids: torch.Tensor) -> torch.Tensor:
        return model(ids, use_cache=False).logits

    for batch, seq in shapes:
        ids = torch.randint(0, vocab, (batch, seq), device=device)
        # lazy: the model compiled from its second call in a block (lazy/capture.py);
        # lazy_recording: every op recorded (the first call of "lazy" compiles nothing)
        blocks = {"lazy": torchfuse.lazy(), "lazy_recording": torchfuse.lazy(capture_modules=False)}

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
        tol = 2e-3 if dtype == torch.float32 else 5e-2
        for name, block in blocks.items():
            for call in ("first", "second"):
                sync(device)
                t0 = time.perf_counter()
                got = runner(block)()
                sync(device)
                first[f"{name} {call}"] = time.perf_counter() - t0
                torch.testing.assert_close(got, ref, atol=tol, rtol=tol)
            n0 = len(block.flushes)
            syncs = _syncs_during(device, runner(block))
            new = block.flushes[n0:]
            profile[name] = {"flushes": len(new), "ops": sum(f.ops for f in new),
                             "kernel_launches": sum(f.kernels for f in new),
                             "cache_hits": sum(f.cache_hit for f in new), "host_syncs": syncs,
                             "table": str(new) if hasattr(new, "table") else [str(f) for f in new]}
            fns[name] = runner(block)
        t = timeit(fns, device, 5 if quick else 10, inner=2)
        label = f"{kind} {str(dtype)[6:]} batch {batch} seq {seq}"
        DETAILS[label] = {"ms": {k: 1e3 * v for k, v in t.items()}, "first_call_s": first, "profile": profile}
        p = profile["lazy"]
        ROWS.append((f"{label}: lazy", f"{1e3 * t['eager']:.2f} ms", f"{1e3 * t['lazy']:.2f} ms", "-",
                     f"**{t['eager'] / t['lazy']:.2f}x eager**; {p['flushes']} flushes/compiled calls; "
                     f"{len(p['host_syncs'] or [])} host syncs; first call {first['lazy first']:.1f} s, "
                     f"second (compiles the model) {first['lazy second']:.1f} s"))
        p = profile["lazy_recording"]
        ROWS.append(("  same, lazy(capture_modules=False)", f"{1e3 * t['eager']:.2f} ms",
                     f"{1e3 * t['lazy_recording']:.2f} ms", "-",
                     f"{t['eager'] / t['lazy_recording']:.2f}x eager; {p['flushes']} flushes, {p['ops']} ops, "
                     f"{p['kernel_launches']} kernels"))
        ROWS.append(("  same, a dispatch mode that does nothing", f"{1e3 * t['eager']:.2f} ms",
                     f"{1e3 * t['dispatch_mode_floor']:.2f} ms", "-",
                     f"{t['eager'] / t['dispatch_mode_floor']:.2f}x eager: the floor of interception"))


def training(kind: str, device: str, quick: bool, batch: int, seq: int) -> None:
    """A training step (forward, backward, SGD update, zero_grad), fp32: eager vs lazy; the
    loss of the lazy step checked against eager's on a copy of the model."""
    import copy
    model, vocab = _model(kind, quick, device, torch.float32)
    model.train()
    ref = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=1e-3)
    ids = torch.randint(0, vocab, (batch, seq), device=device)
    block = torchfuse.lazy()
    recording = copy.deepcopy(model)
    rec_opt = torch.optim.SGD(recording.parameters(), lr=1e-3)
    rec_block = torchfuse.lazy(capture_modules=False)

    def step(m: Any, o: Any) -> torch.Tensor:
        loss = m(ids, labels=ids, use_cache=False).loss
        loss.backward()
        o.step()
        o.zero_grad()
        return loss.detach()

    def lazy_step() -> torch.Tensor:
        with block:
            return step(model, opt)

    def recording_step() -> torch.Tensor:
        with rec_block:
            return step(recording, rec_opt)

    first = []
    for _ in range(2):           # the second step compiles the model's forward and backward
        sync(device)
        t0 = time.perf_counter()
        got = lazy_step()
        sync(device)
        first.append(time.perf_counter() - t0)
        torch.testing.assert_close(recording_step(), got, atol=1e-3, rtol=1e-3)
        torch.testing.assert_close(got, step(ref, ref_opt), atol=1e-3, rtol=1e-3)
    n0 = len(block.flushes)
    lazy_step()
    new = block.flushes[n0:]
    def floor_step() -> torch.Tensor:
        with _NoopMode():
            return step(ref, ref_opt)

    t = timeit({"eager": lambda: step(ref, ref_opt), "lazy": lazy_step, "lazy_recording": recording_step,
                "floor": floor_step}, device, 5 if quick else 8, inner=2)
    label = f"{kind} fp32 training step batch {batch} seq {seq}"
    DETAILS[label] = {"ms": {k: 1e3 * v for k, v in t.items()}, "first_call_s": first,
                      "table": str(new)}
    ROWS.append((f"{label}: lazy", f"{1e3 * t['eager']:.2f} ms", f"{1e3 * t['lazy']:.2f} ms", "-",
                 f"**{t['eager'] / t['lazy']:.2f}x eager**; {len(new)} flushes/compiled calls, "
                 f"{sum(f.ops for f in new)} recorded ops; first step {first[0]:.1f} s, second (compiles) "
                 f"{first[1]:.1f} s"))
    ROWS.append(("  same, lazy(capture_modules=False)", f"{1e3 * t['eager']:.2f} ms",
                 f"{1e3 * t['lazy_recording']:.2f} ms", "-", f"{t['eager'] / t['lazy_recording']:.2f}x eager"))
    ROWS.append(("  same, a dispatch mode that does nothing", f"{1e3 * t['eager']:.2f} ms",
                 f"{1e3 * t['floor']:.2f} ms", "-", f"{t['eager'] / t['floor']:.2f}x eager: the floor of interception"))


def new_sizes(device: str, quick: bool) -> None:
    """New batch sizes and sequence lengths: the size-free cache should compile nothing."""
    model, vocab = _model("gpt2", quick, device, torch.float32)
    model.eval()
    block = torchfuse.lazy()
    compiles = []
    for batch, seq in ([(2, 48), (2, 80), (3, 100), (5, 77), (2, 130)] if not quick else [(2, 40), (3, 50)]):
        ids = torch.randint(0, vocab, (batch, seq), device=device)
        before = counters["graphs_compiled"]
        with torch.no_grad(), block:
            out = model(ids, use_cache=False).logits
        with torch.no_grad():
            torch.testing.assert_close(out, model(ids, use_cache=False).logits, atol=2e-3, rtol=2e-3)
        compiles.append(counters["graphs_compiled"] - before)
    DETAILS["new_sizes_compiles"] = compiles
    ROWS.append(("GPT-2 lazy, new (batch, seq) 2x48, 2x80, 3x100, 5x77, 2x130", "-", "-", "-",
                 f"graphs compiled per new size: {compiles}"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--only", default="", help="comma-separated rows: per-op, per-flush, 6-op chain, "
                    "gpt2 bf16, llama bf16, gpt2 fp32, gpt2 training, llama training, new sizes")
    args = ap.parse_args()
    ONLY.update(x.strip() for x in args.only.split(",") if x.strip())
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
    big, small = ((2, 96), (1, 64)) if args.quick else ((8, 512), (1, 64))
    for kind in ("gpt2", "llama"):
        row(f"{kind} bf16", lambda: inference(kind, device, args.quick, torch.bfloat16, [big, small]))
    row("gpt2 fp32", lambda: inference("gpt2", device, args.quick, torch.float32, [small]))
    for kind in ("gpt2", "llama"):
        row(f"{kind} training", lambda: training(kind, device, args.quick, *((2, 64) if args.quick else (4, 256))))
    row("new sizes", lambda: new_sizes(device, args.quick))
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
