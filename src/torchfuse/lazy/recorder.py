"""Recording a predicted op: one small function per trie step, generated from the step.

A step of the trie (trace.py) fixes everything about an op but the identity of its pending
inputs: the number and kind of its arguments, the trace position of each pending one, the
value of each scalar, the layout of each real tensor, the recording plan (argument template,
output layout, wrapper arguments), and even which trace position a view's root is at (a view
chain follows pending values made by the path's own steps).  `recorder(step, trace)` turns
that into straight-line Python: the specs become comparisons against constants, the node and
its wrapper are built from constants, and what the step makes unnecessary is left out (output
index checks of single-output producers; the elements written, counted only on CUDA where
pipelining reads them; the view bookkeeping of non-views).  The generic path
(`trace.match` + `mode._record_predicted`) does the same with loops over specs and lookups
in the plan and step; this runs for every recorded op of a program seen before.

The source is generated once per *pattern* (argument kinds, keyword names and the flags
above) and compiled into a factory; each step calls its pattern's factory with its own
constants (closure cells), so a model's hundreds of steps share a few dozen code objects.
Steps the generator does not cover (lists of tensors, several outputs, factories) keep the
generic path.  `dispatcher(cands)` is what the mode calls for an op the cursor predicts: the
recorder of the only candidate step, or a loop over several.
"""
from __future__ import annotations

import logging
import weakref
from typing import TYPE_CHECKING, Any, Callable

import torch

from .graph import LazyNode, view_root
from .tensor import LazyTensor
from .trace import _FLOAT, _PENDING, _REAL, _VALUE, Step

if TYPE_CHECKING:
    from .context import LazyContext

log = logging.getLogger("torchfuse.lazy")

Recorder = Callable[["LazyContext", tuple, Any], Any]

# (ctx, plan, depth) -> why everything pending must be computed first, or None; set by mode.py
flush_first: Callable[..., str | None]
# ctx -> None: the first op of a backward pass (mode._note_graph_task); set by mode.py
note_graph_task: Callable[..., None]

_MISSING = object()          # a keyword argument the call does not pass
_FACTORIES: dict[tuple, Callable[..., Recorder]] = {}

# what the generated code reads besides its closure
_NAMESPACE = {
    "LT": LazyTensor, "Tensor": torch.Tensor, "Parameter": torch.nn.Parameter, "Node": LazyNode,
    "mw": torch.Tensor._make_wrapper_subclass, "wref": weakref.ref,
    "gtid": torch._C._current_graph_task_id, "MISSING": _MISSING,
}


def _arg_check(kind: int, a: str, c: str, single: bool) -> tuple[list[str], str | None]:
    """Lines that return None unless argument `a` (a local) satisfies the spec whose constants
    are named `c...`, and the expression of the node input it gives (None: not a tensor)."""
    if kind == _PENDING:
        # `_lz_node is trace[pos]` implies pending: computing a wrapper clears its _lz_node
        idx = "" if single else f" or {a}._lz_idx != {c}k"
        return [f"{a}n = tr[{c}p]",
                f"if type({a}) is not LT or {a}._lz_node is not {a}n{idx}: return None"], f"({a}n, {c}k)"
    if kind == _VALUE:
        return [f"if type({a}) is not {c}t or {a} != {c}v: return None"], None
    if kind == _FLOAT:      # by repr as well: -0.0 != 0.0 (see trace._match_arg)
        return [f"if type({a}) is not float or {a} != {c}v or ({a} == 0.0 and repr({a}) != {c}r): "
                "return None"], None
    # _REAL: a plain tensor or parameter, or a computed LazyTensor, of this exact layout
    return [f"t = type({a})",
            "if t is LT:",
            f"    {a} = {a}._lz_real",
            f"    if {a} is None: return None",
            "elif t is not Tensor and t is not Parameter: return None",
            f"if {a}.dtype is not {c}dt or {a}.size() != {c}sz or {a}.stride() != {c}st or "
            f"{a}.storage_offset() != {c}of or {a}.device != {c}dv: return None"], a


def _consts(spec: tuple, c: str, out: dict) -> None:
    kind = spec[0]
    if kind == _PENDING:
        out[f"{c}p"], out[f"{c}k"] = spec[1], spec[2]
    elif kind == _VALUE:
        out[f"{c}t"], out[f"{c}v"] = spec[1], spec[2]
    elif kind == _FLOAT:
        out[f"{c}v"], out[f"{c}r"] = spec[1], spec[2]
    else:
        _, out[f"{c}dt"], out[f"{c}sz"], out[f"{c}st"], out[f"{c}of"], out[f"{c}dv"] = spec


