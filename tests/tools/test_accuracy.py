"""torchfuse.tools.accuracy: the judge of compiled results against a higher-precision reference."""
from __future__ import annotations

import math

import pytest
import torch

import torchfuse
from torchfuse.tools.accuracy import judge, judge_all, reference_dtype, rmse, to_reference


def _randn(*shape: int, seed: int = 0, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(dtype)


def _layer_norm_bf16(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor, round_each_step: bool) -> torch.Tensor:
    """A bf16 layer norm computed in fp32 (as eager does) or with every intermediate rounded to bf16."""
    if not round_each_step:
        return torch.nn.functional.layer_norm(x, x.shape[-1:], w, b)
    r = lambda t: t.to(torch.bfloat16).float()  # noqa: E731
    xf = x.float()
    mean = r(xf.mean(-1, keepdim=True))
    centered = r(xf - mean)
    var = r(r(centered * centered).mean(-1, keepdim=True))
    return (r(centered * r(torch.rsqrt(var + 1e-5))) * w.float() + b.float()).to(torch.bfloat16)


def test_extra_rounding_in_bf16_fails_and_eager_order_passes() -> None:
    x, w, b = _randn(67, 301, dtype=torch.bfloat16) * 3 + 1, _randn(301, seed=1, dtype=torch.bfloat16), \
        _randn(301, seed=2, dtype=torch.bfloat16)
    ref = torch.nn.functional.layer_norm(*to_reference((x, x.shape[-1:], w, b), reference_dtype(x.dtype)))
    assert ref.dtype == torch.float32
    eager = _layer_norm_bf16(x, w, b, round_each_step=False)
    assert judge(eager.clone(), eager, ref).ok
    bad = _layer_norm_bf16(x, w, b, round_each_step=True)
    v = judge(bad, eager, ref)
    assert not v.ok and v.error > 1.5 * v.eager_error, str(v)


def test_fp32_sum_in_another_order_passes_and_a_small_bias_fails() -> None:
    x = _randn(4096, 257)
    ref, eager = x.double().sum(0), x.sum(0)
    reordered = x.view(64, 64, 257).sum(1).sum(0)   # a split reduction: rounds differently, not more
    assert judge(reordered, eager, ref).ok
    # an error 8x eager's (what storing partial sums in lower precision gives): fails
    off = eager + 8 * (eager.double() - ref).pow(2).mean().sqrt().float() * torch.sign(_randn(257, seed=3))
    v = judge(off, eager, ref)
    assert not v.ok and "the bound" in v.reason


def test_exact_op_uses_the_floor() -> None:
    x = _randn(33, 17)
    ref, eager = x.double().relu(), x.relu()   # eager is exact: the bound is the floor alone
    assert judge(eager.clone(), eager, ref).ok
    assert judge(torch.nextafter(eager, torch.full_like(eager, math.inf)), eager, ref).ok   # one ulp: within it
    assert not judge(eager * 1.001, eager, ref).ok


def test_non_finite_shape_and_integer_mismatches_fail() -> None:
    x = _randn(5, 7)
    ref, eager = x.double().exp(), x.exp()
    nan = eager.clone()
    nan[2, 3] = float("nan")
    assert "non-finite" in judge(nan, eager, ref).reason
    assert not judge(eager[:4], eager, ref).ok
    idx = x.argmax(1)
    assert judge(idx.clone(), idx, idx).ok
    other = idx.clone()
    other[0] += 1
    v = judge(other, idx, idx)
    assert not v.ok and "1 of 5" in v.reason


def test_cosine_catches_a_wrong_low_precision_output() -> None:
    # eager 20% off the reference by scale alone (its direction exact); a compiled result within
    # 1.5x of eager's RMSE that turns the output instead: the angle (1 - cosine) catches it
    ref = _randn(4000, seed=4)
    eager = (1.2 * ref).bfloat16()
    wrong = (ref + 0.25 * _randn(4000, seed=6)).bfloat16()
    v = judge(wrong, eager, ref)
    assert v.error <= v.bound and not v.ok and "cosine" in v.reason, str(v)
    # an ill-conditioned output: eager turned as far, the compiled one 1.4x as far in RMSE passes
    noisy = (ref + 0.2 * _randn(4000, seed=5)).bfloat16()
    assert judge((ref + 0.28 * _randn(4000, seed=6)).bfloat16(), noisy, ref).ok


def test_judge_all_shared_scale_for_vanishing_gradients() -> None:
    big = _randn(64, 64)
    ref_big = big.double()
    # a gradient that is zero in exact arithmetic: eager and compiled both carry rounding noise
    ref_zero = torch.zeros(64, dtype=torch.float64)
    eager_zero, ours_zero = 1e-8 * _randn(64, seed=7), 3e-8 * _randn(64, seed=8)
    grads = [big.clone(), ours_zero]
    eager = [big, eager_zero]
    assert not judge_all(grads, eager, [ref_big, ref_zero]).ok
    v = judge_all(grads, eager, [ref_big, ref_zero], ["w", "b"], shared_scale=True)
    assert v.ok, str(v)
    assert not judge_all(grads[:1], eager, [ref_big, ref_zero]).ok   # a tensor missing


def test_rmse_ignores_positions_where_the_reference_is_not_finite() -> None:
    ref = torch.tensor([1.0, float("inf"), 3.0], dtype=torch.float64)
    assert rmse(torch.tensor([1.0, float("inf"), 3.0]), ref) == 0.0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_torchfuse_softmax_layer_norm_chain_within_eagers_error(dtype: torch.dtype) -> None:
    """The judge on a compiled chain: a bf16 row rounds where eager rounds, no more."""
    def f(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        h = torch.nn.functional.layer_norm(x, x.shape[-1:], w)
        return torch.softmax(h * 3, dim=-1) @ h.transpose(0, 1)

    x, w = _randn(37, 203, dtype=dtype), _randn(203, seed=1, dtype=dtype)
    ref = f(*to_reference((x, w), reference_dtype(dtype)))
    torch._dynamo.reset()
    before = torchfuse.counters["kernels_generated"]
    out = torch.compile(f, backend="torchfuse", options={"strict": True})(x, w)
    assert torchfuse.counters["kernels_generated"] > before
    v = judge(out, f(x, w), ref)
    assert v.ok, str(v)
