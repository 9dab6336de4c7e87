"""OpInfo sweep: compile every op of PyTorch's OpInfo database with torchfuse and compare with eager.

    python -m torchfuse.tools.opinfo_sweep                      # the fast CI subset, fp32
    python -m torchfuse.tools.opinfo_sweep --all --out sweep.md # every OpInfo (takes long)
    python -m torchfuse.tools.opinfo_sweep --ops add,sum --dtypes float32,float16 --max-samples 5

For each op (`torch.testing._internal.common_methods_invocations.op_db`) and dtype the first
`--max-samples` sample inputs are run eagerly (samples whose eager call fails are dropped) and
through `torch.compile(backend=torchfuse)`.  All samples of one op are compiled as one function
(one graph, one C++ build); if that fails, every sample is retried on its own to find the culprit.
Each op ends up in one of these classes:

    lowered   every sample matched eager and every aten op became a generated kernel (or a view)
    fallback  every sample matched eager, but some aten op ran through ATen (reason shown)
    mismatch  some output (or input mutated in place) differs from eager; for float16/bfloat16 only
              if torchfuse is also less accurate against a float64 run of the op than both eager
              and eager running the aten graph torchfuse was given (FP64_REF_RATIO)
    crash     torchfuse raised (or the process died / timed out) where eager and aot_eager succeed
    skipped   the dtype is unsupported, no sample runs eagerly, Dynamo/AOTAutograd itself fails,
              or no graph reached torchfuse
    xfail     a crash or mismatch listed in KNOWN_FAILURES: a known bug outside the op lowerings,
              with its minimal repro (tests/opinfo/test_known_failures.py)

Random ops (and ops returning uninitialized memory) are compared by shape and dtype only.
The CLI runs the ops in a worker process and restarts it after a segfault or a hang, so one
broken kernel cannot end the sweep.  `sweep()` runs in-process (used by tests/opinfo).
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
from dataclasses import asdict, dataclass, field
from itertools import islice
from typing import Any, Iterable, Sequence

import torch

STATUSES = ("lowered", "fallback", "mismatch", "crash", "xfail", "skipped")
_RANK = {"skipped": 0, "lowered": 1, "fallback": 2, "xfail": 3, "mismatch": 3, "crash": 4}

# What the Triton backend raises for an op whose libdevice function Triton's CPU interpreter
# lacks (backends/triton/codegen.py): a gap of the test setup, not of the GPU code
INTERPRETER_GAP = "has no Triton-interpreter implementation"

# Known crashes/mismatches whose fix lies outside the op lowerings and code generator (op key ->
# the bug); each has a minimal repro, xfailed, in tests/opinfo/test_known_failures.py.
KNOWN_FAILURES: dict[str, str] = {}

# The fast subset CI runs: common pointwise, reduction, normalization, view and indexing ops.
SUBSET = [
    # unary pointwise
    "abs", "neg", "exp", "expm1", "log", "log1p", "sqrt", "rsqrt", "sin", "cos", "tanh", "sigmoid",
    "erf", "floor", "round", "trunc", "frac", "sign", "reciprocal", "isnan", "nan_to_num", "square",
    "logical_not",
    # binary / ternary pointwise
    "add", "sub", "mul", "div.no_rounding_mode", "div.floor_rounding", "div.trunc_rounding", "pow",
    "maximum", "minimum", "remainder", "fmod", "atan2", "eq", "lt", "where", "clamp", "lerp", "addcmul",
    "logical_and", "xlogy",
    # activations (decomposed)
    "nn.functional.relu", "nn.functional.gelu", "nn.functional.silu", "nn.functional.softplus",
    "nn.functional.hardtanh", "nn.functional.leaky_relu", "nn.functional.elu",
    # reductions and normalizations
    "sum", "mean", "prod", "amax", "amin", "max.reduction_with_dim", "argmax", "any", "var", "std",
    "softmax", "log_softmax", "logsumexp", "nn.functional.layer_norm",
    # views and indexing
    "view", "reshape", "permute", "transpose", "expand", "squeeze", "unsqueeze", "flatten", "slice",
    "select", "diagonal", "cat", "stack", "flip", "roll", "repeat", "index_select", "gather", "tril",
    "constant_pad_nd", "masked_fill", "select_scatter", "slice_scatter",
]

# Ops whose values are random: compared by shape and dtype only.
RANDOM_OPS = {
    "bernoulli", "cauchy", "exponential", "geometric", "log_normal", "multinomial", "normal",
    "normal.in_place", "normal.number_mean", "uniform", "rand_like", "randn_like", "randint_like", "randint",
    "randn", "rand", "nn.functional.dropout", "nn.functional.dropout2d", "nn.functional.dropout3d",
    "nn.functional.alpha_dropout", "nn.functional.feature_alpha_dropout.with_train",
    "nn.functional.feature_alpha_dropout.without_train", "nn.functional.rrelu",
    "nn.functional.fractional_max_pool2d", "nn.functional.fractional_max_pool3d", "svd_lowrank",
    "pca_lowrank",
}
# Ops that return uninitialized memory.
UNINITIALIZED_OPS = {"empty", "empty_like", "empty_permuted", "empty_strided", "new_empty", "new_empty_strided"}

# (atol, rtol) used when the OpInfo has no larger toleranceOverride for the dtype.
DEFAULT_TOL = {
    torch.float64: (1e-7, 1e-7), torch.float32: (1e-5, 1.3e-5), torch.float16: (1e-3, 1e-3),
    torch.bfloat16: (1e-2, 1.6e-2), torch.complex64: (1e-5, 1.3e-5), torch.complex128: (1e-7, 1e-7),
}


@dataclass
class OpResult:
    op: str
    dtype: str
    status: str
    samples: int = 0                     # samples compared (eager succeeded)
    kernels: int = 0
    fallbacks: list[str] = field(default_factory=list)
    detail: str = ""
    seconds: float = 0.0


@dataclass
class _Case:
    index: int
    template: Any                 # (input, args, kwargs) with tensors replaced by _Slot
    tensors: list[torch.Tensor]
    expected: Any
    expected_inputs: list[torch.Tensor]


class _Slot:
    __slots__ = ("k",)

    def __init__(self, k: int):
        self.k = k


# ----------------------------------------------------------------------------------------------
# op selection
# ----------------------------------------------------------------------------------------------

def op_key(op: Any) -> str:
    return op.name + (f".{op.variant_test_name}" if op.variant_test_name else "")


def op_db() -> list:
    from torch.testing._internal.common_methods_invocations import op_db as db
    return list(db)


def select_ops(names: Sequence[str] | None = None, *, all_ops: bool = False) -> list:
    """OpInfos by key ("div.floor_rounding") or by name (every variant of "div")."""
    db = op_db()
    if all_ops and not names:
        return db
    wanted = list(names) if names else list(SUBSET)
    by_key = {op_key(o): o for o in db}
    out, seen = [], set()
    for name in wanted:
        hits = [by_key[name]] if name in by_key else [o for o in db if o.name == name]
        if not hits:
            raise ValueError(f"no OpInfo named {name!r}")
        for o in hits:
            if op_key(o) not in seen:
                seen.add(op_key(o))
                out.append(o)
    return out


def tolerance(op: Any, dtype: torch.dtype, device: str = "cpu") -> tuple[float, float]:
    """The default tolerance for `dtype`, raised to the largest toleranceOverride the OpInfo
    declares for it (those overrides exist because reference implementations differ legitimately)."""
    atol, rtol = DEFAULT_TOL.get(dtype, (1e-5, 1.3e-5))
    try:
        from torch.testing._internal.common_device_type import toleranceOverride
    except Exception:
        return atol, rtol
    for info in getattr(op, "decorators", None) or ():
        if getattr(info, "device_type", None) not in (None, device):
            continue
        dts = getattr(info, "dtypes", None)
        if dts is not None and dtype not in dts:
            continue
        for deco in getattr(info, "decorators", ()) or ():
            if isinstance(deco, toleranceOverride) and dtype in deco.d:
                t = deco.d[dtype]
                atol, rtol = max(atol, t.atol), max(rtol, t.rtol)
    return atol, rtol


# ----------------------------------------------------------------------------------------------
# helpers: tensors in nested arguments, output comparison, error classification
# ----------------------------------------------------------------------------------------------

def _split(obj: Any, tensors: list) -> Any:
    if isinstance(obj, torch.Tensor):
        tensors.append(obj)
        return _Slot(len(tensors) - 1)
    if type(obj) in (list, tuple):
        return type(obj)(_split(x, tensors) for x in obj)
    if type(obj) is dict:
        return {k: _split(v, tensors) for k, v in obj.items()}
    return obj


def _fill(obj: Any, tensors: Sequence[torch.Tensor]) -> Any:
    if isinstance(obj, _Slot):
        return tensors[obj.k]
    if type(obj) in (list, tuple):
        return type(obj)(_fill(x, tensors) for x in obj)
    if type(obj) is dict:
        return {k: _fill(v, tensors) for k, v in obj.items()}
    return obj


def _flatten(x: Any) -> list:
    if isinstance(x, (list, tuple)):
        return [y for item in x for y in _flatten(item)]
    if isinstance(x, dict):
        return [y for v in x.values() for y in _flatten(v)]
    return [x]


def compare(got: Any, expected: Any, *, atol: float, rtol: float, values: bool = True) -> str | None:
    """None when `got` matches `expected` (structure, shapes, dtypes, then values), else why not."""
    g, e = _flatten(got), _flatten(expected)
    if len(g) != len(e):
        return f"{len(g)} outputs, eager has {len(e)}"
    for k, (a, b) in enumerate(zip(g, e)):
        if not isinstance(b, torch.Tensor):
            if isinstance(a, torch.Tensor):
                if a.numel() != 1:
                    return f"output {k}: tensor of shape {tuple(a.shape)}, eager gives {b!r}"
                a = a.item()
            same = a == b or (isinstance(a, float) and isinstance(b, float) and a != a and b != b)
            if not same and not (isinstance(a, (int, float)) and isinstance(b, (int, float))
                                 and abs(a - b) <= atol + rtol * abs(b)):
                return f"output {k}: {a!r} != eager {b!r}"
            continue
        if not isinstance(a, torch.Tensor):
            return f"output {k}: got {type(a).__name__}, eager gives a tensor"
        if a.shape != b.shape:
            return f"output {k}: shape {tuple(a.shape)} != eager {tuple(b.shape)}"
        if a.dtype != b.dtype:
            return f"output {k}: dtype {a.dtype} != eager {b.dtype}"
        if not values:
            continue
        exact = not (b.dtype.is_floating_point or b.dtype.is_complex)
        try:
            torch.testing.assert_close(a, b, atol=0 if exact else atol, rtol=0 if exact else rtol,
                                       equal_nan=True, check_device=False, check_stride=False)
        except AssertionError as err:
            lines = [ln.strip() for ln in str(err).splitlines() if ln.strip()]
            return f"output {k}: " + "; ".join(lines[:4])
    return None


def _frames(exc: BaseException) -> Iterable[traceback.FrameSummary]:
    seen: set[int] = set()
    e: BaseException | None = exc
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        yield from traceback.extract_tb(e.__traceback__)
        e = e.__cause__ or e.__context__


def _short_error(exc: BaseException) -> str:
    inner = exc
    seen: set[int] = set()
    while id(inner) not in seen and (inner.__cause__ is not None or getattr(inner, "inner_exception", None)):
        seen.add(id(inner))
        inner = getattr(inner, "inner_exception", None) or inner.__cause__
    text = f"{type(inner).__name__}: {str(inner).split('Set TORCHDYNAMO_VERBOSE')[0]}".strip().replace("\n", " ")
    where = ""
    for fr in _frames(inner):
        if f"{os.sep}torchfuse{os.sep}" in fr.filename and f"{os.sep}tools{os.sep}" not in fr.filename:
            where = f" [{os.path.basename(fr.filename)}:{fr.lineno} {fr.name}]"
    return (text[:300] + ("..." if len(text) > 300 else "")) + where


# ----------------------------------------------------------------------------------------------
# running one op
# ----------------------------------------------------------------------------------------------

def _call(op: Any, template: Any, tensors: Sequence[torch.Tensor]) -> Any:
    inp, args, kwargs = _fill(template, tensors)
    return op.op(inp, *args, **kwargs)


def _make_fn(op: Any, cases: Sequence[_Case]):
    spans, start = [], 0
    for c in cases:
        spans.append((c.template, start, start + len(c.tensors)))
        start += len(c.tensors)

    def fn(*tensors):
        outs = []
        for template, a, b in spans:
            inp, args, kwargs = _fill(template, tensors[a:b])
            outs.append(op.op(inp, *args, **kwargs))
        return tuple(outs)
    return fn


def _compile_run(op: Any, cases: Sequence[_Case], backend: Any) -> tuple[Any, list[torch.Tensor]]:
    fn = _make_fn(op, cases)
    torch._dynamo.reset()
    compiled = torch.compile(fn, backend=backend, dynamic=False)
    # one copy per sample: samples may share tensors (running stats), and each sample's eager
    # reference ran on its own copy
    inputs = [t for c in cases for t in copy.deepcopy(c.tensors)]
    outs = compiled(*inputs)
    return outs, inputs


class _Run:
    """The outcome of compiling and running some samples through torchfuse once."""

    def __init__(self):
        self.kernels = 0
        self.fallbacks: list[str] = []
        self.eager_graphs: list[str] = []
        self.graphs = 0
        self.graph_breaks: list[str] = []
        self.outputs: Any = None
        self.inputs: list[torch.Tensor] = []
        self.error: BaseException | None = None


def _torchfuse_run(op: Any, cases: Sequence[_Case], options: dict, explain: bool = True) -> _Run:
    """`explain=False`: no report, so graph-cache hits link their stored code as a user's
    compile does (explain's compile runs the stages again to report them)."""
    from torch._dynamo.utils import counters as dynamo_counters

    from .. import counters
    from ..report import Explanation
    from ..config import Config
    from ..frontend.dynamo import TorchfuseBackend

    run = _Run()
    report = Explanation()
    # (first_calls="wait": what is judged is the compiled graph, not the ATen tier)
    backend = TorchfuseBackend(Config.from_options({"strict": True, "first_calls": "wait", **options}),
                               report=report if explain else None)
    graphs0, eager0 = counters["graphs_compiled"], counters["eager_fallbacks"]
    dynamo_counters["graph_break"].clear()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            run.outputs, run.inputs = _compile_run(op, cases, backend)
        except Exception as e:            # noqa: BLE001 - classified by the caller
            run.error = e
    torch._dynamo.reset()
    run.kernels = len(report.kernels)
    run.fallbacks = [f"{f.op}: {f.reason}" for f in report.fallbacks]
    run.graphs = counters["graphs_compiled"] - graphs0
    if counters["eager_fallbacks"] != eager0:
        run.eager_graphs = [str(w.message).split("\n")[0] for w in caught if "torchfuse" in str(w.message)] or \
            ["a graph ran eagerly"]
    run.graph_breaks = [str(k).split("\n")[0][:120] for k in dynamo_counters["graph_break"]]
    return run


def _aot_eager_ok(op: Any, cases: Sequence[_Case]) -> str | None:
    """None when Dynamo + AOTAutograd (no torchfuse) handle the samples, else the error."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            _compile_run(op, cases, "aot_eager")
        return None
    except Exception as e:  # noqa: BLE001
        return _short_error(e)
    finally:
        torch._dynamo.reset()


def _prepare(op: Any, dtype: torch.dtype, device: str, max_samples: int) -> tuple[list[_Case], str]:
    samples = list(islice(op.sample_inputs(device, dtype, requires_grad=False), max_samples))
    cases, why = [], ""
    for k, s in enumerate(samples):
        tensors: list[torch.Tensor] = []
        template = _split((s.input, tuple(s.args), dict(s.kwargs)), tensors)
        if any(t.is_sparse or t.layout != torch.strided for t in tensors):
            why = "sparse/non-strided inputs"
            continue
        eager_inputs = copy.deepcopy(tensors)
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                expected = _call(op, template, eager_inputs)
        except Exception as e:  # noqa: BLE001
            why = f"eager fails: {type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''}"
            continue
        cases.append(_Case(k, template, tensors, expected, eager_inputs))
    if not samples:
        why = "no sample inputs"
    return cases, why


# fp16/bf16 outputs that differ from eager by more than the tolerance still pass when torchfuse is
# about as accurate as eager: both are compared with float64 on the same (upcast) inputs, as Inductor's
# `same(..., fp64_ref=...)` does.  Inductor allows 2-3x eager's error; we allow only FP64_REF_RATIO
# plus atol/10, so a lowering that is genuinely less accurate than eager (e.g. one that rounds an
# intermediate eager keeps in fp32) still shows up as a mismatch.
FP64_REF_RATIO = 1.1


def _rmse_vs_float64(op: Any, case: _Case, got: Any, baseline: Any) -> tuple[float, float] | str:
    """(torchfuse's, the baseline's) RMS errors against a float64 run of the op on the upcast inputs,
    for the output where torchfuse does worst relative to the baseline, or why the outputs cannot
    be compared that way (different NaN/inf positions, no float64 run)."""
    def up(t: torch.Tensor) -> torch.Tensor:
        return t.double() if t.dtype in (torch.float16, torch.bfloat16, torch.float32) else t

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            ref = _call(op, case.template, [up(t) for t in copy.deepcopy(case.tensors)])
    except Exception as e:  # noqa: BLE001 - the op does not run in float64
        return f"no float64 reference ({type(e).__name__})"
    worst: tuple[float, float] | None = None
    for g, e, r in zip(_flatten(got), _flatten(baseline), _flatten(ref)):
        if not isinstance(e, torch.Tensor) or not e.dtype.is_floating_point:
            continue
        if not isinstance(r, torch.Tensor) or r.shape != e.shape:
            return "no float64 reference of the same shape"
        g, e, r = g.double(), e.double(), r.double()
        if not torch.equal(g.isnan(), e.isnan()) or not torch.equal(g.isinf() & (g > 0), e.isinf() & (e > 0)) \
                or not torch.equal(g.isinf() & (g < 0), e.isinf() & (e < 0)):
            return "NaN/inf positions differ"
        ok = torch.isfinite(g) & torch.isfinite(e) & torch.isfinite(r)
        if not ok.any():
            continue
        err_g = float(((g[ok] - r[ok]) ** 2).mean().sqrt())
        err_e = float(((e[ok] - r[ok]) ** 2).mean().sqrt())
        if worst is None or err_g - FP64_REF_RATIO * err_e > worst[0] - FP64_REF_RATIO * worst[1]:
            worst = (err_g, err_e)
    return worst or (0.0, 0.0)


def _aot_eager_outputs(op: Any, case: _Case) -> Any:
    """The sample run by eager ATen on the aten graph torchfuse receives (Dynamo + AOTAutograd with
    torchfuse's decompositions, no torchfuse), or None if that fails."""
    from torch._functorch.aot_autograd import aot_module_simplified

    from ..frontend.decompositions import decomposition_table

    def backend(gm: torch.fx.GraphModule, example_inputs: list) -> Any:
        return aot_module_simplified(gm, example_inputs, fw_compiler=lambda g, _: g,
                                     decompositions=decomposition_table())
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return _compile_run(op, [case], backend)[0][0]
    except Exception:  # noqa: BLE001
        return None
    finally:
        torch._dynamo.reset()


def _low_precision_ok(op: Any, case: _Case, got: Any, atol: float) -> tuple[bool, str]:
    """fp16/bf16 output off eager by more than the tolerance: (passes, why)."""
    errs = _rmse_vs_float64(op, case, got, case.expected)
    if isinstance(errs, tuple) and errs[0] <= FP64_REF_RATIO * errs[1] + atol / 10:
        return True, f"off eager, as accurate vs float64 (rmse {errs[0]:.2e}, eager {errs[1]:.2e})"
    # Dynamo and the decompositions may hand torchfuse a different aten graph than the op eager runs
    # (Dynamo turns addcdiv(..., value=v) into div, mul, add; each rounds to fp16 in eager too):
    # torchfuse is then judged against eager running that same graph.
    graph = _aot_eager_outputs(op, case)
    if graph is not None:
        g_errs = _rmse_vs_float64(op, case, got, graph)
        if isinstance(g_errs, tuple) and g_errs[0] <= FP64_REF_RATIO * g_errs[1] + atol / 10:
            op_err = f", eager op {errs[1]:.2e}" if isinstance(errs, tuple) else ""
            return True, (f"off eager, as accurate vs float64 as eager running the same aten graph "
                          f"(rmse {g_errs[0]:.2e}, that graph {g_errs[1]:.2e}{op_err})")
    if isinstance(errs, str):
        return False, errs
    return False, f"less accurate than eager vs float64: rmse {errs[0]:.2e}, eager {errs[1]:.2e}"


def _check(op: Any, cases: Sequence[_Case], run: _Run, dtype: torch.dtype, device: str
           ) -> tuple[str | None, list[str]]:
    """(why the outputs do not match eager or None, notes on samples that passed by the fp64 check)."""
    atol, rtol = tolerance(op, dtype, device)
    key = op_key(op)
    values = key not in RANDOM_OPS and key not in UNINITIALIZED_OPS and \
        not getattr(op, "has_nondeterministic_output", False)
    notes: list[str] = []
    pos = 0
    for c, out in zip(cases, run.outputs):
        msg = compare(out, c.expected, atol=atol, rtol=rtol, values=values)
        if msg is not None and dtype in (torch.float16, torch.bfloat16) and values and \
                compare(out, c.expected, atol=atol, rtol=rtol, values=False) is None:
            ok, why = _low_precision_ok(op, c, out, atol)
            if ok:
                notes.append(f"sample {c.index}: {why}")
                msg = None
            else:
                msg = f"({why}) {msg}"
        if msg is None and values:
            got_inputs = run.inputs[pos:pos + len(c.tensors)]
            msg = compare(got_inputs, c.expected_inputs, atol=atol, rtol=rtol)
            msg = None if msg is None else "input mutated differently: " + msg
        if msg is not None:
            return f"sample {c.index}: {msg}", notes
        pos += len(c.tensors)
    return None, notes


def run_op(op: Any, dtype: torch.dtype = torch.float32, device: str = "cpu", max_samples: int = 3,
           options: dict | None = None, warm: bool = False) -> OpResult:
    """Compile `op`'s first `max_samples` samples with torchfuse and compare them with eager.
    `warm`: then compile and run them again, now from the graph cache the first run filled: a
    crash, a mismatch, or a graph compiled again instead of loaded is reported for the op (every
    compiled program must behave the same cold and warm)."""
    t0 = time.perf_counter()
    key, dname = op_key(op), str(dtype).replace("torch.", "")
    result = OpResult(key, dname, "skipped")
    try:
        if dtype not in op.supported_dtypes(device):
            result.detail = "dtype not supported by the op"
            return result
        try:
            cases, why = _prepare(op, dtype, device, max_samples)
        except Exception as e:  # noqa: BLE001
            result.detail = f"sample_inputs fails: {type(e).__name__}: {str(e)[:120]}"
            return result
        if not cases:
            result.detail = why or "no sample runs eagerly"
            return result
        result.samples = len(cases)
        opts = dict(options or {})
        runs = [(list(cases), _torchfuse_run(op, cases, opts))]
        if runs[0][1].error is not None and len(cases) > 1:      # find the samples that fail
            runs = [([c], _torchfuse_run(op, [c], opts)) for c in cases]
        statuses: list[tuple[str, str]] = []
        fallbacks: dict[str, None] = {}
        breaks: dict[str, None] = {}
        fp64_notes: dict[str, None] = {}
        for group, run in runs:
            result.kernels += run.kernels
            for f in run.fallbacks + [f"whole graph eager: {w}" for w in run.eager_graphs]:
                fallbacks.setdefault(f)
            for b in run.graph_breaks:
                breaks.setdefault(b)
            if run.error is not None:
                dyn = _aot_eager_ok(op, group)
                where = f"sample {group[0].index}: " if len(group) == 1 else ""
                if INTERPRETER_GAP in str(run.error):
                    # (Triton under TRITON_INTERPRET=1 on the CPU: a libdevice function the
                    # interpreter lacks; the sweep runs strict, where the graph would run eagerly)
                    statuses.append(("skipped", where + _short_error(run.error)))
                elif dyn is not None:
                    statuses.append(("skipped", f"{where}Dynamo/AOTAutograd fails without torchfuse: {dyn}"))
                else:
                    statuses.append(("crash", where + _short_error(run.error)))
                continue
            msg, notes = _check(op, group, run, dtype, device)
            if msg is None and warm:
                failed = _warm_check(op, group, opts, dtype, device)
                if failed:
                    statuses.append(failed)
                    continue
            for n in notes:
                fp64_notes.setdefault(n)
            if msg is not None:
                statuses.append(("mismatch", msg))
            elif run.graphs == 0:
                statuses.append(("skipped", "no graph reached torchfuse"))
            elif run.fallbacks or run.eager_graphs:
                statuses.append(("fallback", ""))
            else:
                statuses.append(("lowered", ""))
        worst = max(statuses, key=lambda s: _RANK[s[0]])
        result.status = worst[0]
        if result.status in ("crash", "mismatch") and key in KNOWN_FAILURES:
            statuses.append(("xfail", f"known: {KNOWN_FAILURES[key]} (was: {worst[1][:150]})"))
            result.status = "xfail"
        if result.status == "skipped" and any(s == "lowered" for s, _ in statuses):
            result.status = "lowered"
        result.fallbacks = list(fallbacks)
        details = [d for s, d in statuses if s == result.status and d]
        if breaks:
            details.append(f"graph breaks: {'; '.join(list(breaks)[:2])}")
        if fp64_notes and result.status in ("lowered", "fallback"):
            details.append("; ".join(list(fp64_notes)[:2]))
        result.detail = " | ".join(dict.fromkeys(details))
        return result
    except Exception as e:  # noqa: BLE001 - a bug of the sweep itself must not end it
        result.status = "crash"
        result.detail = f"sweep error: {_short_error(e)}"
        return result
    finally:
        torch._dynamo.reset()
        result.seconds = round(time.perf_counter() - t0, 2)


def _warm_check(op: Any, group: Sequence[_Case], opts: dict, dtype: torch.dtype,
                device: str) -> tuple[str, str] | None:
    """Run `group` again against the graph cache the cold run filled: None when it matches with
    every graph loaded, else the failing (status, detail)."""
    from .. import counters
    hits0 = counters["graph_cache_hits"]
    run = _torchfuse_run(op, group, opts, explain=False)
    if run.error is not None:
        return "crash", f"warm cache: {_short_error(run.error)}"
    msg, _ = _check(op, group, run, dtype, device)
    if msg is not None:
        return "mismatch", f"warm cache: {msg}"
    if run.graphs:
        hits = counters["graph_cache_hits"] - hits0
        return "crash", f"warm cache: {run.graphs} graph(s) compiled again ({hits} loaded)"
    return None


def sweep(ops: Sequence[Any] | None = None, dtypes: Sequence[torch.dtype] = (torch.float32,), device: str = "cpu",
          max_samples: int = 3, options: dict | None = None, log: Any = None, warm: bool = False) -> list[OpResult]:
    """In-process sweep over `ops` (OpInfos; default: the CI subset) and `dtypes` (`warm`: see run_op)."""
    ops = select_ops() if ops is None else ops
    results = []
    for op in ops:
        for dt in dtypes:
            r = run_op(op, dt, device, max_samples, options, warm=warm)
            results.append(r)
            if log is not None:
                print(f"{r.op:40s} {r.dtype:9s} {r.status:9s} {r.seconds:6.2f}s {r.detail[:100]}", file=log, flush=True)
    return results


# ----------------------------------------------------------------------------------------------
# the report
# ----------------------------------------------------------------------------------------------

def totals(results: Sequence[OpResult]) -> dict[str, int]:
    out = {s: 0 for s in STATUSES}
    for r in results:
        out[r.status] += 1
    return out


def format_table(results: Sequence[OpResult], *, title: str = "torchfuse OpInfo sweep") -> str:
    def cell(text: str, n: int = 220) -> str:
        text = text.replace("|", "\\|").replace("\n", " ")
        return text if len(text) <= n else text[:n] + "..."

    lines = [f"# {title}", "", "| op | dtype | status | samples | kernels | fallbacks / details |",
             "|---|---|---|---:|---:|---|"]
    for r in results:
        info = "; ".join(r.fallbacks[:4]) + (f" (+{len(r.fallbacks) - 4} more)" if len(r.fallbacks) > 4 else "")
        info = " | ".join(x for x in (info, r.detail) if x)
        lines.append(f"| {r.op} | {r.dtype} | {r.status} | {r.samples} | {r.kernels} | {cell(info)} |")
    t = totals(results)
    lines += ["", "**Totals** (" + f"{len(results)} op/dtype pairs): " +
              ", ".join(f"{k} {v}" for k, v in t.items()), ""]
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------------
# CLI: a worker process runs the ops; the parent restarts it after a crash or a hang
# ----------------------------------------------------------------------------------------------

def _worker(ops_file: str, dtypes: list[str], device: str, max_samples: int, out_file: str) -> None:
    keys = [k for k in open(ops_file).read().split("\n") if k]
    by_key = {op_key(o): o for o in op_db()}
    with open(out_file, "a") as out:
        for key in keys:
            for dn in dtypes:
                out.write(json.dumps({"start": key, "dtype": dn}) + "\n")
                out.flush()
                r = run_op(by_key[key], getattr(torch, dn), device, max_samples)
                out.write(json.dumps(asdict(r)) + "\n")
                out.flush()


def _read_progress(path: str) -> tuple[list[OpResult], tuple[str, str] | None]:
    results: list[OpResult] = []
    pending = None
    with open(path) as f:
        for line in f:
            line = line.strip()
            if not line:
                continue
            try:
                d = json.loads(line)
            except json.JSONDecodeError:
                continue
            if "start" in d:
                pending = (d["start"], d["dtype"])
            else:
                results.append(OpResult(**d))
                pending = None
    return results, pending


def run_isolated(keys: Sequence[str], dtypes: Sequence[str], device: str, max_samples: int,
                 op_timeout: float, verbose: bool = True) -> list[OpResult]:
    """Run the sweep in worker processes; an op that kills or hangs its worker is a crash."""
    todo = [(k, d) for k in keys for d in dtypes]
    done: list[OpResult] = []
    with tempfile.TemporaryDirectory(prefix="tf_sweep_") as tmp:
        while todo:
            ops_file, out_file = os.path.join(tmp, "ops.txt"), os.path.join(tmp, "progress.jsonl")
            remaining_keys = list(dict.fromkeys(k for k, _ in todo))
            with open(ops_file, "w") as f:
                f.write("\n".join(remaining_keys) + "\n")
            open(out_file, "w").close()
            cmd = [sys.executable, "-m", "torchfuse.tools.opinfo_sweep", "--worker", ops_file, out_file,
                   "--dtypes", ",".join(dtypes), "--device", device, "--max-samples", str(max_samples)]
            proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
            seen, last_change, last_size = 0, time.time(), 0
            stalled = None
            while proc.poll() is None:
                time.sleep(0.5)
                size = os.path.getsize(out_file)
                if size != last_size:
                    last_size, last_change = size, time.time()
                    results, _ = _read_progress(out_file)
                    for r in results[seen:]:
                        if verbose:
                            print(f"{r.op:45s} {r.dtype:9s} {r.status:9s} {r.seconds:6.1f}s {r.detail[:90]}",
                                  file=sys.stderr, flush=True)
                    seen = len(results)
                elif time.time() - last_change > op_timeout:
                    _, stalled = _read_progress(out_file)
                    proc.kill()
                    proc.wait()
                    break
            err = proc.stderr.read() if proc.stderr else ""
            results, pending = _read_progress(out_file)
            if verbose:
                for r in results[seen:]:
                    print(f"{r.op:45s} {r.dtype:9s} {r.status:9s} {r.seconds:6.1f}s {r.detail[:90]}",
                          file=sys.stderr, flush=True)
            done += results
            finished = {(r.op, r.dtype) for r in results}
            todo = [t for t in todo if t not in finished]
            if pending is not None and pending in todo:
                why = f"timed out after {op_timeout:.0f}s" if stalled else \
                    f"worker died (exit code {proc.returncode}): {err.strip().splitlines()[-1][:200] if err.strip() else ''}"
                r = OpResult(pending[0], pending[1], "crash", detail=why)
                done.append(r)
                if verbose:
                    print(f"{r.op:45s} {r.dtype:9s} {r.status:9s} {why}", file=sys.stderr, flush=True)
                todo.remove(pending)
            elif proc.returncode not in (0, None) and pending is None and todo:
                raise RuntimeError(f"sweep worker failed before its first op:\n{err[-3000:]}")
    order = {(k, d): i for i, (k, d) in enumerate((k, d) for k in keys for d in dtypes)}
    return sorted(done, key=lambda r: order.get((r.op, r.dtype), 0))


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m torchfuse.tools.opinfo_sweep", description=__doc__.split("\n")[0])
    p.add_argument("--all", action="store_true", help="every OpInfo instead of the fast subset")
    p.add_argument("--ops", default="", help="comma-separated OpInfo names or name.variant keys")
    p.add_argument("--dtypes", default="float32", help="comma-separated torch dtype names")
    p.add_argument("--device", default="cpu")
    p.add_argument("--max-samples", type=int, default=3, help="sample inputs per op (default 3)")
    p.add_argument("--op-timeout", type=float, default=300.0, help="seconds before a silent op counts as a crash")
    p.add_argument("--out", default="", help="also write the markdown table to this file")
    p.add_argument("--json", default="", help="also write the results as JSON to this file")
    p.add_argument("--in-process", action="store_true", help="no worker process (a segfault ends the sweep)")
    p.add_argument("--quiet", action="store_true")
    p.add_argument("--warm", action="store_true",
                   help="run each op a second time from the graph cache the first run filled (in-process only)")
    p.add_argument("--options", default="",
                   help='torchfuse options as JSON, e.g. \'{"cpu_backend": "triton"}\' (Triton under '
                        'TRITON_INTERPRET=1 on the CPU; in-process runs only: --in-process or --warm)')
    p.add_argument("--worker", nargs=2, metavar=("OPS_FILE", "OUT_FILE"), help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    dtypes = [d.strip().replace("torch.", "") for d in a.dtypes.split(",") if d.strip()]
    for d in dtypes:
        if not isinstance(getattr(torch, d, None), torch.dtype):
            p.error(f"unknown dtype {d!r}")
    if a.worker:
        _worker(a.worker[0], dtypes, a.device, a.max_samples, a.worker[1])
        return 0
    names = [n.strip() for n in a.ops.split(",") if n.strip()]
    ops = select_ops(names or None, all_ops=a.all)
    t0 = time.time()
    options = json.loads(a.options) if a.options else None
    if options and not (a.in_process or a.warm):
        p.error("--options needs --in-process or --warm")
    if a.in_process or a.warm:
        results = sweep(ops, [getattr(torch, d) for d in dtypes], a.device, a.max_samples, options=options,
                        log=None if a.quiet else sys.stderr, warm=a.warm)
    else:
        results = run_isolated([op_key(o) for o in ops], dtypes, a.device, a.max_samples, a.op_timeout,
                               verbose=not a.quiet)
    title = f"torchfuse OpInfo sweep ({'all ops' if a.all and not names else 'subset' if not names else 'selected ops'}, " \
            f"{', '.join(dtypes)}, {a.device}, {a.max_samples} samples/op, {time.time() - t0:.0f} s)"
    table = format_table(results, title=title)
    print(table)
    if a.out:
        with open(a.out, "w") as f:
            f.write(table)
    if a.json:
        with open(a.json, "w") as f:
            json.dump([asdict(r) for r in results], f, indent=1)
    t = totals(results)
    return 1 if t["mismatch"] or t["crash"] else 0


if __name__ == "__main__":
    sys.exit(main())