def _source(pattern: tuple, names: list[str]) -> str:
    kinds, singles, kwnames, kwkinds, kwsingles, cuda, count_work, view_root_at, strided, offset = pattern
    checks: list[str] = []
    ins: list[str] = []
    for i, (kind, single) in enumerate(zip(kinds, singles)):
        lines, ref = _arg_check(kind, f"a{i}", f"a{i}_", single)
        checks += lines
        ins += [ref] if ref else []
    for j, (name, kind, single) in enumerate(zip(kwnames, kwkinds, kwsingles)):
        lines, ref = _arg_check(kind, f"w{j}", f"w{j}_", single)
        checks += [f"w{j} = kwargs.get({name!r}, MISSING)"] + lines
        ins += [ref] if ref else []
    body = ["if kwargs: return None" if not kwnames else
            f"if not kwargs or len(kwargs) != {len(kwnames)}: return None",
            f"if len(args) != {len(kinds)}: return None"]
    if kinds:
        body.append(f"{', '.join(f'a{i}' for i in range(len(kinds)))}, = args")
    body.append("tr = ctx.trace")
    if _REAL in kinds or _REAL in kwkinds:
        # (free when nothing raises) stride() of a sparse tensor, ...: not this step
        body += ["try:"] + ["    " + c for c in checks] + \
            ["except (RuntimeError, NotImplementedError):", "    return None"]
    else:
        body += checks
    extra = (", strides=stride" if strided else "") + (", storage_offset=offset" if offset else "")
    body += [
        f"if ctx.recorded >= ctx.{'flush_check_from' if cuda else 'flush_check_from_cpu'} or "
        "depth > ctx.max_nodes:",
        "    if flush_first(ctx, plan, depth) is not None: return None",
        f"w = mw(LT, size, dtype=dtype, device=device{extra})",
        "ref = wref(w)",
        f"node = Node(plan, [{', '.join(ins)}], depth, len(tr), [ref])",
        "w._lz_node = node",
        "w._lz_idx = 0",
        "w._lz_real = None",
        "tr.append(node)",
    ]
    if count_work:
        body.append("ctx.work += work")
    if view_root_at:
        body.append("tr[root_at].has_views = True")
    body += [
        "ctx.cursor = step",
        "ctx.trace_hits += 1",
        "ctx.recorded += 1",
        "if gtid() != ctx.backward_task: note_graph_task(ctx)",
        "live = ctx.live",
        "live.append(ref)",
        "if len(live) > 4 * ctx.max_nodes: ctx.pending_values()   # prune dead and computed entries",
        "return w",
    ]
    lines = [f"def factory({', '.join(names)}):",
             "    def record(ctx, args, kwargs):"]
    lines += ["        " + b for b in body]
    lines.append("    return record")
    return "\n".join(lines)


def recorder(step: Step, trace: list) -> Recorder | None:
    """The recording function of `step`, just learnt: its node is the last of `trace`.
    (ctx, args, kwargs) -> the op's output wrapper, or None when the arguments do not match the
    step or a flush must come first (the caller then takes the generic path).  None for steps
    the generator does not cover."""
    plan = step.plan
    if plan.container is not None or step.device is not None or len(plan.descs) != 1:
        return None
    specs, kwspecs = step.specs, step.kwspecs
    if any(s[0] not in (_PENDING, _VALUE, _FLOAT, _REAL) for s in (*specs, *kwspecs)):
        return None
    node = trace[-1]
    root_at = None
    if step.is_view and type(node.inputs[0]) is tuple:
        # The root a view marks is made by a step of this path too, at a fixed position.
        root = view_root(*node.inputs[0])
        if root is not None:
            root_at = root[0].tpos
            if not (0 <= root_at < len(trace) and trace[root_at] is root[0]):
                return None
    size, stride, offset, dtype = plan.descs[0]
    wrap_kw = plan.wrap_kw
    consts: dict[str, Any] = {
        "step": step, "plan": plan, "device": plan.device, "depth": step.depth, "work": plan.work,
        "size": size, "stride": wrap_kw.get("strides"), "offset": wrap_kw.get("storage_offset", 0),
        "dtype": dtype, "root_at": root_at, "flush_first": flush_first, "note_graph_task": note_graph_task,
    }
    for i, s in enumerate(specs):
        _consts(s, f"a{i}_", consts)
    for j, s in enumerate(kwspecs):
        _consts(s, f"w{j}_", consts)
    # A pending input made by a single-output node needs no output index check: the node at a
    # trace position of this path is always made by the same ancestor step.
    singles = tuple(s[0] == _PENDING and len(trace[s[1]].descs) == 1 for s in specs)
    kwsingles = tuple(s[0] == _PENDING and len(trace[s[1]].descs) == 1 for s in kwspecs)
    cuda = plan.device.type == "cuda"
    pattern = (tuple(s[0] for s in specs), singles, step.kwnames, tuple(s[0] for s in kwspecs), kwsingles,
               cuda, cuda and plan.work > 0, root_at is not None, "strides" in wrap_kw, "storage_offset" in wrap_kw)
    factory = _FACTORIES.get(pattern)
    names = sorted(consts)
    if factory is None:
        ns = dict(_NAMESPACE)
        exec(compile(_source(pattern, names), f"<torchfuse lazy recorder {len(_FACTORIES)}>", "exec"), ns)
        factory = _FACTORIES[pattern] = ns["factory"]
    return factory(**consts)


def dispatcher(cands: list[Step]) -> Recorder:
    """What the mode calls for an op predicted after a step: the recorder of its only candidate
    step, or one trying each candidate in turn."""
    recs = [s.record for s in cands]
    if len(recs) == 1:
        return recs[0]

    def first_match(ctx: "LazyContext", args: tuple, kwargs: Any) -> Any:
        for rec in recs:
            out = rec(ctx, args, kwargs)
            if out is not None:
                return out
        return None
    return first_match
