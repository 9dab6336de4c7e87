"""strided_1x1_grads: a CPU strided 1x1 convolution's weight gradient, where oneDNN's strided
workspace overruns (few input channels, channels-last: uxlfoundation/oneDNN#6035), is computed as a
unit-stride one on the strided input; other convolutions keep their single convolution_backward."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

from _passes_helpers import assert_same, count, trace
from torchfuse.passes import PassContext, run_passes

aten = torch.ops.aten


def _backward(stride, padding, mask, groups=1, kernel=1):
    def fn(go, x, w):
        return aten.convolution_backward(go, x, w, [w.shape[0]], stride, padding, [1] * len(stride), False,
                                         [0] * len(stride), groups, mask)
    return fn


@pytest.mark.parametrize("case,changed,calls", [
    ("stride2_all_grads", 1, 2), ("stride2_weight_only", 1, 1), ("stride3_1d", 1, 2), ("stride_2x1", 1, 2),
    ("grouped_8_per_group", 1, 2), ("odd_size", 1, 2),
    ("wide_input", 0, 1), ("unit_stride", 0, 1), ("kernel3", 0, 1), ("padded", 0, 1), ("input_grad_only", 0, 1)])
def test_rewrite(case, changed, calls):
    # (batch, in channels, out channels, spatial size, kernel, stride, padding, groups, mask)
    shapes = {
        "stride2_all_grads": (3, 8, 16, (16, 16), 1, [2, 2], [0, 0], 1, [True, True, True]),
        "stride2_weight_only": (5, 4, 16, (16, 16), 1, [2, 2], [0, 0], 1, [False, True, False]),
        "stride3_1d": (3, 3, 6, (17,), 1, [3], [0], 1, [True, True, False]),
        "stride_2x1": (3, 8, 16, (9, 10), 1, [2, 1], [0, 0], 1, [True, True, False]),
        "grouped_8_per_group": (3, 32, 16, (8, 8), 1, [2, 2], [0, 0], 4, [True, True, False]),
        "odd_size": (3, 8, 16, (15, 13), 1, [2, 2], [0, 0], 1, [True, True, True]),
        "wide_input": (3, 32, 16, (16, 16), 1, [2, 2], [0, 0], 1, [True, True, False]),
        "unit_stride": (3, 8, 16, (16, 16), 1, [1, 1], [0, 0], 1, [True, True, False]),
        "kernel3": (3, 8, 16, (16, 16), 3, [2, 2], [1, 1], 1, [True, True, False]),
        "padded": (3, 8, 16, (16, 16), 1, [2, 2], [1, 1], 1, [True, True, False]),
        "input_grad_only": (3, 8, 16, (16, 16), 1, [2, 2], [0, 0], 1, [True, False, False]),
    }
    n, cin, cout, size, k, stride, padding, groups, mask = shapes[case]
    torch.manual_seed(0)
    x = torch.randn(n, cin, *size)
    w = torch.randn(cout, cin // groups, *([k] * len(size)))
    out = aten.convolution(x, w, None, stride, padding, [1] * len(size), False, [0] * len(size), groups)
    go = torch.randn(out.shape)
    fn = _backward(stride, padding, mask, groups)
    gm = trace(fn, go, x, w)
    records = run_passes(gm, ("strided_1x1_grads", "dce"), PassContext())
    assert records[0].changes == changed
    assert count(gm, aten.convolution_backward.default) == calls
    # contiguous (NCHW) inputs: the eager reference takes oneDNN's safe path
    expected = [t for t in fn(go, x, w) if t is not None]
    got = [t for t in gm(go, x, w) if t is not None]
    assert_same(got, expected, exact=False, atol=1e-4, rtol=1e-4)


class Downsample(nn.Module):
    """A ResNet stage entry with few channels: 3x3 stride-2 conv-bn-relu beside a 1x1 stride-2
    projection of 8 channels, the shape that crashed a channels-last CPU training step at odd
    batch sizes."""

    def __init__(self, cin: int = 8, cout: int = 16):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, cin, 3, padding=1, bias=False), nn.BatchNorm2d(cin), nn.ReLU())
        self.main = nn.Sequential(nn.Conv2d(cin, cout, 3, stride=2, padding=1, bias=False), nn.BatchNorm2d(cout))
        self.project = nn.Sequential(nn.Conv2d(cin, cout, 1, stride=2, bias=False), nn.BatchNorm2d(cout))
        self.head = nn.Linear(cout, 4)

    def forward(self, x):
        y = self.stem(x)
        y = torch.relu(self.main(y) + self.project(y))
        return self.head(y.mean((2, 3)))


@pytest.mark.parametrize("batch", [3, 5])
def test_training_step_at_odd_batch(batch):
    """End to end on the CPU: torchfuse lays the step out channels-last, and the projection's
    weight gradient goes through the rewrite; gradients equal eager's (NCHW) ones."""
    torch.manual_seed(0)
    model = Downsample()
    ref = copy.deepcopy(model)
    x = torch.randn(batch, 3, 16, 16)
    compiled = torch.compile(model, backend="torchfuse")
    compiled(x).square().mean().backward()
    ref(x).square().mean().backward()
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, atol=1e-4, rtol=1e-4, msg=name)
