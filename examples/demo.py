"""torchfuse demo: compile a small GPT-2 with torchfuse and look at the generated kernels.

    python examples/demo.py

Builds a 2-layer GPT-2 (random weights) from `transformers` -- or a hand-written
MLP + LayerNorm + softmax model if `transformers` is not installed -- runs it eagerly and
through `torch.compile(model, backend="torchfuse")`, checks the outputs agree, times both,
and then prints `torchfuse.explain(...)` plus the C++ source of the kernels torchfuse
generated for one transformer MLP block (LayerNorm -> Linear -> GELU -> Linear).
Runs in well under two minutes on a 2-core CPU.
"""
from __future__ import annotations

import statistics
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

import torchfuse

torch.manual_seed(0)


# --------------------------------------------------------------------------------------------
# The model
# --------------------------------------------------------------------------------------------
class TinyModel(nn.Module):
    """Fallback when transformers is missing: embedding, a pre-LN GELU MLP block, softmax."""

    def __init__(self, vocab: int = 1000, dim: int = 128):
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.ln = nn.LayerNorm(dim)
        self.fc = nn.Linear(dim, 4 * dim)
        self.proj = nn.Linear(4 * dim, dim)
        self.ln_f = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.emb(ids)
        h = h + self.proj(F.gelu(self.fc(self.ln(h)), approximate="tanh"))
        return torch.softmax(self.head(self.ln_f(h)), dim=-1)


def build_model() -> tuple[nn.Module, str]:
    try:
        from transformers import GPT2Config, GPT2LMHeadModel
    except Exception as e:  # pragma: no cover - depends on the environment
        print(f"(transformers unavailable: {e!r}; using a hand-written model instead)")
        return TinyModel().eval(), "hand-written MLP + LayerNorm + softmax model"
    cfg = GPT2Config(n_layer=2, n_embd=128, n_head=4, vocab_size=1000, n_positions=128,
                     use_cache=False, bos_token_id=0, eos_token_id=0)
    model = GPT2LMHeadModel(cfg).eval()
    return model, "GPT-2 (transformers), n_layer=2, n_embd=128, n_head=4, vocab=1000, random weights"


def logits_of(out) -> torch.Tensor:
    if isinstance(out, torch.Tensor):
        return out
    if hasattr(out, "logits"):
        return out.logits
    return out[0]


def median_ms(fns, *args, warmup: int = 3, reps: int = 30) -> list[float]:
    """Median latency in ms of each fn; the fns take turns so background load hits them alike."""
    for fn in fns:
        for _ in range(warmup):
            fn(*args)
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(reps):
        for fn, ts in zip(fns, times):
            t0 = time.perf_counter()
            fn(*args)
            ts.append(time.perf_counter() - t0)
    return [statistics.median(ts) * 1e3 for ts in times]


def main() -> None:
    model, description = build_model()
    print(f"model: {description}")
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads\n")

    ids = torch.randint(0, 1000, (1, 64))
    if isinstance(model, TinyModel):
        run_eager = lambda x: model(x)
    else:
        run_eager = lambda x: model(input_ids=x, use_cache=False, return_dict=True).logits

    compiled = torch.compile(model, backend="torchfuse")
    if isinstance(model, TinyModel):
        run_compiled = lambda x: compiled(x)
    else:
        run_compiled = lambda x: compiled(input_ids=x, use_cache=False, return_dict=True).logits

    with torch.no_grad():
        expected = run_eager(ids)
        t0 = time.perf_counter()
        got = run_compiled(ids)
        compile_s = time.perf_counter() - t0
        # the first call ran through ATen if g++ was still building the kernels (first_calls="eager"):
        # wait for the build, and compare the compiled graph's own output
        until_s = max(torchfuse.wait_compiled(), t0 + compile_s) - t0
        got = run_compiled(ids)
        max_diff = (logits_of(got) - logits_of(expected)).abs().max().item()

        eager_ms, fused_ms = median_ms([run_eager, run_compiled], ids)

    print("== eager vs torch.compile(model, backend='torchfuse') ==")
    print(f"input: batch 1, seq {ids.shape[1]};  output {tuple(expected.shape)}")
    print(f"max |eager - torchfuse|      : {max_diff:.3e}")
    print(f"first call (compile + run)   : {compile_s:8.2f} s   "
          f"({torchfuse.counters['calls_tiered']} call(s) ran through ATen while kernels built)")
    print(f"until the kernels were built : {until_s:8.2f} s")
    print(f"eager median latency         : {eager_ms:8.3f} ms")
    print(f"torchfuse median latency     : {fused_ms:8.3f} ms   (eager/torchfuse = {eager_ms / fused_ms:.2f}x)")
    print(f"counters: {dict(torchfuse.counters)}")
    print("(latencies on a small shared machine are noisy; benchmarks/cpu_bench.py measures carefully)\n")

    # ----------------------------------------------------------------------------------------
    # What got fused: explain one transformer MLP block (ln_2 -> c_fc -> GELU -> c_proj) and
    # a softmax.  `explain` resets Dynamo, compiles afresh and reports kernels and fallbacks.
    # ----------------------------------------------------------------------------------------
    if isinstance(model, TinyModel):
        ln, fc, proj = model.ln, model.fc, model.proj
        act = lambda t: F.gelu(t, approximate="tanh")
    else:
        block = model.transformer.h[0]
        ln, fc, proj, act = block.ln_2, block.mlp.c_fc, block.mlp.c_proj, block.mlp.act

    def mlp_block(x: torch.Tensor) -> torch.Tensor:
        return x + proj(act(fc(ln(x))))

    x = torch.randn(1, 64, 128)
    with torch.no_grad():
        report = torchfuse.explain(mlp_block, x)
        err = (report.output - mlp_block(x)).abs().max().item()
    print("== torchfuse.explain(mlp_block, x)   [LayerNorm -> Linear -> GELU -> Linear + residual] ==")
    print(report)
    print(f"\nmax |eager - torchfuse| for the block: {err:.3e}")
    for k in report.kernels[:2]:
        print(f"\n---- {k.name} ({k.kind}; fuses {', '.join(k.nodes)}) ----")
        print(k.source)

    def softmax(x: torch.Tensor) -> torch.Tensor:
        return torch.softmax(x * 0.125, dim=-1)

    s = torch.randn(4, 64, 64)
    report = torchfuse.explain(softmax, s)
    print("\n== torchfuse.explain(softmax, x)   [torch.softmax(x * 0.125, -1)] ==")
    print(report)
    for k in report.kernels[:1]:
        print(f"\n---- {k.name} ({k.kind}; fuses {', '.join(k.nodes)}) ----")
        print(k.source)


if __name__ == "__main__":
    main()
