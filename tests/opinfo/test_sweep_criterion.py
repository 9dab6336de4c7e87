"""The OpInfo sweep's float16/bfloat16 criterion: off eager by more than the tolerance passes only
when torchfuse is about as accurate as eager against a float64 run (opinfo_sweep._low_precision_ok)."""
from __future__ import annotations

from types import SimpleNamespace

import torch

from torchfuse.tools import opinfo_sweep as sweep


def _case(fn, *tensors, **kwargs):
    op = SimpleNamespace(op=fn)
    parts: list[torch.Tensor] = []
    template = sweep._split((tensors[0], tuple(tensors[1:]), kwargs), parts)
    expected = sweep._call(op, template, parts)
    return op, sweep._Case(0, template, parts, expected, [t.clone() for t in parts])


def _inputs():
    g = torch.Generator().manual_seed(0)
    a = torch.randn(64, 33, generator=g).half() * 8
    b = torch.randn(64, 33, generator=g).half() * 8
    c = torch.rand(64, 33, generator=g).half() + 0.05
    return a, b, c


def test_more_accurate_than_eager_passes():
    # eager rounds a / c to fp16 before adding; computing in fp32 and rounding once is closer to float64
    a, _, c = _inputs()
    op, case = _case(lambda a, c: a + a / c * 3, a, c)
    got = (a.float() + a.float() / c.float() * 3).half()
    assert not torch.equal(got, case.expected)
    ok, why = sweep._low_precision_ok(op, case, got, atol=1e-3)
    assert ok, why


def test_less_accurate_than_eager_is_a_mismatch():
    a, b, _ = _inputs()
    op, case = _case(lambda a, b: a * b, a, b)
    got = (case.expected.float() * (1 + 3e-3)).half()        # a few ulps off everywhere
    ok, why = sweep._low_precision_ok(op, case, got, atol=1e-3)
    assert not ok and "less accurate than eager" in why


def test_nan_where_eager_has_none_is_a_mismatch():
    a, b, _ = _inputs()
    op, case = _case(lambda a, b: a + b, a, b)
    got = case.expected.clone()
    got[0, 0] = float("nan")
    assert not sweep._low_precision_ok(op, case, got, atol=1e-3)[0]


def test_judged_against_the_aten_graph_dynamo_hands_over():
    # Dynamo rewrites addcdiv(..., value=v) into div, mul, add on fp16 tensors, each rounding in eager
    # too: torchfuse runs that graph exactly, so it is compared with eager running the same graph
    a, b, c = _inputs()
    op, case = _case(torch.addcdiv, a, b, c, value=3.14)
    graph = sweep._aot_eager_outputs(op, case)
    assert graph is not None and not torch.equal(graph, case.expected)
    ok, why = sweep._low_precision_ok(op, case, graph, atol=1e-3)
    assert ok and "same aten graph" in why, why
