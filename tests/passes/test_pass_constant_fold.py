"""Constant folding."""
from __future__ import annotations

import pytest
import torch

from _passes_helpers import FLAVOUR_IDS, FLAVOURS, check, count, inputs_of, run, trace

aten = torch.ops.aten


def _consts(gm):
    return [n for n in gm.graph.nodes if n.op == "get_attr" and n.target.startswith("_tf_const_")]


@pytest.mark.parametrize("dtype,noncontig", FLAVOURS, ids=FLAVOUR_IDS)
def test_folds_small_constant_expression(dtype, noncontig):
    def f(x):
        c = (torch.arange(6, dtype=x.dtype).view(2, 3).t() * 3 + 1).neg()
        return x * c
    x = inputs_of(dtype, 3, 2, noncontig=noncontig)
    gm = trace(f, x)
    assert run(gm, "constant_fold") == 1
    (const,) = _consts(gm)
    assert count(gm, aten.arange.start_step) + count(gm, aten.arange.default) == 0
    assert count(gm, aten.neg.default) == 0 and count(gm, aten.add.Tensor) == 0
    assert [t for t in [n.target for n in gm.graph.nodes if n.op == "call_function"]] == [aten.mul.Tensor]
    # the buffer and its metadata agree (the lowering trusts both)
    buf, val = getattr(gm, const.target), const.meta["val"]
    assert buf.shape == val.shape == (3, 2) and buf.dtype == val.dtype == dtype
    assert buf.stride() == val.stride()
    check(f, gm, [x])


def test_folds_tensor_literals_and_reductions():
    def f(x):
        return x + torch.tensor([1.5, -2.0, 3.25]).sum() * torch.tensor([2.0, 4.0, 8.0])
    x = inputs_of(torch.float32, 3)
    gm = trace(f, x)
    assert run(gm, "constant_fold") == 1
    assert count(gm, aten.sum.default) == 0 and count(gm, aten.lift_fresh_copy.default) == 0
    check(f, gm, [x])


def test_folds_getitem_of_multi_output_op():
    def f(x):
        vals, idx = torch.tensor([[3.0, 1.0], [2.0, 5.0]]).max(dim=1)
        return x * vals + idx
    x = inputs_of(torch.float32, 2)
    gm = trace(f, x)
    assert run(gm, "constant_fold") == 2
    assert count(gm, aten.max.dim) == 0
    check(f, gm, [x])


def test_large_constants_stay_lazy():
    def f(x):
        return x + torch.full((2048,), 2.0) * 3
    x = inputs_of(torch.float32, 2048)
    gm = trace(f, x)
    assert run(gm, "constant_fold") == 0
    assert count(gm, aten.full.default) == 1 and not _consts(gm)
    check(f, gm, [x])


def test_constructors_alone_are_not_folded():
    def f(x):
        return x + torch.ones(4) + torch.full((4,), 3.0)
    gm = trace(f, inputs_of(torch.float32, 4))
    assert run(gm, "constant_fold") == 0
    assert not _consts(gm)


def test_views_are_not_materialized():
    def f(x):
        return x + (torch.arange(6.0) + 1).view(2, 3)
    x = inputs_of(torch.float32, 2, 3)
    gm = trace(f, x)
    assert run(gm, "constant_fold") == 1
    (const,) = _consts(gm)
    assert const.meta["val"].shape == (6,)  # the add was folded; its view stays a view
    assert [u.target for u in const.users] == [aten.view.default]
    check(f, gm, [x])


def test_does_not_fold_random_or_input_dependent():
    def f(x):
        return x + torch.rand(4) * 2 + x.sum() * torch.arange(4.0)
    gm = trace(f, inputs_of(torch.float32, 4))
    before = str(gm.graph)
    assert run(gm, "constant_fold") == 0
    assert str(gm.graph) == before


def test_does_not_fold_symbolic_shapes():
    def f(x):
        return x + torch.ones(x.shape[0]).cumsum(0)
    gm = trace(f, inputs_of(torch.float32, 5), mode="symbolic")
    assert run(gm, "constant_fold") == 0
    for n in (3, 7):
        check(f, gm, [inputs_of(torch.float32, n)])


def test_does_not_fold_graph_outputs():
    # the caller would receive the module's buffer and could corrupt it for the next call
    def f(x):
        return x + 1, torch.arange(4.0) * 2, (torch.arange(4.0) * 3).view(2, 2)
    gm = trace(f, inputs_of(torch.float32, 4))
    assert run(gm, "constant_fold") == 0
    out = gm(inputs_of(torch.float32, 4))
    out[1].add_(100)
    assert gm(inputs_of(torch.float32, 4))[1].tolist() == [0.0, 2.0, 4.0, 6.0]


def test_does_not_fold_parameters():
    # a parameter is module state an optimizer may update between calls, not a constant
    def f(x):
        return x * (torch.tensor([1.0, 2.0, 3.0]) * 2)
    gm = trace(f, inputs_of(torch.float32, 3))
    (attr,) = [n.target for n in gm.graph.nodes if n.op == "get_attr"]
    setattr(gm, attr, torch.nn.Parameter(torch.tensor([1.0, 2.0, 3.0])))
    assert run(gm, "constant_fold") == 0
    with torch.no_grad():
        getattr(gm, attr).mul_(10)
    x = inputs_of(torch.float32, 3)
    torch.testing.assert_close(gm(x), x * torch.tensor([20.0, 40.0, 60.0]))
