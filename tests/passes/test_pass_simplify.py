"""Algebraic simplification rules: what must be rewritten and what must not."""
from __future__ import annotations

import pytest
import torch

from _passes_helpers import FLAVOUR_IDS, FLAVOURS, check, count, inputs_of, n_calls, run, trace
from torchfuse.passes.simplify import RULES, widens_exactly

aten, prims = torch.ops.aten, torch.ops.prims


def _probe(x):
    """Every result is read by one `sin`-free consumer (x * 3) so no rewrite touches an output."""
    return x * 3


# fn(x) with an identity inside; after simplify the graph is just the surrounding ops
IDENTITIES = {
    "mul_one": lambda x: _probe(x * 1) + _probe(1 * x),
    "div_one": lambda x: _probe(x / 1) if x.is_floating_point() else _probe(x * 1),
    "pow_one": lambda x: _probe(x ** 1),
    "sub_zero": lambda x: _probe(x - 0),
    "neg_neg": lambda x: _probe(-(-x)),
    "view_same": lambda x: _probe(x.reshape(x.shape)) + _probe(x.view(x.shape)),
    "expand_same": lambda x: _probe(x.expand(x.shape)),
    "permute_id": lambda x: _probe(x.permute(0, 1)) + _probe(x.transpose(1, 1)),
    "alias": lambda x: _probe(torch.ops.aten.alias(x)),
    "full_slice": lambda x: _probe(x[:, :]),
    "to_same_dtype": lambda x: _probe(x.to(x.dtype, copy=True)),
}


@pytest.mark.parametrize("name", list(IDENTITIES))
@pytest.mark.parametrize("dtype,noncontig", FLAVOURS, ids=FLAVOUR_IDS)
def test_identity_rules(name, dtype, noncontig):
    fn = IDENTITIES[name]
    x = inputs_of(dtype, 4, 6, noncontig=noncontig)
    gm = trace(fn, x)
    assert run(gm, "simplify") >= 1
    run(gm, "dce")
    muls = count(gm, aten.mul.Tensor)
    assert n_calls(gm) - muls <= 1  # only the probes and the add joining them remain
    assert all(n.target in (aten.mul.Tensor, aten.add.Tensor)
               for n in gm.graph.nodes if n.op == "call_function")
    check(fn, gm, [x])


def test_add_zero_rewritten_for_ints_and_bools():
    def f(i, b):
        return (i + 0) * 3, (0 + i) * 3, (b + False) | b
    i, b = inputs_of(torch.int64, 5), inputs_of(torch.int64, 5) > 0
    gm = trace(f, i, b)
    assert run(gm, "simplify") == 3
    assert count(gm, aten.add.Tensor) == 0
    check(f, gm, [i, b])


def test_add_neg_zero_rewritten_for_floats():
    def f(x):
        return (x + -0.0) * 3
    x = torch.tensor([-0.0, 0.0, 1.5, float("nan"), float("-inf")])
    gm = trace(f, x)
    assert run(gm, "simplify") == 1
    check(f, gm, [x])


def test_add_pos_zero_not_rewritten_for_floats():
    # -0.0 + 0.0 == +0.0: dropping the add would change the sign of zero
    def f(x):
        return (x + 0.0) * 3, (x + 0) * 3, (x - -0.0) * 3, x.add(torch.zeros(5), alpha=2) * 3
    x = torch.tensor([-0.0, 0.0, 1.5, -2.0, 3.0])
    gm = trace(f, x)
    assert run(gm, "simplify") == 0
    check(f, gm, [x])


def test_constant_tensor_operands():
    def f(x):
        return (x * torch.ones(4, 6)) * 3 + (x + torch.full((6,), -0.0)) * 3
    x = inputs_of(torch.float32, 4, 6)
    gm = trace(f, x)
    assert run(gm, "simplify") == 2
    check(f, gm, [x])


def test_broadcasting_identity_not_rewritten():
    def f(x):
        return (x * torch.ones(2, 4, 6)) * 3
    x = inputs_of(torch.float32, 4, 6)
    gm = trace(f, x)
    assert run(gm, "simplify") == 0
    check(f, gm, [x])


def test_dtype_changing_identity_not_rewritten():
    def f(i):
        return (i * 1.0) * 3, (i / 1) * 3, (i.to(torch.float16) * torch.ones(5, dtype=torch.float32)) * 3
    i = inputs_of(torch.int64, 5)
    gm = trace(f, i)
    before = n_calls(gm)
    assert run(gm, "simplify") == 0
    assert n_calls(gm) == before
    check(f, gm, [i])


def test_layout_changing_identity_not_rewritten():
    # x * 1 of an expanded tensor is a dense tensor; a later view depends on that
    def f(x):
        return (x.expand(4, 6) * 1).view(24) * 3
    x = inputs_of(torch.float32, 1, 6)
    gm = trace(f, x)
    assert run(gm, "simplify") == 0
    check(f, gm, [x])


