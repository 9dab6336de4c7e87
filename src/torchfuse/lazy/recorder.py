"""Recording a predicted op: one small function per trie step, generated from the step.

A step of the trie (trace.py) fixes everything about an op but the identity of its pending
inputs: the number and kind of its arguments, the trace position of each pending one, the
value of each scalar, the layout of each real tensor, the recording plan (argument template,
output layout, wrapper arguments), and even which trace position a view's root is at (a view
chain follows pending values made by the path's own steps).  `recorder(step, trace)` turns
that into straight-line Python: the specs become comparisons against constants, the node and
its wrapper are built from constants, and what the step makes unnecessary is left out (output
index checks of single-output producers; the elements written, counted only on CUDA where
pipelining reads them; the view bookkeeping of non-views).  This runs for every recorded op of
a program seen before: a generic matcher (loops over the specs, lookups in the plan and step)
cost about twice the Python per op.  Recording from a step without asking `mode.dispatch` is
sound because its decision depends only on the op, the block's options (the trie's root) and
what the step's specs fix.

The source is generated once per *pattern* (argument kinds, keyword names and the flags
above) and compiled into a factory; each step calls its pattern's factory with its own
constants (closure cells), so a model's hundreds of steps share a few dozen code objects.
`dispatcher(cands)` is what the mode calls for an op the cursor predicts: the
recorder of the only candidate step, or a loop over several.
"""
from __future__ import annotations

import logging
import weakref
from typing import TYPE_CHECKING, Any, Callable

import torch

from .graph import LazyNode, view_root
from .tensor import LazyTensor
from .trace import _FLOAT, _PENDING, _REAL, _TLIST, _VALUE, Step

if TYPE_CHECKING:
    from .context import LazyContext

log = logging.getLogger("torchfuse.lazy")

Recorder = Callable[["LazyContext", tuple, Any], Any]


def _unset(*args: Any) -> Any:
    raise RuntimeError("torchfuse.lazy: recorder used before torchfuse.lazy.mode was imported")


# (ctx, plan, depth) -> why everything pending must be computed first, or None; set by mode.py
flush_first: Callable[..., str | None] = _unset
# ctx -> None: the first op of a backward pass (mode._note_graph_task); set by mode.py
note_graph_task: Callable[..., None] = _unset

_MISSING = object()          # a keyword argument the call does not pass
_FACTORIES: dict[tuple, Callable[..., Recorder]] = {}

# what the generated code reads besides its closure
_NAMESPACE = {
    "LT": LazyTensor, "Tensor": torch.Tensor, "Parameter": torch.nn.Parameter, "Node": LazyNode,
    "mw": torch.Tensor._make_wrapper_subclass, "wref": weakref.ref,
    "gtid": torch._C._current_graph_task_id, "MISSING": _MISSING, "get_default_device": torch.get_default_device,
}


