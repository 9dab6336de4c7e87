"""Concatenations written in place (lowering/cat_slots.py): a part that is stored anyway (read by a
matmul) is written straight into its slice of the concatenation, the other parts are computed or
copied into theirs, and no ATen cat or copy kernel runs.  Every case compares with eager."""
from __future__ import annotations

import os
import re

import pytest
import torch

import torchfuse

os.environ.setdefault("TRITON_INTERPRET", "1")
BACKENDS = {"cpp": {}, "triton": {"cpu_backend": "triton"}}


def _backend(name: str) -> dict:
    if name == "triton":
        pytest.importorskip("triton")
    return BACKENDS[name]


def _wrappers(tmp_path) -> str:
    return "\n".join(p.read_text().split("\ndef call_profiled")[0] for p in sorted(tmp_path.rglob("*wrapper.py")))


def _recurrence(x: torch.Tensor, w: torch.Tensor, steps: int, dim: int) -> torch.Tensor:
    """A GRU-like loop: each hidden state is read by the next step's matmul and stacked."""
    h = torch.tanh(x[:, 0])
    outs = [h]
    for t in range(1, steps):
        h = torch.tanh(x[:, t] + h @ w) * 0.5 + h * 0.5
        outs.append(h)
    return torch.stack(outs, dim).reshape(-1, w.shape[0]) @ w[:, :3]


@pytest.mark.parametrize("backend", sorted(BACKENDS))
@pytest.mark.parametrize("dim", [0, 1, -1])
def test_stacked_hidden_states_are_written_into_their_slices(tf, tmp_path, backend, dim):
    x, w = tf.rand((5, 7, 12)), tf.rand((12, 12)) / 4
    e = tf.check(lambda a, b: _recurrence(a, b, 7, dim), x, w,
                 options={**_backend(backend), "debug": True, "debug_dir": tmp_path},
                 allow_fallbacks={"aten.mm.default"}, atol=1e-5, rtol=1e-5)
    assert not any("cat" in f.op for f in e.fallbacks), e
    # one kernel per step, no kernel that copies the parts into the concatenation
    assert len(e.kernels) == 7, e
    src = _wrappers(tmp_path)
    assert src.count("_reinterpret(buf") >= 7 and "cat" in src, src


def test_parts_not_stored_are_computed_or_copied_into_their_slices(tf, tmp_path):
    """A part the matmul stored (tanh), a graph input, an ATen result, an int part the
    concatenation promotes, a broadcast (expanded) part and one that is empty."""
    a, b, w = tf.rand((6, 8)), tf.rand((6, 3)), tf.rand((8, 8))
    ints = torch.randint(-5, 5, (6, 2), dtype=torch.int32)

    def fn(a, b, w, ints):
        h = torch.tanh(a)
        mm = h @ w
        row = torch.sin(a[:1, :4]).expand(6, 4)
        empty = a[:, :0]
        cat = torch.cat([h, b, mm, ints, row, empty, h * 2], 1)
        return cat @ torch.ones(cat.shape[1], 2)

    e = tf.check(fn, a, b, w, ints, options={"debug": True, "debug_dir": tmp_path},
                 allow_fallbacks={"aten.mm.default"}, atol=1e-5, rtol=1e-5)
    assert not any("cat" in f.op for f in e.fallbacks), e
    assert "cat" in _wrappers(tmp_path)


def test_part_returned_by_the_graph_keeps_its_own_buffer(tf):
    """The caller gets h itself: it must not share storage with the concatenation."""
    a, w = tf.rand((4, 8)), tf.rand((8, 8))

    def fn(a, w):
        h = torch.tanh(a)
        g = torch.sigmoid(h @ w)
        return h, torch.cat([h, g], 1) @ torch.ones(16, 2)

    e = tf.check(fn, a, w, allow_fallbacks={"aten.mm.default"}, atol=1e-5, rtol=1e-5)
    h, _ = e.output
    h.add_(1)      # a caller's in-place update touches nothing torchfuse still holds
    torch.testing.assert_close(h, torch.tanh(a) + 1)


def test_concatenation_a_kernel_reads_stays_fused(tf, tmp_path):
    """A cat only lowered ops read (a clone, a sum) is never written anywhere: its loads fuse."""
    a, b, w = tf.rand((5, 6)), tf.rand((5, 6)), tf.rand((6, 6))

    def fn(a, b, w):
        h = torch.tanh(a) @ w
        return (torch.cat([h, b], 1) * 2).sum(1)

    e = tf.check(fn, a, b, w, options={"debug": True, "debug_dir": tmp_path},
                 allow_fallbacks={"aten.mm.default"}, atol=1e-5, rtol=1e-5)
    assert "cat" not in _wrappers(tmp_path).replace("concat", "")
    assert len(e.kernels) == 2, e


