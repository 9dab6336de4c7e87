"""merge_mm_sum: a sum of matrix products with small inner sizes becomes one product over the
concatenated inner dim (an unrolled RNN's per-step weight gradients)."""
from __future__ import annotations

import torch

import torchfuse
from _passes_helpers import assert_same, count, run, trace

aten = torch.ops.aten


def _per_step_grads(xs, gs, c):
    total = c
    for x, g in zip(xs, gs):
        total = total + g.t() @ x          # [32, 4] @ [4, 16] per step
    return total


def test_small_inner_products_become_one():
    xs = [torch.randn(4, 16) for _ in range(6)]
    gs = [torch.randn(4, 32) for _ in range(6)]
    c = torch.randn(32, 16)
    gm = trace(_per_step_grads, xs, gs, c)
    assert count(gm, aten.mm.default) == 6
    assert run(gm, "merge_mm_sum", "dce") == 1
    assert count(gm, aten.mm.default) == 1 and count(gm, aten.cat.default) == 2
    # one addend that is not a product stays
    assert count(gm, aten.add.Tensor) == 1
    assert_same(gm(xs, gs, c), _per_step_grads(xs, gs, c), exact=False, rtol=1e-5, atol=1e-5)


def test_large_inner_products_are_left_alone():
    """[32, 256] @ [256, 16]: copying the operands would cost more than the add it saves."""
    xs = [torch.randn(256, 16) for _ in range(3)]
    gs = [torch.randn(256, 32) for _ in range(3)]
    c = torch.randn(32, 16)
    gm = trace(_per_step_grads, xs, gs, c)
    assert run(gm, "merge_mm_sum") == 0
    assert count(gm, aten.mm.default) == 3


def test_product_read_elsewhere_is_left_alone():
    a, b = torch.randn(8, 2), torch.randn(2, 8)
    c, d = torch.randn(8, 2), torch.randn(2, 8)

    def fn(a, b, c, d):
        p = a @ b
        return p + c @ d, p * 2          # p has a second reader

    gm = trace(fn, a, b, c, d)
    assert run(gm, "merge_mm_sum") == 0
    assert_same(gm(a, b, c, d), fn(a, b, c, d))


def test_rnn_training_step_matches_eager():
    """A hand-written LSTM over 12 steps, trained through torchfuse: gradients equal eager's."""
    torch.manual_seed(0)
    w_hh = torch.nn.Linear(16, 64)

    def step(xs):
        h = c = xs.new_zeros(xs.shape[0], 16)
        for t in range(xs.shape[1]):
            i, f, g, o = (xs[:, t] + w_hh(h)).chunk(4, 1)
            c = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g)
            h = torch.sigmoid(o) * torch.tanh(c)
        return h.square().sum()

    xs = torch.randn(3, 12, 64)
    step(xs).backward()
    ref = [p.grad.clone() for p in w_hh.parameters()]
    w_hh.zero_grad()
    torch._dynamo.reset()
    e = torchfuse.explain(lambda t: step(t).backward(), xs)
    got = [p.grad for p in w_hh.parameters()]
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    assert any("backward: merge_mm_sum" in p and "(1 changes)" in p for p in e.passes), e.passes
