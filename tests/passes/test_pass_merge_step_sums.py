"""merge_step_sums: a sum of matrix products with small inner sizes becomes one product over the
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
    assert run(gm, "merge_step_sums", "dce") == 1
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
    assert run(gm, "merge_step_sums") == 0
    assert count(gm, aten.mm.default) == 3


def test_product_read_elsewhere_is_left_alone():
    a, b = torch.randn(8, 2), torch.randn(2, 8)
    c, d = torch.randn(8, 2), torch.randn(2, 8)

    def fn(a, b, c, d):
        p = a @ b
        return p + c @ d, p * 2          # p has a second reader

    gm = trace(fn, a, b, c, d)
    assert run(gm, "merge_step_sums") == 0
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
    assert any("backward: merge_step_sums" in p and "(0 changes)" not in p for p in e.passes), e.passes


def _slice_grads(gs, decomposed: bool, steps):
    total = None
    for t in steps:
        if decomposed:
            part = torch.select_scatter(gs[t].new_zeros(4, 5, 3), gs[t], 1, t)
        else:
            part = aten.select_backward(gs[t], [4, 5, 3], 1, t)
        total = part if total is None else total + part
    return total


def test_slice_gradients_of_every_step_become_a_stack():
    """The gradient of xs[:, t] for every t: one stack instead of a kernel testing each step's
    slice for every element (both autograd's select_backward and its decomposition)."""
    gs = [torch.randn(4, 3) for _ in range(5)]
    for decomposed in (False, True):
        order = [3, 0, 4, 1, 2]            # any order of the steps

        def fn(gs):
            return _slice_grads(gs, decomposed, order)
        gm = trace(fn, gs)
        assert run(gm, "merge_step_sums", "dce") == 1
        assert count(gm, aten.stack.default) == 1 and count(gm, aten.add.Tensor) == 0
        assert_same(gm(gs), fn(gs))


def test_slice_gradients_missing_a_step_are_left_alone():
    gs = [torch.randn(4, 3) for _ in range(5)]

    def fn(gs):
        return _slice_grads(gs, False, [0, 1, 2, 4])
    gm = trace(fn, gs)
    assert run(gm, "merge_step_sums") == 0
    assert_same(gm(gs), fn(gs))
