"""transformers' `generate` with a static KV cache: eager, Inductor and torchfuse side by side.

    python benchmarks/generate_bench.py [--models llama,qwen2] [--modes default,reduce-overhead]
                                        [--batch 4] [--prompt 128] [--new 64] [--rounds 5]

What a user of transformers writes to decode fast: the model's `forward` compiled, a static cache
(the keys and values live in preallocated tensors written in place at `cache_position`, so every
decode step has the same shapes), greedy decoding.  Per model, backend and mode (`default`,
`reduce-overhead` = CUDA graphs; the latter only on CUDA):

  * prefill ms  -- the prompt's forward into an emptied `StaticCache`;
  * decode ms   -- one token a sequence: N one-token forwards back to back, as a serving loop
                   calls the model (the median of `--rounds` loops);
  * gen tok/s   -- `generate(..., cache_implementation="static")` of N tokens, batch x N over its
                   wall time: what a user of `generate` gets, its own per-token host work included
                   (the same for every backend);
  * kernels     -- GPU kernels (and memcpys/memsets) of one decode forward, from torch.profiler;
                   `copies` counts its `aten::copy_` / `index_put_` / `index_copy_` host calls
                   (a cache written by a copy-back or through ATen shows here);
  * tokens      -- whether the generated tokens equal eager's (greedy decoding: a compiled model
                   may legitimately pick another token where two logits tie within rounding, so
                   the first differing step is printed, not asserted);
  * first s     -- the first generate's wall time, compiles included.

torchfuse compiles with `strict=True`: a graph that would run eagerly fails the row.  Each row runs
in a process of its own (a compiler that crashes the process fails its row only).
Sizes: `--size gpu` (default on CUDA) is a 12-layer, 1024-wide decoder (GQA 16/4 heads, SwiGLU
2816, vocab 32000, bf16); `--size cpu` a 2-layer, 128-wide one in fp32.  The table is printed last.
"""
from __future__ import annotations

import argparse
import faulthandler
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Callable

os.environ.setdefault("TORCHFUSE_FIRST_CALLS", "wait")   # timings are of compiled graphs, not the ATen tier
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torchfuse  # noqa: E402

SIZES = {
    "gpu": dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=12, num_attention_heads=16,
                num_key_value_heads=4, vocab_size=32000),
    "cpu": dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, vocab_size=1000),
}


def build(name: str, size: str, dtype: torch.dtype, device: str, max_len: int) -> torch.nn.Module:
    """A transformers causal LM with random weights (no download)."""
    import transformers
    cfg_cls, model_cls = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
    }[name]
    cfg = cfg_cls(max_position_embeddings=max_len, **SIZES[size])
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = model_cls(cfg).to(device=device, dtype=dtype).eval()
    model.generation_config.eos_token_id = None          # decode exactly the tokens asked for
    model.generation_config.pad_token_id = 0
    return model


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _generate(model: torch.nn.Module, ids: torch.Tensor, n: int, extra: dict) -> torch.Tensor:
    return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                          do_sample=False, cache_implementation="static", **extra)


def _reference(model: torch.nn.Module, ids: torch.Tensor, n: int) -> tuple[torch.Tensor, dict]:
    """Eager's `n` tokens, and the generate arguments every row passes: transformers >= 4.49
    compiles a static-cache forward with Inductor by itself on CUDA; `disable_compile` keeps each
    row's own compiler (older versions neither do it nor know it)."""
    with torch.no_grad():
        try:
            return _generate(model, ids, n, {"disable_compile": True}), {"disable_compile": True}
        except (TypeError, ValueError):
            return _generate(model, ids, n, {}), {}


def _timed(call: Callable[[], object], device: str, rounds: int) -> float:
    times = []
    for _ in range(rounds):
        _sync(device)
        t0 = time.perf_counter()
        call()
        _sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def _profile_counts(call: Callable[[], object], device: str) -> tuple[int, int]:
    """(device kernels, cache-copy host ops) in one call."""
    from torch.profiler import ProfilerActivity, profile
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    with profile(activities=acts) as prof:
        call()
        _sync(device)
    events = prof.events()
    kernels = sum(1 for e in events if e.device_type == torch.autograd.DeviceType.CUDA)
    copies = sum(1 for e in events if e.name in ("aten::copy_", "aten::index_put_", "aten::_index_put_impl_",
                                                 "aten::index_copy_", "aten::index_copy"))
    return kernels, copies


