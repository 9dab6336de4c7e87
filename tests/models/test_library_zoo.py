"""The libraries' own models (benchmarks/zoo_library.py) through torchfuse at their "tiny" size,
judged as the zoo judges them (torchfuse.tools.accuracy): every output tensor, or every tensor of
the forward's output and every parameter gradient of a training step, against the model in higher precision (fp64 for
fp32, fp32 for bf16), within 1.5x eager's error; strict mode, and no graph may run eagerly.
A library that is not installed (or does not import on this torch) skips its cases.  The cases
of a library that patches torch when imported run in one child pytest (ISOLATED)."""
from __future__ import annotations

import copy
import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from typing import Any

import pytest
import torch

from torchfuse import counters
from torchfuse.tools.accuracy import flatten, judge_all, nudged_errors, reference_dtype, to_reference

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks"))
import zoo_library  # noqa: E402

# (model, mode, dtype): a slice across libraries and families that compiles in seconds each.
# Not RAFT: it builds its coordinate grid in fp32 whatever the model's dtype, so it has no fp64
# reference (benchmarks/zoo.py times it and marks its accuracy not judged).
CASES = [
    ("pyg_gcn", "infer", torch.float32), ("pyg_gcn", "train", torch.float32),
    ("pyg_gat", "train", torch.float32), ("pyg_graphsage", "infer", torch.float32),
    ("pyg_gin", "infer", torch.float32),
    ("hf_bart", "infer", torch.float32), ("hf_mixtral", "infer", torch.float32),
    ("hf_whisper_tiny", "infer", torch.float32), ("hf_qwen2_moe", "train", torch.float32),
    ("hf_llama", "infer", torch.bfloat16),
    ("timm_vit_small_patch16_224", "train", torch.float32), ("timm_convnext_tiny", "infer", torch.float32),
    ("timm_resnet50", "train", torch.float32), ("timm_mobilevitv2_100", "infer", torch.bfloat16),
    ("tv_squeezenet1_1", "infer", torch.float32),
    ("tv_lraspp_mobilenet_v3_large", "infer", torch.bfloat16),
    ("ta_conformer", "infer", torch.float32),
]


# torch_geometric replaces torch.index_select with a Python wrapper when it is imported, for the
# whole process: the tests that follow (and PyTorch's OpInfo database, when it is imported after)
# would call the wrapper, which rejects 0-d inputs and which AOTAutograd's cache refuses.  Its
# models run in a child pytest, which the parent never lets import it.
ISOLATED = {"torch_geometric"}
_CHILD = "TORCHFUSE_TEST_ISOLATED_CHILD"


def _case_id(case: tuple[str, str, torch.dtype]) -> str:
    return f"{case[0]}-{case[1]}-{str(case[2]).split('.')[-1]}"


def _isolated(item: pytest.Item) -> bool:
    case = getattr(item, "callspec", None) and item.callspec.params.get("case")
    return bool(case) and zoo_library.library_of(case[0]) in ISOLATED


