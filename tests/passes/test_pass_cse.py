"""Common subexpression elimination."""
from __future__ import annotations

import pytest
import torch

from _passes_helpers import FLAVOUR_IDS, FLAVOURS, check, count, inputs_of, run, trace

aten = torch.ops.aten


def _dups(x, y):
    a = (x * y + 2).abs()
    b = (x * y + 2).abs()
    return a - b * y, (x * y).sum(dim=0, keepdim=True)


@pytest.mark.parametrize("dtype,noncontig", FLAVOURS, ids=FLAVOUR_IDS)
def test_merges_duplicates(dtype, noncontig):
    args = [inputs_of(dtype, 4, 6, noncontig=noncontig), inputs_of(dtype, 4, 6)]
    gm = trace(_dups, *args)
    assert count(gm, aten.mul.Tensor) == 4
    assert run(gm, "cse") == 4  # two more x*y, +2, abs
    assert count(gm, aten.mul.Tensor) == 2  # x*y once, b*y
    assert count(gm, aten.abs.default) == 1
    check(_dups, gm, args)


def test_merges_views_and_symint_ops():
    def f(x):
        return x.view(-1).sin() + x.view(-1).cos() * x.shape[0]
    gm = trace(f, inputs_of(torch.float32, 3, 4), mode="symbolic")
    run(gm, "cse")
    assert count(gm, aten.view.default) == 1
    for shape in [(3, 4), (5, 2)]:
        x = inputs_of(torch.float32, *shape)
        check(f, gm, [x])


def test_does_not_merge_random_ops():
    def f(x):
        return torch.rand_like(x) + torch.rand_like(x), torch.nn.functional.dropout(x, 0.5) - \
            torch.nn.functional.dropout(x, 0.5)
    gm = trace(f, inputs_of(torch.float32, 64))
    n_rand = count(gm, aten.rand_like.default)
    run(gm, "cse")
    assert count(gm, aten.rand_like.default) == n_rand == 2
    x = inputs_of(torch.float32, 64)
    torch.manual_seed(0)
    expected = f(x)
    torch.manual_seed(0)
    check(lambda x: expected, gm, [x])


def test_distinguishes_signed_zero_and_literal_types():
    def f(x, i):
        return x + 0.0, x + -0.0, i * 1, i * 1.0
    x = torch.tensor([-0.0, 0.0, 1.5, -2.0])
    i = inputs_of(torch.int64, 4)
    gm = trace(f, x, i)
    assert run(gm, "cse") == 0
    check(f, gm, [x, i])


def test_does_not_alias_two_outputs():
    # eager returns two distinct tensors; merging them would let a caller's in-place update
    # of one show up in the other
    def f(x):
        return x.exp(), x.exp()
    gm = trace(f, inputs_of(torch.float32, 4))
    assert run(gm, "cse") == 0
    a, b = gm(inputs_of(torch.float32, 4))
    assert a.data_ptr() != b.data_ptr()


def test_does_not_merge_across_mutation():
    def f(x):
        a = x * 2
        x.add_(1)
        b = x * 2
        return a * b
    gm = trace(f, inputs_of(torch.float32, 4))
    # make_fx reads the add_ node's result afterwards; a non-functional graph may instead read
    # the mutated tensor itself, which is what a barrier-less CSE would get wrong
    add_ = next(n for n in gm.graph.nodes if n.target is aten.add_.Tensor)
    x_node = add_.args[0]
    for user in list(add_.users):
        user.replace_input_with(add_, x_node)
    gm.recompile()
    assert count(gm, aten.mul.Tensor) == 3
    assert run(gm, "cse") == 0
    x = inputs_of(torch.float32, 4)
    x1, x2 = x.clone(), x.clone()
    torch.testing.assert_close(gm(x1), f(x2))
    torch.testing.assert_close(x1, x2)


def test_does_not_merge_allocations_filled_in_place():
    def f(x):
        a = torch.empty_like(x).fill_(1.0)
        b = torch.empty_like(x).fill_(2.0)
        return x + a * b
    gm = trace(f, inputs_of(torch.float32, 4))
    run(gm, "cse")
    assert count(gm, aten.empty_like.default) == 2
    check(f, gm, [inputs_of(torch.float32, 4)])
