"""Pooling windows and upsampling gathers (src/torchfuse/lowering/pool.py, lower_views.py) against
eager: each fuses with the pointwise op around it into one kernel, in NCHW and channels-last,
with padding, ceil_mode, dilation, count_include_pad and divisor_override, and the max-pool
indices feed ATen's backward exactly as eager's do, and a training step saves int8 window offsets
whose backward is one gather kernel.

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
                                       "aten.avg_pool2d_backward.default"})
    fwd = [k for k in e.kernels if k.graph.endswith("_forward")]
    # (the pooling's input is not saved for the backward, so the pool fuses with the batch norm
    # and ReLU that feed it)
    assert any("max_pool" in " ".join(k.nodes) or "max_pool" in k.name for k in fwd), e


MAX_POOLS = {      # kernel, stride, padding, dilation, ceil_mode
    "3x3_s2_p1": ((3, 3), (2, 2), (1, 1), (1, 1), False),
    "2x2": ((2, 2), (2, 2), (0, 0), (1, 1), False),
    "3x3_s1_overlapping": ((3, 3), (1, 1), (1, 1), (1, 1), False),
    "3x3_s2_ceil": ((3, 3), (2, 2), (1, 1), (1, 1), True),
    "rect": ((2, 3), (1, 2), (1, 0), (1, 1), False),
    "stride_above_kernel": ((2, 2), (3, 3), (0, 0), (1, 1), True),
}


@pytest.mark.parametrize("name", sorted(MAX_POOLS))
@pytest.mark.parametrize("channels_last", [False, True])
def test_max_pool_training_saves_int8_offsets(tf, name, channels_last):
    """A training step saves each pooled element's position in its window (int8) for the
    backward, not ATen's int64 index, and the backward is one gather kernel (the offsets turned
    back into indices, the pool's gradient, ReLU's and the scale fused) with eager's gradients."""
    k, s, p, d, ceil = MAX_POOLS[name]
    x = tf.rand((2, 3, 11, 10), low=-1, high=1)
    if channels_last:
        x = x.to(memory_format=torch.channels_last)
    x.requires_grad_()

    def fn(x):
        return F.max_pool2d(torch.relu(x * 2), k, s, p, d, ceil) * 3

    e = tf.check_grad(fn, x, options=TRITON)
    forward = next(g for g in e.graphs if "_forward: after passes" in g)
    assert "_low_memory_max_pool_with_offsets" in forward, forward
    assert "i8[" in forward and "i64[" not in forward, forward
    assert [k.graph.endswith("_backward") for k in e.kernels].count(True) == 1, e


def test_max_pool_training_dynamic_sizes(tf):
    """Offsets back to indices with a symbolic image width: one compile serves new sizes."""
    import torchfuse
    fn = torchfuse.compile(lambda x: F.max_pool2d(torch.relu(x), 3, 2, 1) * 2, dynamic=True, options=TRITON)
    for shape in ((2, 3, 9, 11), (1, 3, 13, 8), (3, 3, 6, 7)):
        x = tf.rand(shape, low=-1, high=1).requires_grad_()
        x_ref = x.detach().clone().requires_grad_()
        g = torch.randn(fn(x).shape)
        fn(x).backward(g)
        (F.max_pool2d(torch.relu(x_ref), 3, 2, 1) * 2).backward(g)
        torch.testing.assert_close(x.grad, x_ref.grad)


def test_max_pool_backward_with_ties_and_nan(tf):
    """Many equal values (the first position of a window wins in eager) and a NaN (wins every
    window it is in): the gradient goes exactly where eager's goes."""
    x = torch.randint(0, 3, (2, 4, 9, 9)).float()
    x[0, 1, 4, 4] = NAN
    x = x.to(memory_format=torch.channels_last).requires_grad_()
    for k, s, p in ((3, 2, 1), (3, 1, 1), (2, 1, 0)):
        tf.check_grad(lambda x: F.max_pool2d(x + 1, k, s, p), x, options=TRITON)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_max_pool_training_low_precision(tf, dtype):
    """A fused producer computes in float32; the window compares its values rounded to the
    tensor's dtype, as eager does, so ties (frequent in low precision) pick eager's position."""
    x = tf.rand((2, 4, 10, 9), dtype, low=-1, high=1).to(memory_format=torch.channels_last).requires_grad_()
    tf.check_grad(lambda x: F.max_pool2d(torch.relu(x * 2), 3, 2, 1), x, options=TRITON)
    if dtype == torch.float16:   # (Triton's interpreter rounds float32 to bfloat16 unlike ATen)
        # near 1.5 the products x * 3 are 0.75 ulp of float16 apart: distinct in float32, many
        # equal once rounded
        x = (1.5 + torch.randint(0, 16, (2, 4, 10, 9)) / 1024).to(dtype).requires_grad_()
        tf.check_grad(lambda x: F.max_pool2d(x * 3, 3, 2, 1), x, options=TRITON)
    tf.check_grad(lambda x: F.max_pool2d(x, 3, 1, 1) * 2, x, options=TRITON)


def test_max_pool_dilated_backward_runs_through_aten(tf):
    """A dilated window saves offsets too; its backward is ATen's, fed indices rebuilt from them."""
    x = tf.rand((2, 3, 12, 11)).requires_grad_()
    e = tf.check_grad(lambda x: F.max_pool2d(x * 2, 3, 1, 1, dilation=2), x, options=TRITON,
                      allow_fallbacks={"aten.max_pool2d_with_indices_backward.default"})
    assert [f.op for f in e.fallbacks] == ["aten.max_pool2d_with_indices_backward.default"]


def test_cpp_backend_saves_atens_indices(tf):
    """The C++ backend leaves pooling to ATen, forward and backward: no low-memory form there."""
    x = tf.rand((2, 3, 9, 9)).requires_grad_()
    e = tf.check_grad(lambda x: F.max_pool2d(x * 2, 3, 2, 1) + 1, x,
                      allow_fallbacks={"aten.max_pool2d_with_indices.default",
                                       "aten.max_pool2d_with_indices_backward.default"})
    assert not any("_low_memory" in g for g in e.graphs)


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
