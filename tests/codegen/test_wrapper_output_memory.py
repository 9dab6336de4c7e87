"""A decoder's logits ([batch, seq, vocab], by far the largest value of an inference call) are
held once: the graph's last matmul writes them and the graph returns that buffer (as a view), with
no second logits-sized buffer alive beside it (an output re-strided, cast or copied, a view that
became a copy, or a buffer planned before its predecessor died).

The model is transformers' GPT-NeoX (an untied, bias-free `embed_out` projection after the final
layer norm; parallel attention/MLP residual; biased linears; rotary over a quarter of each head),
small, with a vocabulary 40x the hidden size so that the logits dwarf every other buffer.  Checked
on both backends: the wrapper's planned peak (explain()'s memory line) and, at run time, the bytes
the CPU allocator hands out during one call (torch.profiler's allocation events)."""
from __future__ import annotations

import os
import re

import pytest
import torch

import torchfuse

os.environ.setdefault("TRITON_INTERPRET", "1")
BACKENDS = {"cpp": {}, "triton": {"cpu_backend": "triton"}}
BATCH, SEQ, HIDDEN, VOCAB = 2, 23, 32, 1277          # odd sizes: no dim is a multiple of a block


def _gpt_neox(dtype: torch.dtype) -> torch.nn.Module:
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    cfg = transformers.GPTNeoXConfig(hidden_size=HIDDEN, num_hidden_layers=2, num_attention_heads=4,
                                     intermediate_size=4 * HIDDEN, vocab_size=VOCAB, rotary_pct=0.25,
                                     max_position_embeddings=64, attention_dropout=0.0, hidden_dropout=0.0,
                                     use_parallel_residual=True, tie_word_embeddings=False, use_cache=False,
                                     bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    model = transformers.GPTNeoXForCausalLM._from_config(cfg, attn_implementation="sdpa")
    return model.to(dtype).eval()


class _Logits(torch.nn.Module):
    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model = model

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=ids, use_cache=False).logits


def _bytes(text: str) -> float:
    value, unit = re.match(r"([0-9.]+) (B|KiB|MiB|GiB)", text).groups()
    return float(value) * {"B": 1, "KiB": 2 ** 10, "MiB": 2 ** 20, "GiB": 2 ** 30}[unit]


def _allocations(fn) -> tuple[object, list[int], int]:
    """fn()'s result, the sizes of the CPU allocations made while it ran, and the peak of the bytes
    allocated above what was allocated when it started."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        out = fn()
    events = []

    def walk(node) -> None:
        if type(node.extra_fields).__name__ == "_ExtraFields_Allocation":
            events.append((node.start_time_ns, node.extra_fields.alloc_size))
        for child in node.children:
            walk(child)

    for root in prof.profiler.kineto_results.experimental_event_tree():
        walk(root)
    live = peak = 0
    for _, size in sorted(events):
        live += size
        peak = max(peak, live)
    return out, [size for _, size in events if size > 0], peak


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("backend", sorted(BACKENDS))
def test_logits_are_held_once(backend, dtype):
    if backend == "triton":
        pytest.importorskip("triton")
    model = _Logits(_gpt_neox(dtype))
    ids = torch.randint(1, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    logits_bytes = BATCH * SEQ * VOCAB * dtype.itemsize
    hidden_bytes = BATCH * SEQ * 4 * HIDDEN * 4          # the widest activation (the MLP's), in fp32
    torch._dynamo.reset()
    with torch.no_grad():
        expected = model(ids)
        e = torchfuse.explain(model, ids, options=BACKENDS[backend])
        tol = {"rtol": 2e-2, "atol": 2e-2} if dtype == torch.bfloat16 else {"rtol": 1e-4, "atol": 1e-4}
        torch.testing.assert_close(e.output, expected, **tol)
        assert e.output.shape == (BATCH, SEQ, VOCAB) and e.output.dtype == dtype
        # the plan: one logits buffer at the peak, next to nothing larger than an activation
        assert len(e.memory) == 1, e.memory
        peak = _bytes(e.memory[0].split("planned peak ", 1)[1])
        assert logits_bytes <= peak < logits_bytes + hidden_bytes, e.memory[0]

        compiled = torch.compile(model, backend="torchfuse", options=BACKENDS[backend])
        compiled(ids)                                     # compile outside the measured call
        peaks, large = {}, {}
        for name, fn in (("eager", lambda: model(ids)), ("torchfuse", lambda: compiled(ids))):
            out, sizes, peaks[name] = _allocations(fn)
            torch.testing.assert_close(out, expected, **tol)
            large[name] = sorted(s for s in sizes if s >= logits_bytes)
        # no more allocations of the logits' size than eager's: no copy of the logits.  Eager
        # makes one (the output), or two where oneDNN has no bf16 matmul on the CPU (AVX-512
        # without BF16: an fp32 result, then converted); the lm head's ATen call is the same in
        # both, so a copy of torchfuse's own would be one more
        assert 1 <= len(large["torchfuse"]) <= len(large["eager"]), large
        # and nothing large beside them (eager's peak includes ATen's own matmul workspaces)
        assert peaks["torchfuse"] <= peaks["eager"] + hidden_bytes, peaks
