"""Padding unaligned matrix products (pad_mm): values unchanged, shapes kept, small ones left alone.

The pass only acts on CUDA by default; here it is pointed at CPU tensors through the pass
context, so the rewritten graph can be run and compared with eager.
"""
from __future__ import annotations

import pytest
import torch

from _passes_helpers import assert_same, count, trace
from torchfuse.passes import PassContext, run_passes

aten = torch.ops.aten
CPU = PassContext(cublas_devices=("cpu",), fp32_matmul_tf32=True)


def _pad(gm) -> int:
    return sum(r.changes for r in run_passes(gm, ("pad_mm", "dce"), CPU))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", ["mm_t", "addmm", "addmm_2d_bias", "bmm", "k_only", "beta_alpha"])
def test_pad_mm_values_and_shapes(case, dtype):
    m, k, n = 301, 255, 1021       # K and N unaligned for every dtype; M is never padded
    a = torch.randn(m, k, dtype=dtype)
    w = torch.randn(n, k, dtype=dtype)
    bias = torch.randn(n, dtype=dtype)
    fns = {
        "mm_t": (lambda a, w, b: a @ w.t(), 1),
        "addmm": (lambda a, w, b: torch.addmm(b, a, w.t()), 1),
        "addmm_2d_bias": (lambda a, w, b: torch.addmm(b.expand(m, n) * 2, a, w.t()), 1),
        "bmm": (lambda a, w, b: torch.bmm(a.expand(3, m, k), w.t().expand(3, k, n)), 1),
        "k_only": (lambda a, w, b: a @ w[:256].t(), 1),   # N=256 aligned, K=255 not
        "beta_alpha": (lambda a, w, b: torch.addmm(b, a, w.t(), beta=0.5, alpha=2.0), 1),
    }
    fn, expected = fns[case]
    gm = trace(fn, a, w, bias)
    assert _pad(gm) == expected
    assert count(gm, aten.constant_pad_nd.default) >= 1
    out, ref = gm(a, w, bias), fn(a, w, bias)
    assert out.shape == ref.shape
    tol = {"atol": 1e-3, "rtol": 1e-3} if dtype == torch.float32 else {"atol": 0.2, "rtol": 2e-2}
    assert_same(out, ref, exact=False, **tol)


def test_pad_mm_leaves_aligned_small_and_other_devices_alone():
    a, w = torch.randn(64, 256), torch.randn(512, 256)
    gm = trace(lambda a, w: a @ w.t(), a, w)
    assert _pad(gm) == 0                                        # aligned
    a, w = torch.randn(5, 7), torch.randn(9, 7)
    gm = trace(lambda a, w: a @ w.t(), a, w)
    assert _pad(gm) == 0                                        # too small to pay for the copies
    a, w = torch.randn(67, 255), torch.randn(1021, 255)
    gm = trace(lambda a, w: a @ w.t(), a, w)
    assert sum(r.changes for r in run_passes(gm, ("pad_mm",), PassContext())) == 0   # CUDA only by default


@pytest.fixture
def tf32_matmuls():
    """fp32 products allowed on TF32 tensor cores while the test compiles (pad_mm pads them then)."""
    matmul = torch.backends.cuda.matmul
    before, matmul.fp32_precision = matmul.fp32_precision, "tf32"
    yield
    matmul.fp32_precision = before


def test_pad_mm_leaves_fp32_alone_without_tf32():
    """fp32 products without TF32 run on CUDA cores, as fast unaligned: no copies; bf16 still padded."""
    no_tf32 = PassContext(cublas_devices=("cpu",), fp32_matmul_tf32=False)
    for dtype, expected in ((torch.float32, 0), (torch.bfloat16, 1)):
        a, w = torch.randn(301, 255, dtype=dtype), torch.randn(1021, 255, dtype=dtype)
        gm = trace(lambda a, w: a @ w.t(), a, w)
        assert sum(r.changes for r in run_passes(gm, ("pad_mm",), no_tf32)) == expected, dtype
        tol = {"atol": 1e-3, "rtol": 1e-3} if dtype == torch.float32 else {"atol": 0.2, "rtol": 2e-2}
        assert_same(gm(a, w), a @ w.t(), exact=False, **tol)


def test_pad_mm_end_to_end_through_torchfuse(tf, tf32_matmuls):
    """Through the whole pipeline (the pad is a generated kernel, the product a strided view; the
    bias then moves through the slice into the ReLU's kernel: unfuse_addmm)."""
    a, w, b = tf.rand((67, 255)), tf.rand((1021, 255)), tf.rand((1021,))
    e = tf.check(lambda a, w, b: (torch.addmm(b, a, w.t()).relu(),), a, w, b, options={"cublas_devices": ("cpu",)},
                 allow_fallbacks=("aten.addmm.default", "aten.mm.default"), atol=1e-3, rtol=1e-3)
    assert any("pad_mm" in p and "(1 changes)" in p for p in e.passes), e.passes


def test_pad_mm_keeps_a_transposed_weight_transposed():
    """w.t() is padded as w (contiguous rows, no transposing copy) and handed to mm transposed."""
    a, w = torch.randn(301, 255), torch.randn(1021, 255)
    gm = trace(lambda a, w: a @ w.t(), a, w)
    assert _pad(gm) == 1
    mm = next(n for n in gm.graph.nodes if n.target is aten.mm.default)
    b = mm.args[1].meta["val"]
    assert tuple(b.shape) == (256, 1024) and b.stride() == (1, 256)
    assert_same(gm(a, w), a @ w.t(), exact=False, atol=1e-3, rtol=1e-3)


@pytest.mark.parametrize("case", ["linear_3d", "merge_sliced_dim", "layer_norm_then_linear"])
def test_pad_mm_views_of_the_padded_product(tf, case, tf32_matmuls):
    """The product is a column slice of a wider buffer after padding: views downstream must take
    that layout (F.linear on 3-D input views the product back to 3-D), or read a contiguous copy
    when they cannot (a view merging the sliced dim)."""
    x, w = tf.rand((2, 64, 96)), tf.rand((4099, 96))
    fns = {
        "linear_3d": lambda x, w: torch.nn.functional.linear(x, w),
        "merge_sliced_dim": lambda x, w: (x.view(128, 96) @ w.t()).view(-1) * 2,
        "layer_norm_then_linear": lambda x, w: torch.nn.functional.linear(torch.nn.functional.layer_norm(x, (96,)), w),
    }
    e = tf.check(fns[case], x, w, options={"cublas_devices": ("cpu",)}, allow_fallbacks=("aten.mm.default",),
                 min_kernels=1, atol=1e-3, rtol=1e-3)
    assert any("pad_mm" in p and "(0 changes)" not in p for p in e.passes), e.passes