def compiled_forward(forward: Callable, backend: str, mode: str) -> Callable:
    mode_arg = None if mode == "default" else mode
    if backend == "torchfuse":       # torch.compile takes mode= or options=, not both; torchfuse.compile both
        # strict: a graph that cannot compile fails the row; without strict's read of the index
        # checks after every call (a device-to-host copy that makes the host wait for each
        # decode step), as the zoo runs (a bad index still raises, at the next call)
        return torchfuse.compile(forward, mode=mode_arg, options={"strict": True, "sync_checks": False})
    return torch.compile(forward, backend=backend, mode=mode_arg)


def _static_cache(model: torch.nn.Module, batch: int, max_len: int) -> object:
    from transformers import StaticCache
    try:                                        # transformers 5: shapes and device from the first update
        return StaticCache(config=model.config, max_cache_len=max_len)
    except TypeError:                           # transformers 4
        return StaticCache(config=model.config, max_batch_size=batch, max_cache_len=max_len,
                           device=model.device, dtype=model.dtype)


def _decode_loop(model: torch.nn.Module, ids: torch.Tensor, cache: object, steps: int,
                 device: str) -> tuple[float, float]:
    """(prefill ms, ms a decode step): the prompt's forward into an emptied static cache, then
    `steps` one-token forwards back to back (one synchronize after them), as a serving loop
    calls the model without generate's own per-token host work."""
    cache.reset()
    p = ids.shape[1]
    tokens = ids[:, -1:].clone()
    _sync(device)
    t0 = time.perf_counter()
    model(input_ids=ids, past_key_values=cache, cache_position=torch.arange(p, device=device), use_cache=True)
    _sync(device)
    t1 = time.perf_counter()
    for i in range(steps):
        model(input_ids=tokens, past_key_values=cache, cache_position=torch.tensor([p + i], device=device),
              use_cache=True)
    _sync(device)
    t2 = time.perf_counter()
    return (t1 - t0) * 1e3, (t2 - t1) * 1e3 / steps


def run_one(name: str, backend: str, mode: str, a: argparse.Namespace) -> dict:
    """One row, in this process."""
    device, dtype = a.device, {"bf16": torch.bfloat16, "fp32": torch.float32}[a.dtype]
    max_len = a.prompt + a.new + 16
    model = build(name, a.size, dtype, device, max_len)
    torch.manual_seed(1)
    ids = torch.randint(1, model.config.vocab_size, (a.batch, a.prompt), device=device)
    ref, extra = _reference(model, ids, a.new)
    torch._dynamo.reset()
    before = dict(torchfuse.counters)
    if backend != "eager":
        model.forward = compiled_forward(model.forward, backend, mode)
    row = dict(model=name, backend=backend, mode=mode)
    cache = _static_cache(model, a.batch, max_len)
    with torch.no_grad():
        t0 = time.perf_counter()
        out = _generate(model, ids, a.new, extra)
        _sync(device)
        row["first_s"] = time.perf_counter() - t0
        for _ in range(2):                              # warm: CUDA graphs recorded, both call forms
            _generate(model, ids, a.new, extra)
            _decode_loop(model, ids, cache, a.new, device)
        loops = [_decode_loop(model, ids, cache, a.new, device) for _ in range(a.rounds)]
        row["prefill_ms"] = statistics.median(p for p, _ in loops)
        row["decode_ms"] = statistics.median(d for _, d in loops)
        row["gen_tok_s"] = a.batch * a.new / _timed(lambda: _generate(model, ids, a.new, extra), device,
                                                    a.rounds) * 1e3
        cache.reset()
        model(input_ids=ids, past_key_values=cache, cache_position=torch.arange(a.prompt, device=device),
              use_cache=True)
        row["kernels"], row["copies"] = _profile_counts(
            lambda: model(input_ids=ids[:, -1:].clone(), past_key_values=cache,
                          cache_position=torch.tensor([a.prompt], device=device), use_cache=True), device)
    diff = (out != ref).any(0).nonzero()
    row["tokens"] = "same" if diff.numel() == 0 else f"differ from {int(diff[0]) - a.prompt}"
    if backend == "torchfuse":
        row["tf"] = {k: torchfuse.counters[k] - before.get(k, 0)
                     for k in ("graphs_compiled", "graph_cache_hits", "kernels_generated", "fallback_ops",
                               "eager_fallbacks")}
    return row


