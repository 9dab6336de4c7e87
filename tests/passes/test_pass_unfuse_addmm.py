"""unfuse_addmm: addmm whose uses are all pointwise becomes mm + bias (the bias add then fuses
into the consumer kernel); other addmms keep their bias epilogue."""
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
    ("output", 0), ("into_mm", 0), ("mixed_uses", 0)])
def test_unfuse_addmm(case, changed):
    a, w, b, r = torch.randn(6, 5), torch.randn(7, 5), torch.randn(7), torch.randn(2, 3, 7)
    fns = {
        "gelu": lambda a, w, b, r: F.gelu(torch.addmm(b, a, w.t())),
        "residual_through_view": lambda a, w, b, r: torch.addmm(b, a, w.t()).view(2, 3, 7) + r,
        "beta_alpha": lambda a, w, b, r: torch.addmm(b, a, w.t(), beta=0.5, alpha=-2.0).relu(),
        "beta_zero_nan_bias": lambda a, w, b, r: torch.addmm(b * float("nan"), a, w.t(), beta=0).relu(),
        "output": lambda a, w, b, r: torch.addmm(b, a, w.t()),
        "into_mm": lambda a, w, b, r: torch.addmm(b, a, w.t()) @ w,
        "mixed_uses": lambda a, w, b, r: (lambda y: (y.relu(), y.sum()))(torch.addmm(b, a, w.t())),
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
