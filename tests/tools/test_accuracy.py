"""torchfuse.tools.accuracy: the judge of compiled results against a higher-precision reference."""
from __future__ import annotations

import copy
import math

import pytest
import torch

import torchfuse
from torchfuse.tools.accuracy import judge, judge_all, nudge, reference_dtype, rmse, to_reference


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


def test_nudged_error_allows_its_angle_to_a_low_precision_output() -> None:
    """An output eager turns little but eager on nudged data turns far (a random MobileViT-v2's
    bf16 logits): the compiled output's angle is judged against the nudged one too, as its
    RMSE is; a turn beyond both still fails."""
    ref = _randn(4000, seed=4)
    eager = (ref + 0.1 * _randn(4000, seed=5)).bfloat16()
    turned = (ref + 0.16 * _randn(4000, seed=6)).bfloat16()       # cosine 0.987, 2.5x eager's angle
    v = judge(turned, eager, ref)
    assert not v.ok and "cosine" in v.reason, str(v)
    nudged = 3 * rmse(eager, ref)
    v = judge(turned, eager, ref, nudged_error=nudged)
    assert v.ok, str(v)
    assert not judge((ref + 0.8 * _randn(4000, seed=6)).bfloat16(), eager, ref, nudged_error=nudged).ok


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


def test_nudged_error_raises_the_bound_with_the_same_floors() -> None:
    ref = _randn(300, seed=9).double()
    eager = (ref + 1e-6 * _randn(300, seed=10)).float()
    ours = (ref + 2.5e-6 * _randn(300, seed=11)).float()
    assert not judge(ours, eager, ref).ok
    assert not judge(ours, eager, ref, nudged_error=0.5 * rmse(eager, ref)).ok   # below eager's: no change
    v = judge(ours, eager, ref, nudged_error=2 * rmse(eager, ref))
    assert v.ok and v.bound > 2.9 * v.eager_error, str(v)
    assert not judge(ours * 1.01, eager, ref, nudged_error=2 * rmse(eager, ref)).ok
    # judge_all passes them on per tensor, and keeps the shared floor of a vanishing gradient
    big = _randn(64, 64)
    zero_ref, eager_zero, ours_zero = torch.zeros(64, dtype=torch.float64), 1e-8 * _randn(64, seed=7), \
        3e-8 * _randn(64, seed=8)
    grads, eagers, refs = [ours, big.clone(), ours_zero], [eager, big, eager_zero], [ref, big.double(), zero_ref]
    assert not judge_all(grads, eagers, refs, shared_scale=True, nudged_errors=[0.0] * 3).ok
    v = judge_all(grads, eagers, refs, shared_scale=True, nudged_errors=[2 * rmse(eager, ref), 0.0, 0.0])
    assert v.ok, str(v)


class _RMSNorm(torch.nn.Module):
    """T5's layer norm (variance in fp32, no mean, no bias); `defect` computes it wrongly."""

    def __init__(self, dim: int, defect: str = "") -> None:
        super().__init__()
        self.weight, self.defect = torch.nn.Parameter(torch.rand(dim) + 0.5), defect

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        variance = h.to(torch.float32).pow(2).mean(-1, keepdim=True)
        y = h * torch.rsqrt(variance + (1e-5 if self.defect == "epsilon" else 1e-6))
        if self.defect == "bf16":
            y = y.bfloat16().to(h.dtype)
        return self.weight * y


class _TokenNet(torch.nn.Module):
    """Token ids in (no floating-point input), T5-like blocks: RMS norm, ReLU feed-forward."""

    def __init__(self, vocab: int = 97, dim: int = 48, ffn: int = 130, layers: int = 3) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(vocab, dim)
        self.norms = torch.nn.ModuleList(_RMSNorm(dim) for _ in range(layers + 1))
        self.wi = torch.nn.ModuleList(torch.nn.Linear(dim, ffn, bias=False) for _ in range(layers))
        self.wo = torch.nn.ModuleList(torch.nn.Linear(ffn, dim, bias=False) for _ in range(layers))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.emb(ids)
        for norm, wi, wo in zip(self.norms, self.wi, self.wo):
            h = h + wo(torch.relu(wi(norm(h))))
        return self.norms[-1](h)


def _grads(model: torch.nn.Module, ids: torch.Tensor) -> list[torch.Tensor]:
    model = copy.deepcopy(model)
    out = model(ids).flatten(0, -2)
    torch.nn.functional.cross_entropy(out, torch.arange(out.shape[0]) * 7 % out.shape[1]).backward()
    return [p.grad for p in model.parameters()]


