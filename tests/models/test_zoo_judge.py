"""benchmarks/zoo.py's accuracy judge on training rows: every judged run draws the reference's
dropout mask, and a wrong lowering still fails, second chance (nudged eager runs) included."""
from __future__ import annotations

import copy
import os
import shutil
import sys

import pytest
import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks"))
_CACHE_VARS = ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR", "TORCHFUSE_CACHE_DIR")
_ENV = {var: os.environ.get(var) for var in _CACHE_VARS}
import zoo  # noqa: E402

_ZOO_ENV = {var: os.environ.get(var) for var in _CACHE_VARS}


@pytest.fixture(scope="module", autouse=True)
def _zoo_caches():
    """Importing zoo (and the benchmarks it imports) made fresh cache folders and pointed the
    cache variables at them: both undone with this module's tests.  A variable set again since
    (the session's kernel cache, tests/conftest.py: this module is imported at collection, before
    that fixture runs) is left as it is."""
    yield
    for var, value in _ENV.items():
        if os.environ.get(var) != _ZOO_ENV[var]:
            continue
        if value is None:
            os.environ.pop(var, None)
        else:
            os.environ[var] = value
    import cpu_bench
    import gpu_bench
    for root in (zoo._CACHE_ROOT, cpu_bench._CACHE_ROOT, gpu_bench._tmp):
        shutil.rmtree(root, ignore_errors=True)


class _BN(nn.BatchNorm2d):
    """Train-mode batch norm, or one lowered wrongly: `defect` "epsilon" drops eps, "bessel"
    normalizes by the unbiased variance."""

    defect = ""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.defect:
            return super().forward(x)
        var, mean = torch.var_mean(x, dim=(0, 2, 3), correction=int(self.defect == "bessel"), keepdim=True)
        y = (x - mean) * torch.rsqrt(var + (0.0 if self.defect == "epsilon" else self.eps))
        return y * self.weight[:, None, None] + self.bias[:, None, None]


class _SmallMobileNet(nn.Module):
    """MobileNetV2's pieces in small: convolutions, train-mode batch norm, ReLU6, and dropout
    (p=0.2) before the classifier.  `stride` 4 leaves 2x2 maps at batch 4 (a few values per
    channel: ill-conditioned, as the zoo's CPU size is); 1 leaves 11x11 maps."""

    def __init__(self, stride: int) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 16, 3, 2, 1, bias=False), _BN(16), nn.ReLU6(),
            nn.Conv2d(16, 16, 3, stride, 1, groups=16, bias=False), _BN(16), nn.ReLU6(),
            nn.Conv2d(16, 24, 1, bias=False), _BN(24), nn.ReLU6())
        self.classifier = nn.Sequential(nn.Dropout(0.2), nn.Linear(24, 10))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(x).mean((2, 3)))


def _loss(out: torch.Tensor, inputs: tuple) -> torch.Tensor:
    return F.cross_entropy(out, torch.arange(out.shape[0]) % out.shape[1])


def _judged_row(stride: int, compiled: str, defect: str = "") -> zoo.Row:
    """A training row of eager and `compiled` (with `defect` in its copy of the model), judged
    as zoo.run_row judges it."""
    torch.manual_seed(0)
    model = _SmallMobileNet(stride).train()
    inputs = (torch.randn(4, 3, 21, 21, generator=torch.Generator().manual_seed(1)),)
    row = zoo.Row("small_mobilenet", "mobile", "train", "fp32", "cpu", "cpu")
    judge = zoo.Judge(row, model, inputs, _loss, [n for n, _ in model.named_parameters()])
    for backend in ("eager", compiled):
        torch._dynamo.reset()
        m = copy.deepcopy(model)
        for bn in m.modules():
            if isinstance(bn, _BN) and backend != "eager":
                bn.defect = defect
        torch.manual_seed(99)   # whatever the generator held: the judged step draws the reference's mask
        judge(backend, zoo.TrainStep(m, zoo.compile_with(backend, m), _loss, inputs).first())
    return row


@pytest.mark.parametrize("stride", [1, 4])
def test_training_row_draws_one_dropout_mask(stride: int) -> None:
    """Eager's error against fp64 is rounding (each run unseeded: another mask, and the
    classifier's gradient as far off as its own size), and torchfuse passes."""
    row = _judged_row(stride, "torchfuse")
    assert row.results["eager"].err < 1e-4, row.results["eager"].err
    assert row.results["torchfuse"].ok, row.notes
    assert row.results["torchfuse"].err < 10, row.results["torchfuse"].err   # x eager's error, worst tensor


@pytest.mark.parametrize("defect", ["epsilon", "bessel"])
@pytest.mark.parametrize("stride", [1, 4])
def test_wrong_batch_norm_fails_the_judge(stride: int, defect: str) -> None:
    """A dropped epsilon or a variance with Bessel's correction in train-mode batch norm fails,
    on 11x11 maps and on 2x2 maps alike, also against eager's error on nudged data (the defect
    is in the model torchfuse compiles: a wrong lowering's result, and the judge is what is tested)."""
    row = _judged_row(stride, "torchfuse", defect)
    assert not row.results["torchfuse"].ok, row.notes
    assert any("ACCURACY" in n for n in row.notes) and not any("ill-conditioned" in n for n in row.notes), row.notes


