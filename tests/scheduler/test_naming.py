"""Kernel names say what a kernel fuses (`poi_fused_mul_add_relu_0`), are unique within a graph
and the same on every compile, appear in refused-fusion reasons, and show up in torch.profiler
for C++ kernels (whose calls are otherwise invisible inside the compiled region)."""
from __future__ import annotations

import os
import re

import pytest
import torch

import torchfuse
from torchfuse.scheduler.naming import op_of

os.environ.setdefault("TRITON_INTERPRET", "1")     # the Triton backend on CPU tensors


def pointwise_then_softmax(x, w):
    return (torch.relu(x * 2 + 1) @ w).softmax(-1)


def test_names_list_the_fused_ops_in_order():
    x, w = torch.randn(9, 7), torch.randn(7, 5)
    e = torchfuse.explain(pointwise_then_softmax, x, w)
    torch.testing.assert_close(e.output, pointwise_then_softmax(x, w))
    assert [k.name for k in e.kernels] == ["poi_fused_mul_add_relu_0", "red_fused_softmax_1"]
    assert "graph" in str(e).splitlines()[0] and "kernel0" not in str(e)


@pytest.mark.parametrize("backend", ["cpp", "triton"])
def test_names_are_the_users_ops_before_decomposition(backend):
    """A layer norm and a GELU decompose into var, sub, rsqrt, mul, erf, ...; the kernel is
    named after the two ops the user wrote (it read red_fused_var_div_unsqueeze_sub_add_0)."""
    def fn(x, w, b):
        return torch.nn.functional.gelu(torch.nn.functional.layer_norm(x, (x.shape[-1],), w, b)) * 2
    x, w, b = torch.randn(6, 37), torch.randn(37), torch.randn(37)
    e = torchfuse.explain(fn, x, w, b, options={"cpu_backend": backend})
    torch.testing.assert_close(e.output, fn(x, w, b), rtol=1e-4, atol=1e-5)
    assert [k.name for k in e.kernels] == ["red_fused_native_layer_norm_gelu_mul_0"], [k.name for k in e.kernels]
    assert "red_fused_native_layer_norm_gelu_mul_0" in e.kernels[0].source


def test_names_are_unique_and_the_same_on_every_compile():
    def fn(x):
        a = (x * 3).sum(0)
        b = (x * 3).sum(1)
        return a.sin(), b.cos(), (x - 1).relu()
    x = torch.randn(33, 17).t()
    reports = [torchfuse.explain(fn, x) for _ in range(2)]
    for got, want in zip(reports[0].output, fn(x)):
        torch.testing.assert_close(got, want)
    names = [[k.name for k in e.kernels] for e in reports]
    assert names[0] == names[1]
    assert len(set(names[0])) == len(names[0]) >= 2
    assert all(re.fullmatch(r"(poi|red)_fused_[a-z0-9_]+_\d+", n) for n in names[0]), names


def test_op_names_from_node_names():
    assert op_of("mul_12") == "mul" and op_of("_to_copy_1") == "to_copy" and op_of("var") == "var"
    assert op_of("_3") == "op"


def test_refused_fusions_name_the_renamed_kernels():
    def fn(x):
        return (x * 2).sum(-1, keepdim=True) + x.t().sum(-1)
    x = torch.randn(16, 16)
    e = torchfuse.explain(fn, x)
    torch.testing.assert_close(e.output, fn(x))
    names = {k.name for k in e.kernels}
    assert e.refused_fusions, str(e)
    for reason in e.refused_fusions:
        assert not re.search(r"\bkernel\d+", reason), reason
        assert any(n in reason for n in names), reason


@pytest.mark.parametrize("backend", ["cpp", "triton"])
def test_profiler_shows_kernels_by_name(backend):
    x, w = torch.randn(20, 8), torch.randn(8, 6)
    e = torchfuse.explain(pointwise_then_softmax, x, w, options={"cpu_backend": backend})
    compiled = torchfuse.compile(pointwise_then_softmax, options={"cpu_backend": backend})
    expected = pointwise_then_softmax(x, w)
    torch.testing.assert_close(compiled(x, w), expected)
    with torch.profiler.profile() as prof:
        got = compiled(x, w)
    torch.testing.assert_close(got, expected)          # the profiled path computes the same
    events = {ev.name for ev in prof.events()}
    assert {k.name for k in e.kernels} <= events, sorted(events)
    assert "aten::mm" in events                        # the ATen fallback between them
    torch._dynamo.reset()


class TwoLines(torch.nn.Module):
    def forward(self, x, w):
        h = torch.relu(x * 2 + 1)
        return (h @ w).softmax(-1)


def test_explain_maps_each_kernel_to_the_source_lines_it_fuses():
    x, w = torch.randn(8, 4), torch.randn(4, 3)
    e = torchfuse.explain(TwoLines(), x, w)
    torch.testing.assert_close(e.output, TwoLines()(x, w))
    first, second = e.kernels
    assert [line.split("  ", 1)[1] for line in first.lines] == ["h = torch.relu(x * 2 + 1)"]
    assert [line.split("  ", 1)[1] for line in second.lines] == ["return (h @ w).softmax(-1)"]
    assert all(line.startswith("test_naming.py:") for line in first.lines + second.lines)
    assert "at test_naming.py:" in str(e)


def test_explain_says_what_each_kernel_writes():
    def fn(x):
        h = torch.relu(x * 2 + 1)          # read again by the second kernel: stored
        return h.sum(-1), h * 3
    x = torch.randn(6, 5)
    e = torchfuse.explain(fn, x)
    for got, want in zip(e.output, fn(x)):
        torch.testing.assert_close(got, want)
    writes = {k.name: k.writes for k in e.kernels}
    assert all(writes.values()), writes
    assert all(w.startswith("buf") and w.endswith(")") for ws in writes.values() for w in ws), writes
    assert "writes buf" in str(e)
