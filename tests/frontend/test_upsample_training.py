"""Upsampling in training graphs (frontend/upsample_training.py): the backward of a bilinear or
nearest upsample is ATen's upsample backward, not the accumulating index_put that differentiating
the decomposition gives; outputs and gradients are eager's."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from torchfuse import counters


class UpNet(nn.Module):
    def __init__(self, **interp):
        super().__init__()
        self.conv = nn.Conv2d(3, 6, 3, padding=1)
        self.interp = interp

    def forward(self, x):
        y = torch.relu(self.conv(x))
        return F.interpolate(y, **self.interp) * 1.5 + 0.25


CASES = [
    dict(scale_factor=2, mode="bilinear", align_corners=False),
    dict(scale_factor=2, mode="bilinear", align_corners=True),
    dict(size=(13, 10), mode="bilinear"),                       # odd, non-integer ratios
    dict(scale_factor=1.7, mode="bilinear", align_corners=False),
    dict(scale_factor=(1.5, 2.5), mode="bilinear", recompute_scale_factor=True),
    dict(scale_factor=2, mode="nearest"),
    dict(size=(11, 7), mode="nearest"),
    dict(scale_factor=1.5, mode="nearest-exact"),
]


def _graphs(debug_dir) -> str:
    return "\n".join(p.read_text() for p in sorted(debug_dir.rglob("00_aten_graph.txt")))


@pytest.mark.parametrize("interp", CASES, ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()))
def test_upsample_training_step(interp, tmp_path):
    torch.manual_seed(0)
    model = UpNet(**interp)
    ref = copy.deepcopy(model)
    before = counters["upsample_aten_backward"]
    compiled = torch.compile(model, backend="torchfuse", options={"debug": True, "debug_dir": str(tmp_path)})
    x = torch.randn(2, 3, 9, 8).transpose(2, 3)          # non-contiguous input
    g = torch.randn_like(ref(x))
    out, expected = compiled(x), ref(x)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    out.backward(g)
    expected.backward(g)
    for (name, p), r in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, r.grad, rtol=1e-4, atol=1e-4, msg=name)
    assert counters["upsample_aten_backward"] - before == 1
    graphs = _graphs(tmp_path)
    assert "torchfuse.upsample_backward" in graphs
    assert "index_put" not in graphs
    assert "_unsafe_index" in graphs      # the forward is still a (fused) gather


@pytest.mark.parametrize("mode,shape,kwargs", [
    ("linear", (2, 3, 9), dict(scale_factor=2.5)),
    ("linear", (2, 3, 9), dict(size=13, align_corners=True)),
    ("nearest", (2, 3, 9), dict(size=20)),
    ("trilinear", (2, 3, 4, 5, 3), dict(scale_factor=(2, 1.5, 3))),
    ("nearest", (2, 3, 4, 5, 3), dict(scale_factor=2)),
    ("nearest-exact", (2, 3, 4, 5, 3), dict(size=(5, 7, 4))),
])
def test_1d_and_3d(mode, shape, kwargs, tmp_path):
    def f(x):
        return F.interpolate(torch.tanh(x), mode=mode, **kwargs) * 2

    x = torch.randn(shape, requires_grad=True)
    xr = x.detach().clone().requires_grad_()
    compiled = torch.compile(f, backend="torchfuse", options={"debug": True, "debug_dir": str(tmp_path)})
    out, expected = compiled(x), f(xr)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    g = torch.randn_like(expected)
    out.backward(g)
    expected.backward(g)
    torch.testing.assert_close(x.grad, xr.grad, rtol=1e-4, atol=1e-5)
    graphs = _graphs(tmp_path)
    assert "torchfuse.upsample_backward" in graphs and "index_put" not in graphs


def test_input_gradient_and_new_batch(tmp_path):
    """The gradient reaches the graph's input; a new batch size compiles no new kernels."""
    def f(x):
        return F.interpolate(torch.sigmoid(x), scale_factor=2, mode="bilinear").sum(dim=(2, 3))

    before = counters["upsample_aten_backward"]
    compiled = torch.compile(f, backend="torchfuse", dynamic=True)
    for batch in (3, 5):
        x = torch.randn(batch, 4, 7, 6, requires_grad=True)
        xr = x.detach().clone().requires_grad_()
        g = torch.randn(batch, 4)
        compiled(x).backward(g)
        f(xr).backward(g)
        torch.testing.assert_close(x.grad, xr.grad, rtol=1e-4, atol=1e-5)
        if batch == 3:
            kernels = counters["kernels_generated"]
    assert counters["kernels_generated"] == kernels
    assert counters["upsample_aten_backward"] - before == 1


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision(dtype):
    conv = nn.Conv2d(3, 4, 1).to(dtype)
    ref = copy.deepcopy(conv)

    def f(m, x):
        return F.interpolate(m(x), scale_factor=2, mode="bilinear", align_corners=True)

    x = torch.randn(2, 3, 5, 6, dtype=dtype)
    compiled = torch.compile(f, backend="torchfuse")
    g = torch.randn(2, 4, 10, 12, dtype=dtype)
    compiled(conv, x).backward(g)
    f(ref, x).backward(g)
    torch.testing.assert_close(conv.weight.grad, ref.weight.grad, rtol=2e-2, atol=2e-2)


def test_inference_graph_is_untouched():
    before = counters["upsample_aten_backward"]
    compiled = torch.compile(lambda x: F.interpolate(x, scale_factor=2, mode="bilinear"), backend="torchfuse")
    x = torch.randn(1, 2, 3, 4)
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), F.interpolate(x, scale_factor=2, mode="bilinear"))
    assert counters["upsample_aten_backward"] == before


def test_graph_cache_keeps_the_rewritten_graph(tmp_path):
    """torchfuse's own op in Dynamo's graph does not keep the step out of the graph cache."""
    def step():
        torch._dynamo.reset()
        torch.manual_seed(1)
        conv = nn.Conv2d(3, 4, 3)
        f = torch.compile(lambda x: F.interpolate(conv(x), scale_factor=2, mode="bilinear"), backend="torchfuse",
                          options={"cache_dir": str(tmp_path)})
        f(torch.randn(2, 3, 8, 8)).square().sum().backward()
        return conv.weight.grad

    first = step()
    hits = counters["graph_cache_hits"]
    torch.testing.assert_close(step(), first)
    assert counters["graph_cache_hits"] - hits == 2      # forward and backward