def _token_net() -> tuple[torch.nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    return _TokenNet(), torch.randint(0, 97, (3, 29), generator=torch.Generator().manual_seed(1))


def test_nudge_moves_the_weights_of_a_token_model() -> None:
    """Token ids are not floating-point: moving the inputs alone repeated eager's own error
    exactly, and the judge's second chance (zoo.py) estimated nothing.  The weights move by
    rounding, the original stays, integer and floating inputs are treated apart."""
    model, ids = _token_net()
    before = [p.detach().clone() for p in model.parameters()]
    x = _randn(5, 7, seed=12)
    moved, (ids2, x2) = nudge(model, (ids, x), torch.Generator().manual_seed(3), 1e-6)
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))
    assert torch.equal(ids2, ids) and not torch.equal(x2, x)
    assert ((x2.double() - x.double()).abs() <= 8e-6 * x.double().abs()).all()
    for p, b in zip(moved.parameters(), before):
        change = (p.detach().double() - b.double()).abs()
        assert (change <= 8 * torch.finfo(torch.float32).eps * b.double().abs()).all()   # a few ulps at most
        assert (change > 0).float().mean() > 0.2                                           # many moved
    ref = _grads(copy.deepcopy(model).double(), ids)
    eager, nudged = _grads(model, ids), _grads(moved, ids)
    assert all(rmse(n, r) != rmse(e, r) for n, e, r in zip(nudged, eager, ref))


@pytest.mark.parametrize("defect", ["bf16", "epsilon"])
def test_nudged_judge_still_fails_an_injected_defect(defect: str) -> None:
    """With eager's error on nudged weights as the estimate of what this precision must give,
    another valid fp32 evaluation passes, and an RMS norm rounded to bf16 or with a wrong epsilon
    still fails."""
    model, ids = _token_net()
    ref, eager = _grads(copy.deepcopy(model).double(), ids), _grads(model, ids)
    g = torch.Generator().manual_seed(7)
    nudged = [0.0] * len(ref)
    for _ in range(4):
        run = _grads(nudge(model, (ids,), g, 1e-6)[0], ids)
        nudged = [max(w, rmse(t, r)) for w, t, r in zip(nudged, run, ref)]
    valid = _grads(nudge(model, (ids,), torch.Generator().manual_seed(99), 1e-6)[0], ids)
    assert judge_all(valid, eager, ref, shared_scale=True, nudged_errors=nudged).ok
    bad_model = copy.deepcopy(model)
    for m in bad_model.modules():
        if isinstance(m, _RMSNorm):
            m.defect = defect
    bad = _grads(bad_model, ids)
    v = judge_all(bad, eager, ref, shared_scale=True, nudged_errors=nudged)
    assert not v.ok and v.ratio > 3, str(v)


class _Dropouts(torch.nn.Module):
    """Dropout as CPU eager runs it (bernoulli_), as CUDA eager runs it (native_dropout, called
    directly here), and stochastic depth's per-sample bernoulli_."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = torch.nn.Linear(23, 31), torch.nn.Linear(31, 7)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.nn.functional.dropout(self.a(x), 0.3, training=True)
        h = torch.ops.aten.native_dropout(h, 0.4, True)[0]
        keep = h.new_empty(h.shape[0], 1).bernoulli_(0.5)
        return self.b(h * keep)


def test_random_draws_give_the_reference_eagers_masks() -> None:
    """The fp64 reference replays the fp32 run's draws whatever its generator holds: its result
    is eager's within rounding; drawing its own masks, it is another function altogether."""
    from torchfuse.tools.accuracy import RandomDraws
    torch.manual_seed(0)
    model, x = _Dropouts(), _randn(11, 23, seed=4)
    with RandomDraws() as drawn:
        eager = model(x)
    assert len(drawn.draws) == 3
    ref_model = copy.deepcopy(model).double()
    torch.manual_seed(1)
    with RandomDraws(drawn.draws):
        ref = ref_model(x.double())
    torch.manual_seed(1)
    unreplayed = ref_model(x.double())
    assert rmse(eager, ref) < 1e-6 * ref.abs().max().item(), rmse(eager, ref)
    assert rmse(eager, unreplayed) > 1e-2 * ref.abs().max().item()
    with pytest.raises(RuntimeError, match="more random ops"):
        with RandomDraws(drawn.draws[:2]):
            ref_model(x.double())


def test_random_draws_leave_seeded_but_deterministic_ops_alone() -> None:
    """Attention and LSTM carry the nondeterministic_seeded tag (their dropout argument): with no
    dropout they are plain arithmetic, and the reference keeps its own fp64 results."""
    from torchfuse.tools.accuracy import RandomDraws
    torch.manual_seed(0)
    lstm, q = torch.nn.LSTM(6, 9, batch_first=True), _randn(2, 3, 5, 8, seed=5)
    x = _randn(2, 5, 6, seed=6)
    with RandomDraws() as drawn:
        lstm(x)
        torch.nn.functional.scaled_dot_product_attention(q, q, q)
    assert drawn.draws == []
    lstm64 = copy.deepcopy(lstm).double()
    with RandomDraws(drawn.draws):
        out = lstm64(x.double())[0]
        att = torch.nn.functional.scaled_dot_product_attention(q.double(), q.double(), q.double())
    assert torch.equal(out, lstm64(x.double())[0]) and att.dtype == torch.float64
