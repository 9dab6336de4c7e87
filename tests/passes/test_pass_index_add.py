"""accumulate_by_index_add: an accumulating index_put along one index tensor (the backward of
`x[idx]`) runs as index_add on the devices of `index_add_devices` (CUDA by default; the CPU is
named here to run it), with index_put's semantics: negative indices, duplicates, broadcast
values, index tensors of any rank; fp16 and bf16 keep index_put, which sums duplicates in fp32."""
from __future__ import annotations

import pytest
import torch

from _passes_helpers import assert_same, count, trace
from torchfuse.passes import PassContext, run_passes

aten = torch.ops.aten
ON_CPU = PassContext(index_add_devices=("cpu",))


def _accumulate(op=aten.index_put.default):
    def fn(base, idx, values):
        return op(base, [idx], values, True)
    return fn


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.int64, torch.int32])
@pytest.mark.parametrize("idx_shape,values_shape", [
    ((40,), (40, 3)),            # the gather backward of table[idx]: one row per index
    ((7, 9), (7, 9, 3)),         # an index tensor of rank 2 (Swin's [49, 49] position index)
    ((7, 9), (3,)),              # values broadcast over the indexed rows
    ((0,), (0, 3)),              # no index at all
    ((13,), (13, 1))])           # rows of one element, broadcast along them
def test_rewrite_matches_index_put(dtype, idx_shape, values_shape):
    torch.manual_seed(0)
    base = (torch.randn(11, 3) * 4).to(dtype)
    idx = torch.randint(-11, 11, idx_shape)        # negative ones count from the end; duplicates
    values = (torch.randn(values_shape) * 4).to(dtype)
    fn = _accumulate()
    gm = trace(fn, base, idx, values)
    records = run_passes(gm, ("accumulate_by_index_add", "dce"), ON_CPU)
    assert records[0].changes == 1
    assert count(gm, aten.index_put.default) == 0 and count(gm, aten.index_add.default) == 1
    # float sums may add in another order (a lost duplicate or a misplaced negative index is
    # off by ~4)
    tol = {torch.float32: 1e-5, torch.float64: 1e-12}.get(dtype, 0)
    assert_same(gm(base, idx, values), fn(base, idx, values), exact=tol == 0, atol=tol, rtol=tol)


def test_unsafe_index_put_and_int32_indices():
    torch.manual_seed(0)
    base, idx, values = torch.randn(6, 4, 2), torch.randint(0, 6, (9,), dtype=torch.int32), torch.randn(9, 4, 2)
    fn = _accumulate(aten._unsafe_index_put.default)
    gm = trace(fn, base, idx, values)
    assert run_passes(gm, ("accumulate_by_index_add",), ON_CPU)[0].changes == 1
    assert_same(gm(base, idx, values), fn(base, idx, values), exact=False, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("case", ["not_accumulating", "two_indices", "mask", "device_not_named", "deterministic",
                                  "bfloat16", "float16", "symbolic_sizes"])
def test_left_alone(case):
    torch.manual_seed(0)
    base, values = torch.randn(6, 5), torch.randn(4, 5)
    idx = torch.tensor([0, 3, 3, -1])
    fn = _accumulate()
    args: tuple = (base, idx, values)
    ctx = ON_CPU
    if case == "not_accumulating":
        def fn(base, idx, values):
            return aten.index_put.default(base, [idx], values, False)
    elif case == "two_indices":
        def fn(base, idx, values):
            return aten.index_put.default(base, [idx, idx.abs()], values[:, 0], True)
    elif case == "mask":
        args = (base, torch.tensor([True, False, True, False, True, True]), torch.randn(5))
    elif case in ("bfloat16", "float16"):         # atomics would round every partial sum
        args = (base.to(getattr(torch, case)), idx, values.to(getattr(torch, case)))
    elif case == "device_not_named":
        ctx = PassContext()                        # CUDA only by default
    gm = trace(fn, *args, mode="symbolic" if case == "symbolic_sizes" else "fake")
    deterministic = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(case == "deterministic")
    try:
        assert run_passes(gm, ("accumulate_by_index_add",), ctx)[0].changes == 0
    finally:
        torch.use_deterministic_algorithms(deterministic)
    assert count(gm, aten.index_add.default) == 0
    assert_same(gm(*args), fn(*args))


def test_gather_gradient_end_to_end():
    """Through torch.compile: the position-bias gradient of a windowed attention's
    `table[index]` (Swin's relative position bias), equal to eager's."""
    torch.manual_seed(0)
    table = torch.randn(169, 3, requires_grad=True)
    index = torch.randint(0, 169, (49, 49))
    scores = torch.randn(4, 3, 49, 49)

    def fn(table, index, scores):
        bias = table[index].permute(2, 0, 1)
        return torch.softmax(scores + bias, -1)

    compiled = torch.compile(fn, backend="torchfuse", options={"index_add_devices": ("cpu",)})
    weight = torch.randn(4, 3, 49, 49)
    (compiled(table, index, scores) * weight).sum().backward()
    got, table.grad = table.grad, None
    (fn(table, index, scores) * weight).sum().backward()
    torch.testing.assert_close(got, table.grad, rtol=1e-5, atol=1e-5)