def _arg_check(spec: tuple, a: str, c: str, consts: dict, trace: list) -> tuple[list[str], list[str], tuple]:
    """For argument `a` (a local) and its spec: lines that return None unless `a` satisfies the
    spec, the expressions of the node inputs it gives, and its part of the pattern.  The spec's
    constants go into `consts` under names starting with `c`."""
    kind = spec[0]
    if kind == _PENDING:
        consts[f"{c}p"], consts[f"{c}k"] = spec[1], spec[2]
        # A pending input made by a single-output node needs no output index check: the node at
        # a trace position of this path is always made by the same ancestor step.
        # (`_lz_node is trace[pos]` implies pending: computing a wrapper clears its _lz_node.)
        single = len(trace[spec[1]].descs) == 1
        idx = "" if single else f" or {a}._lz_idx != {c}k"
        return [f"{a}n = tr[{c}p]",
                f"if type({a}) is not LT or {a}._lz_node is not {a}n{idx}: return None"], \
            [f"({a}n, {c}k)"], (kind, single)
    if kind == _VALUE:
        consts[f"{c}t"], consts[f"{c}v"] = spec[1], spec[2]
        return [f"if type({a}) is not {c}t or {a} != {c}v: return None"], [], (kind,)
    if kind == _FLOAT:      # by repr as well: -0.0 != 0.0 (nan never matches: a miss, not an error)
        consts[f"{c}v"], consts[f"{c}r"] = spec[1], spec[2]
        return [f"if type({a}) is not float or {a} != {c}v or ({a} == 0.0 and repr({a}) != {c}r): "
                "return None"], [], (kind,)
    if kind == _REAL:       # a plain tensor or parameter, or a computed LazyTensor, of this layout
        _, consts[f"{c}dt"], consts[f"{c}sz"], consts[f"{c}st"], consts[f"{c}of"], consts[f"{c}dv"] = spec
        return [f"t = type({a})",
                "if t is LT:",
                f"    {a} = {a}._lz_real",
                f"    if {a} is None: return None",
                "elif t is not Tensor and t is not Parameter: return None",
                f"if {a}.dtype is not {c}dt or {a}.size() != {c}sz or {a}.stride() != {c}st or "
                f"{a}.storage_offset() != {c}of or {a}.device != {c}dv: return None"], [a], (kind,)
    # _TLIST: a list (or tuple) of tensors, cat's and stack's
    consts[f"{c}t"] = spec[1]
    lines = [f"if type({a}) is not {c}t or len({a}) != {len(spec[2])}: return None",
             f"{', '.join(f'{a}_{j}' for j in range(len(spec[2])))}, = {a}"]
    ins: list[str] = []
    parts = []
    for j, s in enumerate(spec[2]):
        more, refs, part = _arg_check(s, f"{a}_{j}", f"{c}{j}_", consts, trace)
        lines += more
        ins += refs
        parts.append(part)
    return lines, ins, (kind, tuple(parts))


def _has_real(specs: tuple) -> bool:
    return any(s[0] == _REAL or (s[0] == _TLIST and _has_real(s[2])) for s in specs)


def _contiguous(size: torch.Size) -> tuple:
    return torch.empty(size, device="meta").stride()


def _source(pattern: tuple, names: list[str], checks: list[str], ins: list[str]) -> str:
    """The factory of a pattern's recorders (see `recorder` for what the pattern holds)."""
    _, kwnames, nargs, outputs, container, has_real, factory, cuda, count_work, marks_root = pattern
    body = ["if kwargs: return None" if not kwnames else
            f"if not kwargs or len(kwargs) != {len(kwnames)}: return None",
            f"if len(args) != {nargs}: return None"]
    if nargs:
        body.append(f"{', '.join(f'a{i}' for i in range(nargs))}, = args")
    body.append("tr = ctx.trace")
    if has_real:
        # (free when nothing raises) stride() of a sparse tensor, ...: not this step
        body += ["try:"] + ["    " + c for c in checks] + \
            ["except (RuntimeError, NotImplementedError):", "    return None"]
    else:
        body += checks
    if factory:      # where a factory without device= allocates
        body.append("if get_default_device() != factory_device: return None")
    body += [
        f"if ctx.recorded >= ctx.{'flush_check_from' if cuda else 'flush_check_from_cpu'} or "
        "depth > ctx.max_nodes:",
        "    if flush_first(ctx, plan, depth) is not None: return None",
    ]
    refs = []
    for k, (kind, strided, offset) in enumerate(outputs):
        if kind != "tensor":
            refs.append("None")
            continue
        extra = (f", strides=stride{k}" if strided else "") + (f", storage_offset=offset{k}" if offset else "")
        body += [f"w{k} = mw(LT, size{k}, dtype=dtype{k}, device=device{extra})", f"ref{k} = wref(w{k})"]
        refs.append(f"ref{k}")
    body.append(f"node = Node(plan, [{', '.join(ins)}], depth, len(tr), [{', '.join(refs)}])")
    for k, (kind, _, _) in enumerate(outputs):
        if kind == "tensor":
            body += [f"w{k}._lz_node = node", f"w{k}._lz_idx = {k}", f"w{k}._lz_real = None"]
    body.append("tr.append(node)")
    if count_work:
        body.append("ctx.work += work")
    if marks_root:
        body.append("tr[root_at].has_views = True")
    body += [
        "ctx.cursor = step",
        "ctx.trace_hits += 1",
        "ctx.recorded += 1",
        "if gtid() != ctx.backward_task: note_graph_task(ctx)",
    ]
    live = [r for r in refs if r != "None"]
    if len(live) == 1:
        body.append(f"ctx.live.append({live[0]})")
    else:
        # (one op adds several: the list can outgrow what `recorded` bounds)
        body += ["live = ctx.live", f"live.extend(({', '.join(live)},))",
                 "if len(live) > 4 * ctx.max_nodes: ctx.pending_values()   # prune dead and computed entries"]
    outs = [f"w{k}" if kind == "tensor" else f"const{k}" for k, (kind, _, _) in enumerate(outputs)]
    body.append(f"return container([{', '.join(outs)}])" if container else "return w0")
    lines = [f"def factory({', '.join(names)}):",
             "    def record(ctx, args, kwargs):"]
    lines += ["        " + b for b in body]
    lines.append("    return record")
    return "\n".join(lines)


