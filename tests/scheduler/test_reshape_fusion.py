"""Fusion across reshapes (src/torchfuse/scheduler/tiling.py): a buffer whose iteration space is a
contiguous reshape of a kernel's rows x reduced space joins the kernel, which loops over the
common refinement of both shapes.

The motivating case is attention written by hand: the bmm's [B*H, S, S] scores are viewed as
[B, H, S, S] for the softmax and back to [B*H, S, S] for the next bmm; the softmax must stay one
kernel.  Every case runs through the C++ backend and the Triton code generator under Triton's
interpreter and is compared with eager."""
from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

from torchfuse.ir.nodes import const
from torchfuse.scheduler.tiling import refine

os.environ.setdefault("TRITON_INTERPRET", "1")

BACKENDS = {"cpp": {}, "triton": {"cpu_backend": "triton"}}
BMM = {"aten.bmm.default"}
TOL = {torch.float32: 1e-4, torch.bfloat16: 2e-2}


def _check(tf, backend, fn, *args, dtype=torch.float32, **kw):
    if backend == "triton":
        pytest.importorskip("triton")
    e = tf.check(fn, *args, options=BACKENDS[backend], kernels=1, atol=TOL[dtype], rtol=TOL[dtype], **kw)
    assert not e.refused_fusions, str(e)
    return e


def attention(q, k, v, mask):
    s = (q @ k.transpose(-1, -2)) * 0.125
    s = s.masked_fill(mask, float("-inf"))
    return torch.softmax(s, dim=-1) @ v


@pytest.mark.parametrize("backend", sorted(BACKENDS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("seq", [33, 1, 17])
def test_causal_attention_softmax_is_one_kernel(tf, backend, dtype, seq):
    q, k, v = (tf.rand((2, 3, seq, 16), dtype) for _ in range(3))
    mask = torch.ones(seq, seq, dtype=torch.bool).triu(1)
    e = _check(tf, backend, attention, q, k, v, mask, dtype=dtype, allow_fallbacks=BMM)
    if seq > 1:
        assert e.kernels[0].kind == "reduction"


@pytest.mark.parametrize("backend", sorted(BACKENDS))
@pytest.mark.parametrize("seq", [33, 5])
def test_plain_reshape_around_softmax(tf, backend, seq):
    """[B*H, S, S] -> [B, H, S, S] -> softmax -> [B*H, S, S], without matmuls around it."""
    x = tf.rand((6, seq, seq))
    fn = lambda x: torch.softmax(x.reshape(2, 3, seq, seq) * 2, -1).reshape(6, seq, seq) + 1  # noqa: E731
    _check(tf, backend, fn, x)
    # the same through view and a row-merging reshape of the output
    fn2 = lambda x: torch.softmax(x.view(2, 3, seq, seq), -1).view(6 * seq, seq).exp()  # noqa: E731
    _check(tf, backend, fn2, x)


@pytest.mark.parametrize("backend", sorted(BACKENDS))
def test_log_softmax_across_reshape(tf, backend):
    x = tf.rand((6, 17, 17))
    _check(tf, backend, lambda x: torch.log_softmax(x.view(2, 3, 17, 17) - 1, -1).view(6, 17, 17) * 3, x)
    q, k, v = (tf.rand((2, 3, 17, 8)) for _ in range(3))
    _check(tf, backend, lambda q, k, v: torch.log_softmax(q @ k.transpose(-1, -2), -1) @ v, q, k, v,
           allow_fallbacks=BMM)


@pytest.mark.parametrize("backend", sorted(BACKENDS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_layer_norm_over_viewed_tensor(tf, backend, dtype):
    """A [B*S, D] activation (a linear's output) normalized as [B, S, D], and flattened back."""
    x, w, b = tf.rand((2 * 7, 24), dtype), tf.rand((24,), dtype), tf.rand((24,), dtype)
    fn = lambda x, w, b: F.layer_norm((x * 2).view(2, 7, 24), (24,), w, b).view(14, 24) + x  # noqa: E731
    _check(tf, backend, fn, x, w, b, dtype=dtype)


@pytest.mark.parametrize("backend", sorted(BACKENDS))
def test_rows_split_differently(tf, backend):
    """Rows regrouped ([6, 5] rows vs [2, 15] rows) and a per-row value read through the reshape."""
    x = tf.rand((30, 11))

    def fn(x):
        m = x.view(6, 5, 11).amax(-1, keepdim=True)
        return (x.view(2, 15, 11) - m.view(2, 15, 1)).exp(), m.view(2, 15) * 2
    _check(tf, backend, fn, x)


@pytest.mark.parametrize("backend", sorted(BACKENDS))
def test_independent_member_of_reshaped_space(tf, backend):
    """An unrelated elementwise op over [2, 12, 5] shares the loops of a softmax over [4, 6] x [5]
    (refined to [2, 2, 6] x [5])."""
    x, y = tf.rand((24, 5)), tf.rand((2, 12, 5))
    _check(tf, backend, lambda x, y: (torch.softmax(x.view(4, 6, 5), -1), y * 2), x, y)


def test_incompatible_reshape_is_refused_with_reason(tf):
    """[4, 6] rows vs [6, 4]: no refinement without div/mod, so two kernels and a reason."""
    x, y = tf.rand((24, 5)), tf.rand((6, 4, 5))
    e = tf.check(lambda x, y: (torch.softmax(x.view(4, 6, 5), -1), y * 2), x, y, kernels=2)
    assert any("matches neither rows [4, 6]" in r for r in e.refused_fusions), str(e)


def test_refine():
    c = lambda *s: tuple(const(v) for v in s)  # noqa: E731
    r = refine(c(6, 33, 33), c(2, 3, 33, 33))
    assert r is not None and r.sizes == c(2, 3, 33, 33)
    assert r.a == [[0, 1], [2], [3]] and r.b == [[0], [1], [2], [3]]
    r = refine(c(2, 12), c(12, 2))
    assert r is not None and r.sizes == c(2, 6, 2) and r.a == [[0], [1, 2]] and r.b == [[0, 1], [2]]
    r = refine(c(6, 1089), c(2, 3, 33, 33))
    assert r is not None and r.b == [[0], [1], [2], [3]] and r.a == [[0, 1], [2, 3]]
    assert refine(c(4, 6), c(6, 4)) is None
    assert refine(c(4, 6), c(25)) is None
    assert refine(c(0, 3), c(3, 0)) is None


@pytest.mark.parametrize("backend", sorted(BACKENDS))
def test_attention_softmax_one_kernel_with_dynamic_shapes(backend):
    """With symbolic sizes the reshaped index is a mixed-radix sum of symbolic sizes; its bound
    (nodes.upper_bound) proves the `//` and `%` of the view away, so the softmax stays one kernel
    and one graph serves every sequence length."""
    import torchfuse
    from torchfuse import counters
    if backend == "triton":
        pytest.importorskip("triton")
    before = counters["graphs_compiled"], counters["kernels_generated"]
    cf = torchfuse.compile(attention, dynamic=True, options={"strict": True, **BACKENDS[backend]})
    for seq in (33, 17, 40):
        q, k, v = (torch.randn(2, 3, seq, 16) for _ in range(3))
        mask = torch.ones(seq, seq, dtype=torch.bool).triu(1)
        torch.testing.assert_close(cf(q, k, v, mask), attention(q, k, v, mask), atol=1e-4, rtol=1e-4)
    assert (counters["graphs_compiled"] - before[0], counters["kernels_generated"] - before[1]) == (1, 1)
