"""Accuracy as PyTorch's own benchmark harness judges it: against a reference in higher precision.

A compiled model and eager PyTorch both round; comparing the two with each other cannot tell a
compiler that rounds differently (a sum in another order) from one that rounds more (an
intermediate stored in bf16 where eager keeps fp32).  So both are compared with the same model
in higher precision (fp64 for an fp32 run, fp32 for a bf16 or fp16 run; same weights, same
inputs), and the compiled run passes when its error is at most `multiplier` (1.5) times eager's
error plus a small floor:

    rmse(compiled, reference) <= 1.5 * rmse(eager, reference) + floor * scale

`scale` is the reference's RMS (or a caller's larger one: a gradient that is zero in exact
arithmetic is judged against its share of all gradients, see `judge_all`), and the floor four
units in the last place of fp32 at that scale: it only matters where eager's own error is about
0 (an exact op).  Low-precision outputs must also point the way the reference points (cosine
similarity >= 0.99, or where eager's is lower, an angle 1 - cosine within 1.5^2 times eager's),
which catches a wrong answer that a large eager error would hide.

An ill-conditioned result (a ReLU input within rounding of zero flips between evaluations and
moves a gradient by its whole size: in T5-base's training step over 8x512 tokens, eager's
gradients lie 1e-4 to 1e-3 from the fp64 ones, most of it from a few such flips) differs as much
between two valid fp32 evaluations as from the reference.  `nudge` gives data moved by
rounding-sized noise (the weights by one unit roundoff, inputs by a caller's amount); eager's
error on it, passed as `nudged_error`, stands for eager's where larger: the bound is then 1.5x
the larger of the two.  A defect (a bf16 intermediate, a wrong epsilon) still fails by orders of
magnitude.

Inductor's `torch._dynamo.utils.same(fp64_ref=...)` is the model: it allows 2x (3x in low
precision) plus tol / 10; this is stricter, with a floor relative to the tensor's scale instead
of an absolute 1e-5.

    from torchfuse.tools.accuracy import judge_all
    verdict = judge_all(compiled_outputs, eager_outputs, reference_outputs, names)
    assert verdict.ok, verdict.reason
"""
from __future__ import annotations

import copy
import math
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
import torch.utils._pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

MULTIPLIER = 1.5
COSINE_MIN = 0.99
LOW_PRECISION = (torch.float16, torch.bfloat16)
# floor, relative to the tensor's scale: a few units in the last place of fp32 (a gradient summed
# over a handful of edges in another order than eager's, whose own error is a tenth of an ulp,
# is 1.3 ulps off in RMS: GCN's bias), far below eager's own error in any low-precision run
FLOOR = 4 * torch.finfo(torch.float32).eps
# a gradient whose RMS is below SHARE_FLOOR of the whole set's (zero in exact arithmetic: an
# attention key bias) is rounding noise in eager and compiled alike; its floor is VANISHING_ULPS
# units in the last place of fp32 at the set's RMS
SHARE_FLOOR = 1e-2
VANISHING_ULPS = 16


@dataclass
class Verdict:
    """One tensor's (or, from judge_all, the worst tensor's) judgement."""
    ok: bool
    error: float            # RMSE of the compiled result vs the reference
    eager_error: float      # RMSE of eager (same precision) vs the reference
    bound: float            # MULTIPLIER * eager_error + the floor
    cosine: float | None = None   # low precision: cosine similarity with the reference
    name: str = ""
    reason: str = ""

    @property
    def ratio(self) -> float:
        """error / bound: above 1 fails."""
        return self.error / self.bound if self.bound > 0 else (0.0 if self.error == 0 else math.inf)

    def __str__(self) -> str:
        cos = f", cosine {self.cosine:.5f}" if self.cosine is not None else ""
        where = f"{self.name}: " if self.name else ""
        return (f"{where}{'ok' if self.ok else 'FAIL'} RMSE vs reference {self.error:.3e}, eager's {self.eager_error:.3e}"
                f" (bound {self.bound:.3e}){cos}{'; ' + self.reason if self.reason else ''}")


