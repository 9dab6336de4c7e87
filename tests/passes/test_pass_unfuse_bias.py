"""unfuse_addmm / unfuse_conv_bias: an addmm or a convolution whose uses are all pointwise
becomes mm / a bias-free convolution + bias (the bias add then fuses into the consumer kernel);
others keep their bias."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from _passes_helpers import assert_same, count, trace
from torchfuse.passes import PassContext, run_passes

aten = torch.ops.aten
CPU = PassContext(cublas_devices=("cpu",))


def _run(gm, ctx=CPU) -> int:
    return run_passes(gm, ("unfuse_addmm", "dce"), ctx)[0].changes


@pytest.mark.parametrize("case,changed", [
    ("gelu", 1), ("residual_through_view", 1), ("beta_alpha", 1), ("beta_zero_nan_bias", 1),
    ("gates_through_chunk", 1), ("into_softmax", 1), ("relu_and_sum", 1), ("output", 0), ("into_mm", 0),
    ("chunk_into_mm", 0), ("mixed_uses", 0)])
def test_unfuse_addmm(case, changed):
    a, w, b, r = torch.randn(6, 5), torch.randn(7, 5), torch.randn(7), torch.randn(2, 3, 7)
    fns = {
        "gelu": lambda a, w, b, r: F.gelu(torch.addmm(b, a, w.t())),
        "residual_through_view": lambda a, w, b, r: torch.addmm(b, a, w.t()).view(2, 3, 7) + r,
        "beta_alpha": lambda a, w, b, r: torch.addmm(b, a, w.t(), beta=0.5, alpha=-2.0).relu(),
        "beta_zero_nan_bias": lambda a, w, b, r: torch.addmm(b * float("nan"), a, w.t(), beta=0).relu(),
        "gates_through_chunk": lambda a, w, b, r: (lambda g: g[0].sigmoid() * g[2].tanh() + g[1].t().t())(
            torch.addmm(b[:6], a, w[:6].t()).chunk(3, 1)),
        "output": lambda a, w, b, r: torch.addmm(b, a, w.t()),
        "chunk_into_mm": lambda a, w, b, r: torch.addmm(b[:6], a, w[:6].t()).chunk(2, 1)[1] @ w[:3],
        "into_mm": lambda a, w, b, r: torch.addmm(b, a, w.t()) @ w,
        "into_softmax": lambda a, w, b, r: torch.softmax(torch.addmm(b, a, w.t()), -1),
        "relu_and_sum": lambda a, w, b, r: (lambda y: (y.relu(), y.sum()))(torch.addmm(b, a, w.t())),
        "mixed_uses": lambda a, w, b, r: (lambda y: (y.relu(), y @ w))(torch.addmm(b, a, w.t())),
    }
    fn = fns[case]
    gm = trace(fn, a, w, b, r)
    assert _run(gm) == changed
    assert count(gm, aten.addmm.default) == (0 if changed else len([n for n in gm.graph.nodes
                                                                    if n.target is aten.addmm.default]))
    assert_same(gm(a, w, b, r), fn(a, w, b, r), exact=False, atol=1e-5, rtol=1e-5)


def test_unfuse_addmm_only_on_cublas_devices():
    a, w, b = torch.randn(6, 5), torch.randn(7, 5), torch.randn(7)
    gm = trace(lambda a, w, b: torch.addmm(b, a, w.t()).relu(), a, w, b)
    assert _run(gm, PassContext()) == 0


def test_unfused_bias_fuses_into_the_consumer_kernel(tf):
    """End to end: mm in ATen, then bias + GELU + residual in one generated kernel."""
    x, w, b, r = tf.rand((4, 6, 16)), tf.rand((32, 16)), tf.rand((32,)), tf.rand((4, 6, 32))
    tf.check(lambda x, w, b, r: F.gelu(F.linear(x, w, b)) + r, x, w, b, r, options={"cublas_devices": ("cpu",)},
             allow_fallbacks=("aten.mm.default",), kernels=1, atol=1e-4, rtol=1e-4)


def _run_conv(gm, ctx=CPU) -> int:
    return run_passes(gm, ("unfuse_conv_bias", "dce"), ctx)[0].changes


@pytest.mark.parametrize("case,changed", [
    ("conv2d_relu", 1), ("conv1d_residual", 1), ("conv3d_sigmoid", 1), ("transposed_relu", 1),
    ("channels_last_relu", 1), ("permuted_layer_norm", 1), ("upcast_layer_norm", 1), ("transposed_cat", 1),
    ("no_bias", 0), ("output", 0), ("into_conv", 0)])
def test_unfuse_conv_bias(case, changed):
    x2, w2, b = torch.randn(2, 3, 9, 7), torch.randn(5, 3, 3, 3), torch.randn(5)
    w_next = torch.randn(2, 5, 1, 1)
    fns = {
        "conv2d_relu": (lambda x, w, b: F.conv2d(x, w, b, padding=1).relu(), (x2, w2, b)),
        "conv1d_residual": (lambda x, w, b: F.conv1d(x, w, b, stride=2) + 1.5,
                            (torch.randn(2, 3, 11), torch.randn(5, 3, 3), b)),
        "conv3d_sigmoid": (lambda x, w, b: torch.sigmoid(F.conv3d(x, w, b)),
                           (torch.randn(1, 3, 4, 5, 6), torch.randn(5, 3, 2, 2, 2), b)),
        "transposed_relu": (lambda x, w, b: F.conv_transpose2d(x, w, b, stride=2).relu(),
                            (torch.randn(2, 5, 4, 3), torch.randn(5, 3, 3, 3), torch.randn(3))),
        "channels_last_relu": (lambda x, w, b: F.conv2d(x, w, b).relu(),
                               (x2.to(memory_format=torch.channels_last), w2.to(memory_format=torch.channels_last), b)),
        "permuted_layer_norm": (lambda x, w, b: F.layer_norm(F.conv2d(x, w, b, padding=1).permute(0, 2, 3, 1), (5,)),
                                (x2, w2, b)),
        "upcast_layer_norm": (lambda x, w, b: F.layer_norm(F.conv2d(x, w, b).permute(0, 2, 3, 1).float(), (5,)),
                              (x2.bfloat16(), w2.bfloat16(), b.bfloat16())),
        "transposed_cat": (lambda x, w, b, skip: torch.cat([skip, F.conv_transpose2d(x, w, b, stride=2)], 1),
                           (torch.randn(2, 5, 4, 3), torch.randn(5, 3, 2, 2), torch.randn(3), torch.randn(2, 4, 8, 6))),
        "no_bias": (lambda x, w, b: F.conv2d(x, w).relu() + b.view(-1, 1, 1), (x2, w2, b)),
        "output": (lambda x, w, b: F.conv2d(x, w, b), (x2, w2, b)),
        "into_conv": (lambda x, w, b, w_next: F.conv2d(F.conv2d(x, w, b), w_next), (x2, w2, b, w_next)),
    }
    fn, args = fns[case]
    gm = trace(fn, *args)
    biased = [n for n in gm.graph.nodes if n.target is aten.convolution.default and n.args[2] is not None]
    assert _run_conv(gm) == changed
    after = [n for n in gm.graph.nodes if n.target is aten.convolution.default and n.args[2] is not None]
    assert len(after) == len(biased) - changed
    out = gm(*args)
    assert out.stride() == fn(*args).stride()
    # bf16: the convolution's result is rounded before the bias is added (as Inductor's is)
    tol = 5e-2 if args[0].dtype == torch.bfloat16 else 1e-5
    assert_same(out, fn(*args), exact=False, atol=tol, rtol=tol)


def test_unfuse_conv_bias_only_on_cublas_devices():
    x, w, b = torch.randn(2, 3, 8, 8), torch.randn(4, 3, 3, 3), torch.randn(4)
    gm = trace(lambda x, w, b: F.conv2d(x, w, b).relu(), x, w, b)
    assert _run_conv(gm, PassContext()) == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_conv_bias_fuses_into_the_consumer_kernel(tf, dtype):
    """End to end: the convolution in ATen without its bias, then bias + ReLU + residual in one
    generated kernel (channels-last, as a GPU ResNet runs)."""
    cl = torch.channels_last
    x, w = tf.rand((2, 4, 9, 7), dtype=dtype).to(memory_format=cl), tf.rand((6, 4, 3, 3), dtype=dtype).to(memory_format=cl)
    b, r = tf.rand((6,), dtype=dtype), tf.rand((2, 6, 9, 7), dtype=dtype).to(memory_format=cl)
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    tf.check(lambda x, w, b, r: (F.conv2d(x, w, b, padding=1) + r).relu(), x, w, b, r,
             options={"cublas_devices": ("cpu",)}, allow_fallbacks=("aten.convolution.default",), kernels=1,
             atol=tol, rtol=tol)


def test_conv_bias_fuses_into_a_layer_norm(tf):
    """ConvNeXt's block: a depthwise convolution with a bias, permuted to channels-last and
    layer-normalized. The bias add goes into the normalization's kernel (ATen would add it in a
    kernel of its own on CUDA); one kernel after the convolution."""
    x, w, b = tf.rand((2, 8, 9, 7)), tf.rand((8, 1, 7, 7)), tf.rand((8,))
    g, beta = tf.rand((8,)), tf.rand((8,))
    tf.check(lambda x, w, b, g, beta: F.layer_norm(F.conv2d(x, w, b, padding=3, groups=8).permute(0, 2, 3, 1), (8,), g, beta),
             x, w, b, g, beta, options={"cublas_devices": ("cpu",)}, allow_fallbacks=("aten.convolution.default",),
             kernels=1, atol=1e-4, rtol=1e-4)