@pytest.mark.parametrize("backend", ["inductor", "torchfuse"])
def test_compiled_dropout_draws_eagers_mask(backend: str) -> None:
    """From reset_rng, each compiler's dropout keeps eager's elements (Inductor's own Philox
    stream, without fallback_random, keeps others)."""
    model = nn.Sequential(nn.Linear(37, 53), nn.Dropout(0.3)).train()
    x = torch.randn(5, 37, generator=torch.Generator().manual_seed(2))
    zoo.reset_rng()
    with torch.no_grad():
        expected = model(x)
        torch._dynamo.reset()
        compiled = zoo.compile_with(backend, model)
        torch.manual_seed(5)
        compiled(x)                       # another mask: the generator moved on
        zoo.reset_rng()
        actual = compiled(x)
    assert torch.equal(actual == 0, expected == 0)
    torch.testing.assert_close(actual, expected)


class _Scaled(nn.Module):
    """A linear layer whose output is multiplied by `scale` (1 + 1e-4: a wrong lowering's result)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin, self.scale = nn.Linear(16, 8), 1.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) * self.scale


def _scaled_model() -> tuple[_Scaled, tuple[torch.Tensor]]:
    torch.manual_seed(0)
    return _Scaled(), (torch.randn(32, 16, generator=torch.Generator().manual_seed(1)),)


def test_training_row_judges_outputs_and_gradients() -> None:
    """A training row judges each tensor of the forward's output and every parameter gradient,
    not the scalar loss (a random projection of the outputs' errors): a forward scaled by
    1 + 1e-4 fails on its output, named as such."""
    model, inputs = _scaled_model()
    model.train()
    step = zoo.TrainStep(model, model, _loss, inputs).first()
    judged = zoo.row_tensors("train", step)
    assert [tuple(t.shape) for t in judged] == [(32, 8), (8, 16), (8,)]
    row = zoo.Row("scaled", "mlp", "train", "fp32", "cpu", "cpu")
    judge = zoo.Judge(row, model, inputs, _loss, [n for n, _ in model.named_parameters()])
    for backend, scale in (("eager", 1.0), ("torchfuse", 1.0 + 1e-4)):
        m = copy.deepcopy(model)
        m.scale = scale
        torch._dynamo.reset()
        judge(backend, zoo.TrainStep(m, zoo.compile_with(backend, m), _loss, inputs).first())
    assert not row.results["torchfuse"].ok and any("output 0" in n for n in row.notes), row.notes


class _RowSum(nn.Module):
    """A linear layer's rows summed in a new order on every call when `ordered` is False (as
    CUDA's atomics sum a scatter), in one order otherwise."""

    calls = 0   # on the class: every deep copy of the model shares it

    def __init__(self, ordered: bool) -> None:
        super().__init__()
        self.lin, self.ordered = nn.Linear(16, 8), ordered

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        type(self).calls += 1
        seed = 0 if self.ordered else type(self).calls
        perm = torch.randperm(x.shape[0], generator=torch.Generator().manual_seed(seed))
        rows = self.lin(x)[perm]
        # one fp32 sum, row after row (cumsum would accumulate in double on the CPU)
        return rows.new_zeros(1, rows.shape[1]).index_add(0, torch.zeros_like(perm), rows)[0]


@pytest.mark.parametrize("ordered", [True, False])
def test_eager_that_sums_in_a_new_order_draws_more_nudges(ordered: bool, monkeypatch) -> None:
    """The second check's nudged runs: PERTURBED_RUNS for eager that gives the same result every
    run, UNORDERED_RUNS for eager whose result changes with the order of its sums (the two
    reruns on the row's own data tell), and the reruns' errors count."""
    import zoo_judge
    drawn: list[int] = []

    def spy(*args, **kwargs):
        drawn.append(kwargs["runs"])
        return [0.0] * len(args[2])   # the nudged runs' errors: none, so the reruns' are what is left

    monkeypatch.setattr(zoo_judge.accuracy, "nudged_errors", spy)
    torch.manual_seed(0)
    model = _RowSum(ordered).train()
    inputs = (torch.randn(4099, 16, generator=torch.Generator().manual_seed(1)),)
    loss = lambda out, args: out.square().mean()   # noqa: E731
    reference = zoo.precise_reference(model, inputs, "cpu", loss, torch.float64)
    errors = zoo.perturbed_errors(model, inputs, loss, reference)
    assert drawn == [zoo_judge.PERTURBED_RUNS if ordered else zoo_judge.UNORDERED_RUNS]
    assert zoo_judge.UNORDERED_RUNS > zoo_judge.PERTURBED_RUNS
    assert len(errors) == 3 and errors[0] > 0, errors   # output, weight and bias gradients


def test_inference_row_with_a_wrong_output_fails_the_second_check_too() -> None:
    """An fp32 inference row that fails is judged again against eager on nudged data (as a
    training row is), and an output scaled by 1 + 1e-4 still fails it."""
    model, inputs = _scaled_model()
    model.eval()
    row = zoo.Row("scaled", "mlp", "infer", "fp32", "cpu", "cpu")
    judge = zoo.Judge(row, model, inputs, _loss, [])
    for backend, scale in (("eager", 1.0), ("torchfuse", 1.0 + 1e-4)):
        m = copy.deepcopy(model)
        m.scale = scale
        torch._dynamo.reset()
        with torch.no_grad():
            judge(backend, zoo.compile_with(backend, m)(*inputs))
    assert judge._nudged is not None           # the second check ran
    assert not row.results["torchfuse"].ok and not any("ill-conditioned" in n for n in row.notes), row.notes