def rmse(actual: torch.Tensor, reference: torch.Tensor) -> float:
    """Root mean square of the difference, in fp64, over the positions where the reference is finite."""
    ref = reference.detach().to(actual.device, torch.float64)
    diff = actual.detach().double() - ref
    finite = torch.isfinite(ref)
    if not bool(finite.all()):
        diff = diff[finite]
    return diff.pow(2).mean().sqrt().item() if diff.numel() else 0.0


def _rms(t: torch.Tensor) -> float:
    t = t.detach().double()
    t = t[torch.isfinite(t)]
    return t.pow(2).mean().sqrt().item() if t.numel() else 0.0


def _cosine(actual: torch.Tensor, reference: torch.Tensor) -> float:
    a, r = actual.detach().double().flatten(), reference.detach().to(actual.device, torch.float64).flatten()
    keep = torch.isfinite(a) & torch.isfinite(r)
    return torch.nn.functional.cosine_similarity(a[keep], r[keep], dim=0, eps=1e-12).item()


def judge(actual: torch.Tensor, eager: torch.Tensor, reference: torch.Tensor, *, scale: float | None = None,
          name: str = "", nudged_error: float = 0.0) -> Verdict:
    """Whether `actual` (the compiled run) is as close to `reference` (the model in higher
    precision) as eager's `eager` (same precision as `actual`) is, within MULTIPLIER.  `scale`
    sets the floor (default: the reference's RMS).  `nudged_error`: eager's error on data moved
    by rounding-sized noise (see nudge), where larger than eager's own: an ill-conditioned
    tensor's error that any evaluation in this precision may have.  Non-floating tensors must
    equal eager's."""
    if actual.shape != eager.shape:
        return Verdict(False, math.inf, 0.0, 0.0, name=name, reason=f"shape {tuple(actual.shape)}, "
                                                                      f"eager's {tuple(eager.shape)}")
    if not actual.is_floating_point() and not actual.is_complex():
        mismatched = int((actual.detach().cpu() != eager.detach().cpu()).sum())
        return Verdict(mismatched == 0, float(mismatched), 0.0, 0.0, name=name,
                       reason=f"{mismatched} of {actual.numel()} values differ from eager's" if mismatched else "")
    if actual.is_complex():
        actual, eager, reference = (torch.view_as_real(t.detach()) for t in (actual, eager, reference))
    error, eager_error = rmse(actual, reference), rmse(eager, reference)
    scale = _rms(reference) if scale is None else scale
    bound = MULTIPLIER * max(eager_error, nudged_error) + FLOOR * scale
    ok, reasons = error <= bound, []
    if not ok:
        reasons.append(f"{error / bound:.2f}x the bound" if bound > 0 else "eager is exact")
    # non-finite values where eager has finite ones: wrong whatever the RMSE says
    bad = ~torch.isfinite(actual.detach()) & torch.isfinite(eager.detach().to(actual.device))
    if bool(bad.any()):
        ok = False
        reasons.append(f"{int(bad.sum())} non-finite values where eager's are finite")
    cosine = None
    if actual.dtype in LOW_PRECISION and actual.numel() > 1:
        cosine, eager_cosine = _cosine(actual, reference), _cosine(eager, reference)
        # below 0.99 fails, unless eager's own output is as far off (an ill-conditioned output).
        # The angle grows as the square of an error across the reference (1 - cos ~ err^2 / 2),
        # so the RMSE's 1.5x allows 1.5^2 on it; what it adds to the RMSE test is an error that
        # turns the output where eager's only scales it.  Eager's error on nudged data counts
        # as the angle an error of that size across the reference makes (a random MobileViT-v2's
        # bf16 logits at 64 pixels: eager 0.990, eager on nudged weights 0.90-0.94)
        eager_angle, ref_rms = 1 - eager_cosine, _rms(reference)
        if nudged_error > eager_error and ref_rms > 0:
            eager_angle = max(eager_angle, nudged_error ** 2 / (2 * ref_rms ** 2))
        if ref_rms > 0 and cosine < COSINE_MIN and 1 - cosine > MULTIPLIER ** 2 * eager_angle:
            ok = False
            reasons.append(f"cosine similarity {cosine:.4f} < {COSINE_MIN} (eager's {eager_cosine:.4f})")
    return Verdict(ok, error, eager_error, bound, cosine, name, "; ".join(reasons))


