"""Pooling windows and upsampling gathers (src/torchfuse/ir/lower_pool.py, lower_views.py) against
eager: each fuses with the pointwise op around it into one kernel, in NCHW and channels-last,
with padding, ceil_mode, dilation, count_include_pad and divisor_override, and the max-pool
indices feed ATen's backward exactly as eager's do.

Pooling is the Triton backend's (the C++ backend leaves it to ATen's vectorized kernels), so
these run Triton kernels on CPU tensors under Triton's interpreter, as tests/codegen does."""
from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

NAN = float("nan")
os.environ.setdefault("TRITON_INTERPRET", "1")      # Triton kernels on CPU tensors, as in tests/codegen
pytest.importorskip("triton")
TRITON = {"cpu_backend": "triton"}

POOLS = {
    "max_3x3_s2_p1": lambda x: F.max_pool2d(torch.relu(x * 1.5), 3, 2, 1),
    "max_2x2": lambda x: F.max_pool2d(x, 2) + 1,
    "max_ceil": lambda x: F.max_pool2d(x, 3, 2, 1, ceil_mode=True) * 2,
    "max_dilated": lambda x: F.max_pool2d(x, 3, 1, 1, dilation=2) - 1,
    "max_rect": lambda x: F.max_pool2d(x, (2, 3), (1, 2), (1, 0)).exp(),
    "avg_3x3_s1_p1": lambda x: F.avg_pool2d(torch.relu(x), 3, 1, 1) + x,
    "avg_exclude_pad": lambda x: F.avg_pool2d(x, 3, 1, 1, count_include_pad=False) * 3,
    "avg_ceil": lambda x: F.avg_pool2d(x, 3, 2, 1, ceil_mode=True) + 1,
    "avg_ceil_exclude_pad": lambda x: F.avg_pool2d(x, 3, 2, 1, ceil_mode=True, count_include_pad=False) + 1,
    "avg_divisor": lambda x: F.avg_pool2d(x, 2, divisor_override=3) + 1,
    "avg_global_7x7": lambda x: F.avg_pool2d(x * 2, 7).flatten(1),
}


@pytest.mark.parametrize("name", sorted(POOLS))
@pytest.mark.parametrize("channels_last", [False, True])
def test_pool_fuses_into_one_kernel(tf, name, channels_last):
    x = tf.rand((2, 5, 13, 11) if "7x7" not in name else (2, 5, 7, 7))
    if channels_last:
        x = x.to(memory_format=torch.channels_last)
    tf.check(POOLS[name], x, kernels=1, check_stride=True, options=TRITON)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64])
def test_pool_dtypes(tf, dtype):
    x = tf.rand((3, 4, 9, 10), dtype)
    tf.check(lambda x: (F.max_pool2d(x, 3, 2, 1), F.avg_pool2d(x, 3, 1, 1)), x, kernels=2, options=TRITON)


def test_pool_3d_input_and_odd_sizes(tf):
    x = tf.rand((4, 1, 1))                        # a 1x1 image, padding larger than the image
    y = tf.rand((3, 7, 5))                        # (C, H, W): no batch dim
    tf.check(lambda x, y: (F.max_pool2d(y, 2, 1) + 1, F.avg_pool2d(y, 3, 2, 1, ceil_mode=True) + 1,
                           F.max_pool2d(x[None], 1) + 1), x, y, kernels=3, options=TRITON)


def test_max_pool_nan_and_ties_match_eager(tf):
    x = tf.rand((1, 2, 6, 6))
    x[0, 0, 1, 1] = NAN                           # a NaN wins its windows
    x[0, 1, :2, :2] = 2.0                         # a tie: the first position's index wins
    tf.check(lambda x: torch.ops.aten.max_pool2d_with_indices(x * 1, [3, 3], [2, 2], [1, 1]), x, kernels=1,
             options=TRITON)


def test_max_pool_indices_equal_eager(tf):
    x = tf.rand((2, 3, 11, 9)).to(memory_format=torch.channels_last)
    e = tf.check(lambda x: torch.ops.aten.max_pool2d_with_indices(x + 1, [3, 3], [2, 2], [1, 1], [1, 1], True),
                 x, kernels=1, check_stride=True, options=TRITON)
    assert e.output[1].dtype == torch.int64


