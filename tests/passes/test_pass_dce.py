"""Dead code elimination."""
from __future__ import annotations

import pytest
import torch
from torch.func import functionalize

from _passes_helpers import FLAVOUR_IDS, FLAVOURS, check, count, inputs_of, n_calls, run, trace

aten = torch.ops.aten


def _dead_chain(x, y):
    unused = (x + y).relu().sum()  # noqa: F841
    return x * y


@pytest.mark.parametrize("dtype,noncontig", FLAVOURS, ids=FLAVOUR_IDS)
def test_removes_dead_chain(dtype, noncontig):
    args = [inputs_of(dtype, 4, 6, noncontig=noncontig), inputs_of(dtype, 4, 6)]
    gm = trace(_dead_chain, *args)
    assert n_calls(gm) == 4
    assert run(gm, "dce") == 3
    assert [n.target for n in gm.graph.nodes if n.op == "call_function"] == [aten.mul.Tensor]
    check(_dead_chain, gm, args)


def test_keeps_placeholders_and_output():
    def f(x, unused):
        return x + 1
    gm = trace(f, inputs_of(torch.float32, 3), inputs_of(torch.float32, 3))
    run(gm, "dce")
    assert [n.op for n in gm.graph.nodes] == ["placeholder", "placeholder", "call_function", "output"]


def test_keeps_input_mutation_copy_():
    # AOTAutograd expresses input mutation as a trailing copy_ whose result nobody reads.
    def f(x):
        x.mul_(3)
        unused = x.exp()  # noqa: F841
        return x.sin()
    x = inputs_of(torch.float32, 5)
    gm = trace(functionalize(f, remove="mutations_and_views"), x)
    assert count(gm, aten.copy_.default) == 1
    copy_node = next(n for n in gm.graph.nodes if n.target is aten.copy_.default)
    assert not copy_node.users
    assert run(gm, "dce") == 1  # just the exp
    assert count(gm, aten.copy_.default) == 1
    x1, x2 = x.clone(), x.clone()
    torch.testing.assert_close(gm(x1), f(x2))
    torch.testing.assert_close(x1, x2)  # the input was mutated like eager does


def test_keeps_unused_random_ops():
    # Dropping a dead rand would shift the RNG stream seen by every later random op.
    def f(x):
        torch.rand_like(x)
        return x + torch.rand_like(x)
    gm = trace(f, inputs_of(torch.float32, 8))
    run(gm, "dce")
    assert count(gm, aten.rand_like.default) == 2
    x = inputs_of(torch.float32, 8)
    torch.manual_seed(0)
    expected = f(x)
    torch.manual_seed(0)
    torch.testing.assert_close(gm(x), expected)


def test_keeps_unused_in_place_ops_on_intermediates():
    def f(x):
        y = x * 2
        y.add_(1)  # result unused, but y is read afterwards
        return y
    gm = trace(f, inputs_of(torch.float32, 4))
    run(gm, "dce")
    assert count(gm, aten.add_.Tensor) == 1
    x = inputs_of(torch.float32, 4)
    check(f, gm, [x])


def test_removes_dead_multi_output_op_and_getitems():
    def f(x):
        vals, idx = x.max(dim=0)  # noqa: F841
        return x + 1
    gm = trace(f, inputs_of(torch.float32, 3, 4))
    assert run(gm, "dce") == 3
    assert n_calls(gm) == 1


def test_keeps_asserts():
    def f(x):
        torch._assert_async(x.sum() != 12345.0)
        return x * 2
    gm = trace(f, inputs_of(torch.float32, 4))
    n_assert = count(gm, aten._assert_async.default)
    assert n_assert == 1
    run(gm, "dce")
    assert count(gm, aten._assert_async.default) == 1