def flatten(value: Any) -> list[torch.Tensor]:
    """The tensors of a model's output (tuples, lists, dicts, dataclass-like ModelOutputs), in order."""
    if hasattr(value, "to_tuple") and callable(value.to_tuple):   # transformers' ModelOutput
        value = value.to_tuple()
    return [t for t in pytree.tree_leaves(value) if isinstance(t, torch.Tensor)]


def judge_all(actual: Sequence[torch.Tensor] | Any, eager: Sequence[torch.Tensor] | Any,
              reference: Sequence[torch.Tensor] | Any, names: Sequence[str] | None = None,
              shared_scale: bool = False, nudged_errors: Sequence[float] | None = None) -> Verdict:
    """Every tensor judged (see judge); returns the first failing one, else the one nearest its
    bound.  With `shared_scale` (parameter gradients), a tensor far smaller than the whole set (a
    bias gradient that is zero in exact arithmetic) takes VANISHING_ULPS times the set's RMS as
    its scale: its floor then covers noise against noise, which its own scale would not.
    `nudged_errors`: per tensor, eager's error on nudged data (judge's `nudged_error`)."""
    acts, eags, refs = flatten(actual), flatten(eager), flatten(reference)
    if not len(acts) == len(eags) == len(refs):
        return Verdict(False, math.inf, 0.0, 0.0, reason=f"{len(acts)} tensors, eager {len(eags)}, "
                                                         f"reference {len(refs)}")
    names = list(names) if names is not None else [f"output {i}" for i in range(len(acts))]
    count = sum(r.numel() for r in refs) or 1
    overall = math.sqrt(sum(_rms(r) ** 2 * r.numel() for r in refs) / count)
    nudged = list(nudged_errors) if nudged_errors is not None else [0.0] * len(acts)
    verdicts = []
    for a, e, r, n, p in zip(acts, eags, refs, names, nudged):
        scale = None
        if shared_scale and _rms(r) < SHARE_FLOOR * overall:
            scale = VANISHING_ULPS * overall
        verdicts.append(judge(a, e, r, scale=scale, name=n, nudged_error=p))
    if not verdicts:
        return Verdict(True, 0.0, 0.0, 0.0, reason="nothing to compare")
    failed = [v for v in verdicts if not v.ok]
    return failed[0] if failed else max(verdicts, key=lambda v: v.ratio)


def reference_dtype(dtype: torch.dtype) -> torch.dtype:
    """The precision of the reference for a run in `dtype`: fp64 for fp32 (and fp64), fp32 for
    bf16 and fp16."""
    return torch.float32 if dtype in LOW_PRECISION else torch.float64