def run_isolated(name: str, backend: str, mode: str) -> dict:
    """One row in a child process: a compiler that crashes the process (a segfault in a launcher,
    say) fails its row, not the table."""
    argv = [a for a in sys.argv[1:] if not a.startswith("--one")]
    proc = subprocess.run([sys.executable, os.path.abspath(__file__), *argv, f"--one={name}:{backend}:{mode}"],
                          capture_output=True, text=True)
    for line in proc.stdout.splitlines():
        if line.startswith("ROW "):
            return json.loads(line[4:])
    why = f"exit {proc.returncode}" + (f" (signal {-proc.returncode})" if proc.returncode < 0 else "")
    tail = [ln for ln in proc.stderr.splitlines() if ln.strip()][-1:] or [""]
    return dict(model=name, backend=backend, mode=mode, error=f"{why}: {tail[0][:160]}")


def table(rows: list[dict]) -> str:
    head = (f"{'model':8} {'backend':10} {'mode':16} {'prefill ms':>10} {'vs Ind':>6} {'decode ms':>9} {'vs Ind':>6} "
            f"{'gen tok/s':>9} {'vs Ind':>6} {'kernels':>7} {'copies':>6} {'first s':>7}  tokens / torchfuse counters")
    out = [head, "-" * len(head)]
    ind = {(r["model"], r["mode"]): r for r in rows if r["backend"] == "inductor" and "decode_ms" in r}
    for r in rows:
        if "error" in r:
            out.append(f"{r['model']:8} {r['backend']:10} {r['mode']:16} FAILED {r['error']}")
            continue
        base = ind.get((r["model"], r["mode"])) or ind.get((r["model"], "default"))

        def vs(key: str, higher_better: bool = False) -> str:
            if not base:
                return "     -"
            v = r[key] / base[key] if higher_better else base[key] / r[key]
            return f"{v:5.2f}x"
        out.append(f"{r['model']:8} {r['backend']:10} {r['mode']:16} {r['prefill_ms']:10.2f} {vs('prefill_ms')} "
                   f"{r['decode_ms']:9.3f} {vs('decode_ms')} {r['gen_tok_s']:9.0f} {vs('gen_tok_s', True)} "
                   f"{r['kernels']:7.0f} {r['copies']:6.0f} {r['first_s']:7.1f}  {r['tokens']} {r.get('tf', '')}")
    return "\n".join(out)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="llama,qwen2")
    p.add_argument("--modes", default="default,reduce-overhead")
    p.add_argument("--backends", default="eager,inductor,torchfuse")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--size", default=None, help="gpu | cpu (default: the device's)")
    p.add_argument("--dtype", default=None, help="bf16 | fp32 (default: bf16 on CUDA, fp32 on the CPU)")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--prompt", type=int, default=128)
    p.add_argument("--new", type=int, default=64)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--one", default=None, help=argparse.SUPPRESS)    # MODEL:BACKEND:MODE, in a child
    a = p.parse_args()
    faulthandler.enable()
    a.size = a.size or ("gpu" if a.device == "cuda" else "cpu")
    a.dtype = a.dtype or ("bf16" if a.device == "cuda" else "fp32")
    a.modes, a.backends = a.modes.split(","), a.backends.split(",")
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    torch._dynamo.config.cache_size_limit = 64
    if a.one:
        name, backend, mode = a.one.split(":")
        try:
            row = run_one(name, backend, mode, a)
        except Exception as e:          # reported as the row's failure by the parent
            row = dict(model=name, backend=backend, mode=mode,
                       error=f"{type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}")
        print("ROW " + json.dumps(row), flush=True)
        return
    rows = []
    for name in a.models.split(","):
        for backend in a.backends:
            for mode in (("default",) if backend == "eager" else a.modes):
                if mode == "reduce-overhead" and a.device != "cuda":
                    continue
                rows.append(run_isolated(name, backend, mode))
                print(table(rows), flush=True)
    import transformers
    where = torch.cuda.get_device_name() if a.device == "cuda" else "CPU"
    print(f"\n{where}, torch {torch.__version__}, transformers {transformers.__version__}, "
          f"batch {a.batch}, prompt {a.prompt}, {a.new} new tokens, {a.size} size, {a.dtype}\n" + table(rows))


if __name__ == "__main__":
    main()