def test_large_window_runs_through_aten(tf):
    x = tf.rand((1, 2, 10, 10))
    tf.check(lambda x: F.max_pool2d(x + 1, 9) * 2, x, kernels=2, options=TRITON,
             allow_fallbacks={"aten.max_pool2d_with_indices.default"})


def test_cpp_backend_leaves_pooling_to_aten(tf):
    """g++ does not vectorize a window's masked loads: ATen's pooling is faster on CPU."""
    x = tf.rand((1, 2, 10, 10)).to(memory_format=torch.channels_last)
    e = tf.check(lambda x: F.max_pool2d(x + 1, 3, 2, 1) * 2, x, kernels=2,
                 allow_fallbacks={"aten.max_pool2d_with_indices.default"})
    assert [f.op for f in e.fallbacks] == ["aten.max_pool2d_with_indices.default"]


def test_conv_bn_relu_pool_training_gradients(tf):
    """A CNN stem in training: the forward's pool is a kernel, the ATen backward of the max-pool
    reads the indices it wrote, and every gradient equals eager's."""
    w = tf.rand((6, 3, 3, 3), low=-0.5, high=0.5).requires_grad_()
    g = tf.rand((6,), low=0.5, high=1.5).requires_grad_()
    b = tf.rand((6,)).requires_grad_()
    x = tf.rand((2, 3, 12, 12)).to(memory_format=torch.channels_last).requires_grad_()

    def stem(x, w, g, b):
        y = F.conv2d(x, w, padding=1)
        y = F.batch_norm(y, None, None, g, b, training=True)
        return F.avg_pool2d(F.max_pool2d(torch.relu(y), 3, 2, 1), 2).sum((2, 3))

    e = tf.check_grad(stem, x, w, g, b, atol=1e-4, rtol=1e-4, options=TRITON,
                      allow_fallbacks={"aten.convolution.default", "aten.convolution_backward.default",
                                       "aten.max_pool2d_with_indices_backward.default",
                                       "aten.avg_pool2d_backward.default"})
    fwd = [k for k in e.kernels if k.graph.endswith("_forward")]
    assert any("max_pool2d" in " ".join(k.nodes) or "max_pool" in k.name for k in fwd), e


UPSAMPLE = {
    "bilinear": lambda x: F.interpolate(x, scale_factor=2, mode="bilinear", align_corners=False) + 1,
    "bilinear_aligned": lambda x: F.interpolate(x, size=(9, 7), mode="bilinear", align_corners=True) * 2,
    "nearest": lambda x: F.interpolate(x, scale_factor=2, mode="nearest") - 1,
}


@pytest.mark.parametrize("name", sorted(UPSAMPLE))
@pytest.mark.parametrize("channels_last", [False, True])
def test_upsampling_gathers_are_kernels(tf, name, channels_last):
    """`_unsafe_index` (what upsampling decomposes to) is a gather inside a kernel, not ATen's
    index kernel (a U-Net spent 6 of 16 ms of GPU time there)."""
    x = tf.rand((2, 3, 5, 6))
    if channels_last:
        x = x.to(memory_format=torch.channels_last)
    tf.check(UPSAMPLE[name], x, min_kernels=1)


def test_shared_pool_is_computed_once(tf):
    """A pooled value read by several consumers (a DenseNet transition's output, read by every
    later cat of its block) is stored once, not recomputed window and all in each consumer."""
    x = tf.rand((2, 4, 8, 8))

    def fn(x):
        p = F.avg_pool2d(x, 2)
        v, _ = F.max_pool2d(x, 2, return_indices=True)
        return torch.cat([p, x[:, :, ::2, ::2]], 1) * 2, (p + 1).exp(), v * 3, v.sin()

    e = tf.check(fn, x, min_kernels=1, options=TRITON)
    window_loads = [k.source.count("tl.load(in0 +") for k in e.kernels]
    assert sum(window_loads) <= 5, (window_loads, e)     # one 2x2 window (shared), one strided slice