def to_reference(value: Any, dtype: torch.dtype) -> Any:
    """`value` (a tensor, module or nested inputs) with its floating-point tensors in `dtype`.
    A module is converted in place (copy it first to keep the original)."""
    if isinstance(value, torch.nn.Module):
        if dtype == torch.float64:
            # transformers' mixture-of-experts layers multiply through torch._grouped_mm, which
            # has no fp64 kernel (CPU or CUDA); the batched form computes the same in fp64
            for module in value.modules():
                if callable(getattr(module, "set_experts_implementation", None)):
                    try:
                        module.set_experts_implementation("batched_mm")
                    except Exception:   # a model without experts, or a version without the batched form
                        pass
        return value.to(dtype)
    return pytree.tree_map(lambda t: t.to(dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() else t,
                           value)


def nudge(model: torch.nn.Module, inputs: tuple, generator: torch.Generator,
          input_noise: float) -> tuple[torch.nn.Module, tuple]:
    """A copy of `model` whose floating-point parameters are each moved by one unit roundoff of
    their dtype (relative Gaussian noise: the weights as rounded from other exact values, as valid
    a model in that precision), and `inputs` with their floating-point tensors moved by
    `input_noise` (relative).  Eager's results on such data tell how far rounding-sized changes
    move an ill-conditioned computation (a ReLU or a softmax that flips on a last-place change):
    any evaluation in this precision, eager's included, may land that far from the reference.
    The parameters matter where no input is floating-point (token ids): there the inputs alone
    moved nothing, and eager on them repeated its own error exactly.  One unit roundoff is less
    than the backward error of any fp32 matmul on the weights (their sum's length times it), so
    this allows nothing a stable evaluation could not give; a defect (a bf16 intermediate, a
    wrong epsilon) moves results far more than this (tests/tools/test_accuracy.py)."""
    moved_model = copy.deepcopy(model)
    with torch.no_grad():
        for p in moved_model.parameters():
            if p.is_floating_point():
                noise = torch.randn(p.shape, generator=generator).to(p.device, p.dtype)
                p.add_(p * noise * (torch.finfo(p.dtype).eps / 2))
    moved = tuple(x * (1 + input_noise * torch.randn(x.shape, generator=generator).to(x.device, x.dtype))
                  if isinstance(x, torch.Tensor) and x.is_floating_point() else x for x in inputs)
    return moved_model, moved



def nudged_errors(model: torch.nn.Module, inputs: tuple, reference: Sequence[torch.Tensor],
                  run: Callable[[torch.nn.Module, tuple], Sequence[torch.Tensor]], *, runs: int = 4,
                  input_noise: float = 1e-6, seed: int = 7) -> list[float]:
    """Per tensor, the worst RMSE against `reference` of `run(moved_model, moved_inputs)` over
    `runs` nudges (see nudge): how far rounding-sized changes move this computation, the
    `nudged_error` that judge and judge_all take."""
    g = torch.Generator().manual_seed(seed)
    worst = [0.0] * len(reference)
    for _ in range(runs):
        moved, args = nudge(model, inputs, g, input_noise)
        out = run(moved, args)
        worst = [max(w, rmse(t, r)) for w, t, r in zip(worst, out, reference)]
        del moved, out
    return worst

# Ops whose results are random draws (or, for native_dropout, a draw applied to the input).  Not
# every op tagged nondeterministic_seeded: attention (its dropout_p) and LSTM/GRU carry the tag,
# and their results must stay the reference's own.
_DRAWS = {getattr(torch.ops.aten, name) for name in (
    "native_dropout", "bernoulli", "bernoulli_", "rand", "rand_like", "randn", "randn_like", "randint",
    "randint_like", "randperm", "uniform", "uniform_", "normal", "normal_", "exponential", "exponential_",
    "cauchy", "cauchy_", "log_normal", "log_normal_", "geometric", "geometric_", "multinomial", "poisson")}


class RandomDraws(TorchDispatchMode):
    """Random ops' results recorded in one run (`replay` False) and handed out, in order, to
    another run (`replay` True), cast to its dtype: the higher-precision reference then drops
    the elements that eager's dropout dropped.  Seeding both runs alike is not enough, as the
    draws may depend on the dtype (CUDA's fused dropout consumes its Philox stream in vectors
    whose width follows the element size).  A dropout's output is recomputed from the replayed
    mask in the run's own precision; any other random op's results are its recorded values."""

    def __init__(self, draws: list | None = None) -> None:
        super().__init__()
        self.replay = draws is not None
        self.draws: list = list(draws) if draws is not None else []
        self._next = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.overloadpacket not in _DRAWS:
            return out
        if not self.replay:
            self.draws.append(pytree.tree_map(lambda t: t.detach().clone() if isinstance(t, torch.Tensor) else t, out))
            return out
        if self._next >= len(self.draws):
            raise RuntimeError(f"{func}: more random ops than the recorded run had ({len(self.draws)})")
        drawn, self._next = self.draws[self._next], self._next + 1
        if func is torch.ops.aten.native_dropout.default:
            x, p = args[0], args[1]
            mask = drawn[1].to(out[1].device, out[1].dtype)
            return x * mask * (1.0 / (1.0 - p) if p < 1 else 0.0), mask
        with torch.no_grad():
            for mine, recorded in zip(pytree.tree_leaves(out), pytree.tree_leaves(drawn)):
                if isinstance(mine, torch.Tensor):
                    mine.copy_(recorded)
        return out