def recorder(step: Step, trace: list) -> Recorder | None:
    """The recording function of `step`, just learnt: its node is the last of `trace`.
    (ctx, args, kwargs) -> the op's output(s), or None when the arguments do not match the
    step or a flush must come first (the mode then records the op the ordinary way).  None
    where the step's node cannot stand for every node the step records (a view whose root is
    not in the trace: not expected, since the specs of a path's views point into its trace)."""
    plan = step.plan
    node = trace[-1]
    root_at = None
    if step.is_view and type(node.inputs[0]) is tuple:
        # The root a view marks is made by a step of this path too, at a fixed position.
        root = view_root(*node.inputs[0])
        if root is not None:
            root_at = root[0].tpos
            if not (0 <= root_at < len(trace) and trace[root_at] is root[0]):
                return None
    consts: dict[str, Any] = {
        "step": step, "plan": plan, "device": plan.device, "depth": step.depth, "work": plan.work,
        "root_at": root_at, "container": plan.container, "factory_device": step.device,
        "flush_first": flush_first, "note_graph_task": note_graph_task,
    }
    checks: list[str] = []
    ins: list[str] = []
    parts = []
    for i, s in enumerate(step.specs):
        lines, refs, part = _arg_check(s, f"a{i}", f"a{i}_", consts, trace)
        checks += lines
        ins += refs
        parts.append(part)
    for j, (name, s) in enumerate(zip(step.kwnames, step.kwspecs)):
        lines, refs, part = _arg_check(s, f"k{j}", f"k{j}_", consts, trace)
        checks += [f"k{j} = kwargs.get({name!r}, MISSING)"] + lines
        ins += refs
        parts.append(part)
    outputs = []
    for k, d in enumerate(plan.descs):
        if type(d) is not tuple:          # None or an int (see graph.output_descs)
            consts[f"const{k}"] = d
            outputs.append(("const", False, False))
            continue
        size, stride, offset, dtype = d
        consts[f"size{k}"], consts[f"stride{k}"], consts[f"offset{k}"], consts[f"dtype{k}"] = size, stride, offset, dtype
        # (_make_wrapper_subclass takes an offset only with strides)
        outputs.append(("tensor", offset != 0 or stride != _contiguous(size), offset != 0))
    if plan.container is None and (len(outputs) != 1 or outputs[0][0] != "tensor"):
        return None
    cuda = plan.gpu
    has_real = _has_real((*step.specs, *step.kwspecs))
    pattern = (tuple(parts), step.kwnames, len(step.specs), tuple(outputs), plan.container is not None, has_real,
               step.device is not None, cuda, cuda and plan.work > 0, root_at is not None)
    factory = _FACTORIES.get(pattern)
    names = sorted(consts)
    if factory is None:
        ns = dict(_NAMESPACE)
        exec(compile(_source(pattern, names, checks, ins), f"<torchfuse lazy recorder {len(_FACTORIES)}>", "exec"),
             ns)
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
