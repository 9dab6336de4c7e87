"""GPU benchmark blocks: hand-written attention, a transformer block, a GPT-2 training step.

    python benchmarks/gpu_bench.py --blocks --no-kernels      (rows join gpu_bench's table)
    python benchmarks/gpu_blocks.py                           (this file alone)

Each workload runs eager, Inductor and torchfuse side by side; compile time is the first call.
The blocks sit between the single kernels and the whole models: matmuls in cuBLAS with
softmax/norm/activation kernels between them, so they show what fusion around library calls
and the per-launch host cost are worth.
"""
from __future__ import annotations

import math
import os
from typing import Callable

os.environ.setdefault("TORCHFUSE_FIRST_CALLS", "wait")   # timings are of compiled graphs, not the ATen tier
import torch
import torch.nn.functional as F


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Causal attention written by hand: matmul, scale + mask + softmax (one fused kernel), matmul."""
    s = (q @ k.transpose(-1, -2)) * (1.0 / math.sqrt(q.shape[-1]))
    s = s.masked_fill(mask, float("-inf"))
    return torch.softmax(s.float(), dim=-1).to(q.dtype) @ v


class Block(torch.nn.Module):
    """A GPT-2 style pre-norm transformer block in plain PyTorch (SDPA for attention)."""

    def __init__(self, d: int = 768, heads: int = 12):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = torch.nn.LayerNorm(d), torch.nn.LayerNorm(d)
        self.qkv, self.proj = torch.nn.Linear(d, 3 * d), torch.nn.Linear(d, d)
        self.fc, self.out = torch.nn.Linear(d, 4 * d), torch.nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=-1)
        q, k, v = (t.view(b, s, self.heads, d // self.heads).transpose(1, 2) for t in (q, k, v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, d)
        x = x + self.proj(a)
        return x + self.out(F.gelu(self.fc(self.ln2(x)), approximate="tanh"))


def _train_step(model: torch.nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
    def step(ids: torch.Tensor) -> torch.Tensor:
        loss = model(ids, labels=ids).loss
        loss.backward()
        return loss
    return step


def cases() -> list[tuple[str, Callable[[], tuple[Callable, tuple]], bool]]:
    """(name, make() -> (fn, args), is_training)."""
    out: list[tuple[str, Callable[[], tuple[Callable, tuple]], bool]] = []
    for dtype in (torch.float32, torch.bfloat16):
        def make_attn(dtype: torch.dtype = dtype) -> tuple[Callable, tuple]:
            q, k, v = (torch.randn(8, 12, 512, 64, device="cuda", dtype=dtype) for _ in range(3))
            mask = torch.ones(512, 512, device="cuda", dtype=torch.bool).triu(1)
            return attention, (q, k, v, mask)
        out.append((f"attention by hand {str(dtype)[6:]} 8x12x512x64", make_attn, False))

        def make_block(dtype: torch.dtype = dtype) -> tuple[Callable, tuple]:
            m = Block().cuda().eval().to(dtype)
            return m, (torch.randn(8, 512, 768, device="cuda", dtype=dtype),)
        out.append((f"transformer block {str(dtype)[6:]} 8x512x768", make_block, False))
    try:
        import transformers

        def make_train() -> tuple[Callable, tuple]:
            cfg = transformers.GPT2Config(resid_pdrop=0, embd_pdrop=0, attn_pdrop=0)
            m = transformers.GPT2LMHeadModel(cfg).cuda().train()
            return _train_step(m), (torch.randint(0, 50257, (4, 512), device="cuda"),)
        out.append(("gpt2-small train step fp32 b4 s512", make_train, True))
    except ImportError:
        pass
    return out


def run_blocks(rows: list[list[str]], bench: Callable, first_call: Callable, log_error: Callable,
               tf_mode: str | None = None) -> None:
    """Append one row per workload: name, eager/inductor/torchfuse ms, ratio, compile seconds."""
    from gpu_bench import add_compare_row
    for name, make, training in cases():
        fn, args = make()
        results: dict[str, tuple[float, float]] = {}
        for label in ("eager", "inductor", "torchfuse"):
            torch._dynamo.reset()
            try:
                wrapped = fn if label == "eager" else torch.compile(fn) if label == "inductor" else \
                    torch.compile(fn, backend="torchfuse", mode=tf_mode)
                with torch.set_grad_enabled(training):
                    _, ctime = first_call(wrapped, *args)
                    results[label] = (bench(wrapped, *args, reps=10, inner=3), ctime)
            except Exception as e:  # one broken row must not lose the others
                results[label] = (float("nan"), float("nan"))
                log_error(f"{name} {label}", e)
        add_compare_row(rows, name, results)
        del fn, args
        torch.cuda.empty_cache()


if __name__ == "__main__":
    from gpu_bench import _log_error, bench, first_call    # (sets fresh cache dirs before compiling)

    run_blocks([], bench, first_call, _log_error)