@pytest.fixture(scope="module")
def isolated_results(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Runs the selected cases of the ISOLATED libraries in one child pytest, sharing this
    session's kernel cache; test name -> (outcome, detail), "" -> the child's output."""
    ids = [item.nodeid for item in request.session.items if item.path == request.path and _isolated(item)]
    junit = tmp_path_factory.mktemp("isolated") / "results.xml"
    env = dict(os.environ, TORCHFUSE_TEST_CACHE_DIR=os.environ["TORCHFUSE_CACHE_DIR"], **{_CHILD: "1"})
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={junit}",
                           *ids], cwd=request.config.rootpath, env=env, capture_output=True, text=True, timeout=1800)
    results: dict[str, Any] = {"": (proc.stdout + proc.stderr)[-4000:]}
    if junit.exists():
        for case in ET.parse(junit).iter("testcase"):
            outcome = next(((c.tag, f"{c.get('message', '')}\n{c.text or ''}") for c in case
                            if c.tag in ("failure", "error", "skipped")), ("passed", ""))
            results[case.get("name")] = outcome
    return results


def _model(name: str, dtype: torch.dtype) -> tuple[Any, torch.nn.Module, tuple[torch.Tensor, ...]]:
    lib = zoo_library.library_of(name)
    if name not in zoo_library.LIBRARY_BY_NAME:
        pytest.skip(f"{lib} is not available: {zoo_library.missing().get(lib)}")
    zm = zoo_library.LIBRARY_BY_NAME[name]
    model, inputs = zm.make("tiny", "cpu", dtype)
    return zm, model, inputs


def _step(zm: Any, model: torch.nn.Module, forward: Any, inputs: tuple) -> list[torch.Tensor]:
    """The forward's output tensors, then every parameter gradient after the loss's backward
    (the zoo's training judge: the scalar loss is a random projection of the outputs' errors)."""
    out = forward(*inputs)
    zm.loss(out, inputs).backward()
    return [t.detach() for t in flatten(out)] + [p.grad if p.grad is not None else torch.zeros_like(p)
                                                 for p in model.parameters() if p.requires_grad]


def _judge_step(actual: list, eager: list, reference: list, params: int, nudged: list | None = None) -> Any:
    """Outputs judged on their own scale, gradients on their shared one (benchmarks/zoo_judge.py Judge)."""
    n = len(reference) - params
    nudged = nudged or [0.0] * len(reference)
    out = judge_all(actual[:n], eager[:n], reference[:n], nudged_errors=nudged[:n])
    if not out.ok:
        return out
    return judge_all(actual[n:], eager[n:], reference[n:], shared_scale=True, nudged_errors=nudged[n:])


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_library_model(case: tuple[str, str, torch.dtype], request: pytest.FixtureRequest) -> None:
    name, mode, dtype = case
    if zoo_library.library_of(name) in ISOLATED and not os.environ.get(_CHILD):
        results = request.getfixturevalue("isolated_results")
        assert zoo_library.library_of(name) not in sys.modules, "the parent process imported it"
        outcome, detail = results.get(request.node.name, ("not run", results[""]))
        if outcome == "skipped":
            pytest.skip(detail)
        assert outcome == "passed", f"child pytest: {outcome}: {detail}"
        return
    zm, model, inputs = _model(name, dtype)
    ref_dtype = reference_dtype(dtype)
    ref_model, ref_inputs = to_reference(copy.deepcopy(model), ref_dtype), to_reference(inputs, ref_dtype)
    torch._dynamo.reset()
    before = dict(counters)
    if mode == "infer":
        with torch.no_grad():
            reference, eager = flatten(ref_model(*ref_inputs)), flatten(model(*inputs))
            actual = flatten(torch.compile(model, backend="torchfuse", options={"strict": True})(*inputs))
        verdict = judge_all(actual, eager, reference)
    else:
        for m in (model, ref_model):
            m.train()
        compiled = copy.deepcopy(model)
        reference, eager = _step(zm, ref_model, ref_model, ref_inputs), _step(zm, model, model, inputs)
        actual = _step(zm, compiled, torch.compile(compiled, backend="torchfuse", options={"strict": True}), inputs)
        params = sum(1 for p in model.parameters() if p.requires_grad)
        verdict = _judge_step(actual, eager, reference, params)
    assert counters["kernels_generated"] > before.get("kernels_generated", 0), "torchfuse generated no kernels"
    assert counters["eager_fallbacks"] == before.get("eager_fallbacks", 0), "a torchfuse graph ran eagerly"
    if not verdict.ok:
        # judged again, as the zoo judges a failing row, against eager's error on data moved by
        # rounding-sized noise (benchmarks/zoo.py perturbed_errors): an ill-conditioned output
        # (a random MobileViT-v2's bf16 logits at 64 pixels, 3x eager's own error on such a nudge)
        nudged = _nudged_errors(zm, model, inputs, mode, reference)
        if mode == "infer":
            verdict = judge_all(actual, eager, reference, nudged_errors=nudged)
        else:
            verdict = _judge_step(actual, eager, reference, params, nudged)
    assert verdict.ok, f"{name} {mode}: {verdict}"


def _nudged_errors(zm: Any, model: torch.nn.Module, inputs: tuple, mode: str,
                   reference: list[torch.Tensor]) -> list[float]:
    """Per tensor, eager's worst RMSE against the reference on nudged data (weights moved by a
    unit roundoff, inputs by 1e-6), as benchmarks/zoo.py's perturbed_errors."""
    def run(moved: torch.nn.Module, args: tuple) -> list[torch.Tensor]:
        if mode == "infer":
            with torch.no_grad():
                return flatten(moved(*args))
        for p in moved.parameters():
            p.grad = None            # (the copy took eager's step's gradients along)
        return _step(zm, moved, moved, args)
    return nudged_errors(model, inputs, reference, run)