def test_recurrence_gradients_match_eager(tf):
    """Training: the backward's concatenation of gate gradients (read by the weight's matmul)."""
    x = tf.rand((3, 5, 8)).requires_grad_()
    w = (tf.rand((8, 24)) / 4).requires_grad_()

    def fn(x, w):
        h = x.new_zeros(3, 8)
        outs = []
        for t in range(5):
            r, z, n = (x[:, t].repeat(1, 3) + h @ w).chunk(3, 1)
            h = torch.sigmoid(z) * h + (1 - torch.sigmoid(z)) * torch.tanh(n * torch.sigmoid(r))
            outs.append(h)
        return torch.stack(outs, 1).sum(1)

    # (the forward's stack of saved hidden states stays an ATen cat: returned parts keep their buffers)
    tf.check_grad(fn, x, w, allow_fallbacks={"aten.mm.default", "aten.cat.default", "aten.stack.default"},
                  atol=1e-5, rtol=1e-4)


def test_dynamic_batch_size_writes_the_right_slices(tf):
    w = tf.rand((10, 10)) / 4
    args = [(tf.rand((n, 4, 10)), w) for n in (3, 5, 8)]
    tf.check_dynamic(lambda x, w: _recurrence(x, w, 4, 1), args, fallbacks=4, atol=1e-5, rtol=1e-5)


def _rotate_half(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2:]
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


def _partial_rotary_attention(x: torch.Tensor, pos: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """GPT-NeoX's attention with rotary over a quarter of each head: q and k are concatenations
    of a rotated part (cos and sin computed in the kernel, too costly to inline into the
    concatenation, so stored, into its slice) and the pass-through rest; SDPA reads both."""
    r = x.shape[-1] // 4
    freqs = (inv_freq[None, :, None] @ pos[None, None, :].float()).transpose(1, 2)
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos().to(x.dtype)[:, None], emb.sin().to(x.dtype)[:, None]
    q = torch.cat([_rotate_half(x[..., :r], cos, sin), x[..., r:]], dim=-1)
    k = torch.cat([_rotate_half(x[..., r:2 * r], cos, sin), x[..., r:] * 0.5], dim=-1)
    return torch.nn.functional.scaled_dot_product_attention(q, k, x, is_causal=True)


@pytest.mark.parametrize("backend", sorted(BACKENDS))
def test_part_stored_while_its_concatenation_is_lowered_makes_it_a_view(tf, tmp_path, backend):
    """The rotated part is stored when its concatenation is lowered (too costly to inline): it goes
    into its slice, and the concatenation must then be that buffer.  It was lowered as a fused copy
    instead, reading the slice, and the concatenation's buffer (allocated whole, written only in
    the slice) stayed alive to the end of the graph: q and k of every layer of a GPT-NeoX, 16 MiB
    per layer at batch 4 x 1024 tokens, beside the logits."""
    x = tf.rand((3, 4, 37, 64), torch.bfloat16)
    pos, inv_freq = torch.arange(37), torch.rand(8) + 0.1
    e = tf.check(_partial_rotary_attention, x, pos, inv_freq,
                 options={**_backend(backend), "debug": True, "debug_dir": tmp_path},
                 allow_fallbacks={"aten.bmm.default", "aten.mm.default", "aten._scaled_dot_product_flash_attention_for_cpu.default",
                                  "aten._scaled_dot_product_attention_math.default"}, atol=2e-2, rtol=2e-2)
    src = _wrappers(tmp_path)
    whole = "(3, 4, 37, 64, ), (9472, 2368, 64, 1, ), _c"       # an allocation of q's or k's shape
    assert src.count(whole) == 2, src                          # q and k, each one buffer
    # every buffer the wrapper allocates is freed before it returns
    allocated = set(re.findall(r"^    (buf\d+) = _c\d+\(\(", src, re.M))
    freed = {b for line in re.findall(r"^    del (.*)$", src, re.M) for b in line.split(", ")}
    returned = set(re.findall(r"return \((.*)\)", src)[0].replace(" ", "").split(",")) if "return (" in src else set()
    assert allocated <= freed | returned, (allocated - freed - returned, src)
    cat_bytes = 3 * 4 * 37 * 64 * 2
    peak = float(re.search(r"planned peak ([0-9.]+) KiB", e.memory[0]).group(1)) * 1024
    assert peak < 3.5 * cat_bytes, e.memory      # q, k and the attention's output (was 5 of them)