def test_cast_chains():
    def f(x, i):
        return ((x.double().float() * 3, i.int().long() * 3, i.to(torch.int32).to(torch.float64).to(torch.int32)))
    x, i = inputs_of(torch.float32, 5), inputs_of(torch.int64, 5)
    gm = trace(f, x, i)
    # f32 -> f64 -> f32 and the int32 -> f64 -> int32 tail are exact; i64 -> i32 -> i64 is not
    assert run(gm, "simplify") == 2
    run(gm, "dce")
    assert count(gm, aten._to_copy.default) == 3  # .int(), .long(), .to(torch.int32)
    check(f, gm, [x, i])
    x16 = inputs_of(torch.float16, 5)
    gm = trace(lambda h: h.float().half() * 3, x16)
    assert run(gm, "simplify") == 1
    check(lambda h: h.float().half() * 3, gm, [x16])


def test_narrowing_cast_chain_not_rewritten():
    def f(x):
        return x.half().float() * 3, x.bfloat16().float() * 3, x.long().float() * 3
    x = inputs_of(torch.float32, 64) * 1.2345
    gm = trace(f, x)
    assert run(gm, "simplify") == 0
    check(f, gm, [x])


def test_widens_exactly_table():
    f16, bf16, f32, f64 = torch.float16, torch.bfloat16, torch.float32, torch.float64
    assert widens_exactly(f16, f32) and widens_exactly(bf16, f64) and widens_exactly(f32, f64)
    assert not widens_exactly(f32, f16) and not widens_exactly(f16, bf16) and not widens_exactly(f64, f32)
    assert widens_exactly(torch.int32, torch.int64) and widens_exactly(torch.int32, f64)
    assert widens_exactly(torch.uint8, f16) and widens_exactly(torch.int16, f32)
    assert not widens_exactly(torch.int32, f32) and not widens_exactly(torch.int64, f64)
    assert not widens_exactly(torch.int64, torch.int32) and not widens_exactly(torch.uint8, torch.int8)
    assert widens_exactly(torch.bool, torch.uint8) and not widens_exactly(f32, torch.int64)


def test_prims_convert_element_type():
    def f(x):
        return prims.convert_element_type(prims.convert_element_type(x, torch.float64), torch.float32) * 3 + \
            prims.convert_element_type(x, torch.float32) * 3
    x = inputs_of(torch.float32, 5)
    gm = trace(f, x)
    assert run(gm, "simplify") == 2
    check(f, gm, [x])


def test_view_of_view_collapses():
    def f(x):
        return x.view(6, 4).view(2, 12).view(24) * 3
    x = inputs_of(torch.float32, 4, 6)
    gm = trace(f, x)
    run(gm, "simplify", "dce")
    assert count(gm, aten.view.default) == 1
    check(f, gm, [x])


def test_view_of_view_needing_intermediate_kept():
    # the direct view of a non-contiguous input would need a copy: must keep the chain
    def f(x):
        return x.reshape(24).view(4, 6) * 3
    x = inputs_of(torch.float32, 4, 6, noncontig=True)
    gm = trace(f, x)
    run(gm, "simplify", "dce")
    check(f, gm, [x])


def test_clone_single_use():
    def f(x, y):
        return (x * 2).clone() * 3, (y.t() * 2).clone(memory_format=torch.contiguous_format) * 3
    x, y = inputs_of(torch.float32, 4, 6), inputs_of(torch.float32, 4, 6)
    gm = trace(f, x, y)
    assert run(gm, "simplify") == 1
    assert count(gm, aten.clone.default) == 1
    check(f, gm, [x, y])


def test_outputs_never_become_inputs_or_each_other():
    def f(x):
        y = x.sin()
        w = x.cos()  # visible only through w * 1: that one may go
        return x * 1, x.view(x.shape), x.clone(), y, y * 1, y.to(torch.float32, copy=True), w * 1
    x = inputs_of(torch.float32, 4, 6)
    gm = trace(f, x)
    assert run(gm, "simplify") == 1
    assert count(gm, aten.mul.Tensor) == 2
    outs = gm(x)
    ptrs = [o.data_ptr() for o in outs]
    assert ptrs[0] != x.data_ptr() and ptrs[2] != x.data_ptr()
    assert len({ptrs[0], ptrs[2], ptrs[3], ptrs[4], ptrs[5]}) == 5
    check(f, gm, [x])


def test_symbolic_shapes():
    def f(x):
        n = x.shape[0]
        return (x.view(n, -1).view(n * x.shape[1]) * 1 + -0.0) * 3
    gm = trace(f, inputs_of(torch.float32, 3, 4), mode="symbolic")
    assert run(gm, "simplify") >= 2
    for shape in [(3, 4), (5, 2)]:
        check(f, gm, [inputs_of(torch.float32, *shape)])


def test_rules_are_small_functions():
    assert len(RULES) >= 10 and all(callable(r) for r in RULES)
