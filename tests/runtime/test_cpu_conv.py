"""runtime/cpu_conv.py: a channels-last CPU graph's dense k x k fp32 convolutions run on a weight
reordered for oneDNN once and kept, keyed by the weight tensor and its version counter; NCHW
graphs, 1 x 1 and depthwise convolutions, and weights changed in place run as before."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from torchfuse.runtime import cpu_conv

pytestmark = pytest.mark.skipif(not cpu_conv._AVAILABLE, reason="this torch build has no oneDNN")

FALLBACKS = {"aten.convolution.default", "aten.max_pool2d_with_indices.default"}


def _net() -> nn.Module:
    """Two dense 3 x 3 convolutions with weights of MIN_WEIGHT elements or more (a strided one
    and a grouped one), a small 7 x 7 stem, a depthwise and a 1 x 1 convolution."""
    torch.manual_seed(0)
    net = nn.Sequential(
        nn.Conv2d(3, 64, 7, stride=2, padding=3), nn.BatchNorm2d(64), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(64, 128, 3, stride=2, padding=1), nn.ReLU(), nn.Conv2d(128, 128, 3, padding=1, groups=2),
        nn.Conv2d(128, 128, 3, padding=1, groups=128), nn.Conv2d(128, 8, 1)).eval()
    net[1].running_mean.normal_()
    net[1].running_var.uniform_(0.5, 2.0)
    assert 128 * 64 * 9 >= cpu_conv.MIN_WEIGHT > 64 * 3 * 49
    return net


@pytest.mark.parametrize("channels_last", ["auto", False])
def test_dense_kxk_weights_are_reordered_once(tf, channels_last):
    model, x = _net(), tf.rand((3, 3, 37, 29))
    with torch.no_grad():
        tf.check(model, x, options={"channels_last_convs": channels_last}, check_stride=True,
                 allow_fallbacks=FALLBACKS, atol=1e-4, rtol=1e-4)
        before = cpu_conv.packed_weights()
        # (kept while the compiled graph, which holds the hoisted weights, lives)
        compiled = torch.compile(model, backend="torchfuse", options={"channels_last_convs": channels_last})
        for _ in range(2):
            torch.testing.assert_close(compiled(x), model(x), atol=1e-4, rtol=1e-4)
        # channels-last: the two large dense k x k weights; NCHW: none (the op returns channels-last)
        assert cpu_conv.packed_weights() - before == (2 if channels_last == "auto" else 0)


def test_a_parameter_changed_in_place_is_seen(tf):
    model, x = _net(), tf.rand((2, 3, 33, 31))
    compiled = torch.compile(model, backend="torchfuse")
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), model(x), atol=1e-4, rtol=1e-4)
        for p in (model[0].weight, model[4].weight, model[6].bias):
            p.mul_(-1.5)
            torch.testing.assert_close(compiled(x), model(x), atol=1e-4, rtol=1e-4)


def test_a_weight_whose_version_moves_is_not_kept(tf):
    """Called directly: the first call keeps a reordered copy; after the weight changes in place
    the result follows the new values, and the weight is reordered by ATen from then on."""
    x = tf.rand((2, 6, 9, 11)).to(memory_format=torch.channels_last)
    w = tf.rand((5, 6, 3, 3)).to(memory_format=torch.channels_last)
    b = tf.rand((5,))
    args = ([2, 1], [1, 0], [1, 1], False, [0, 0], 1)
    before = cpu_conv.packed_weights()
    with torch.no_grad():
        for step in range(3):
            out = cpu_conv.convolution(x, w, b, *args)
            ref = F.conv2d(x.contiguous(), w.contiguous(), b, [2, 1], [1, 0])
            torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)
            assert out.is_contiguous(memory_format=torch.channels_last)
            assert cpu_conv.packed_weights() - before == (1 if step == 0 else 0)
            w.mul_(0.5)


def test_autograd_and_other_dtypes_go_to_aten(tf):
    x = tf.rand((2, 4, 8, 8)).to(memory_format=torch.channels_last).requires_grad_()
    w = tf.rand((4, 4, 3, 3)).requires_grad_()
    args = ([1, 1], [1, 1], [1, 1], False, [0, 0], 1)
    before = cpu_conv.packed_weights()
    out = cpu_conv.convolution(x, w, None, *args)
    out.sum().backward()
    assert x.grad is not None and w.grad is not None
    with torch.no_grad():
        out = cpu_conv.convolution(x.double(), w.double(), None, *args)
        torch.testing.assert_close(out, F.conv2d(x.double(), w.double(), None, 1, 1))
    assert cpu_conv.packed_weights() == before
