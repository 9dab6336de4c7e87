"""Op prediction: a trie of recorded op sequences, so a program seen before is re-recorded with
comparisons instead of keys, and flushed without a graph signature.

A lazy block records the same ops in the same order every step of a loop (every forward pass
of a model).  Each block keeps a *trace*: the nodes recorded since its last flush, in order,
and a cursor into a process-wide trie of `Step`s.  A step is one recorded op with what its
arguments were: a pending value by its position in the trace, a real tensor by its layout
(dtype, sizes, strides, offset, device), anything else by value.  Recording an op first tries
the cursor's children: a match costs identity and equality comparisons, and the step's `Plan`
(argument template, output layouts, from the op's meta kernel once) gives the node and its
wrapper -- no key tuple is built or hashed.  A miss records the op the usual way (`mode`) and
adds a step.

Since a trie path fixes the whole pending graph (ops, scalars, how nodes connect, leaf layouts),
a flush whose trace ends at a step seen flushing before, with the same values requested and
alive, replays that flush (a `Replay`, run by `graph.try_replay`): the compiled graph it used,
which of the nodes' inputs are its leaves, which outputs go to which nodes -- no topological
sort, no signature, no cache lookup.  Anything unusual (an in-place op recorded functionally, a pending input recorded before
the last flush, a node computed meanwhile) only turns the prediction off until the next flush:
the ordinary path is always correct.

Counters: `lazy_replays` (flushes replayed), `lazy_signatures` (flushes that built a
signature); per block, `trace_hits` / `trace_misses` (ops predicted or not).
"""
from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import torch

from .tensor import LazyTensor

if TYPE_CHECKING:
    from .cache import Entry
    from .context import LazyContext
    from .graph import LazyNode

log = logging.getLogger("torchfuse.lazy")

MAX_STEPS = 1 << 16         # trie size bound: past it the trie starts over
MAX_VARIANTS = 16           # steps of one op kept after the same step (argument variants)
_num_steps = 0
_ROOTS: dict[tuple, "Step"] = {}

# argument specs (see Step.specs)
_PENDING, _REAL, _VALUE, _TLIST, _FLOAT = 0, 1, 2, 3, 4


class Step:
    """One recorded op of a trie path: the op, a spec per argument, its recording plan, the
    steps seen after it, and the flushes seen ending at it."""
    __slots__ = ("func", "specs", "kwspecs", "kwnames", "plan", "children", "replays", "device",
                 "is_view", "depth", "record", "recs")

    def __init__(self, func: Any, specs: tuple, kwnames: tuple, kwspecs: tuple, plan: Any, device: Any,
                 is_view: bool = False, depth: int = 0):
        self.func, self.plan = func, plan
        self.is_view, self.depth = is_view, depth   # of the node (the same on every match)
        self.specs, self.kwnames, self.kwspecs = specs, kwnames, kwspecs
        self.device = device             # torch.get_default_device() for a factory, else None
        self.children: dict[int, list[Step]] = {}
        self.replays: dict[tuple, Replay] = {}
        # (ctx, args, kwargs) -> output or None: recording this step (recorder.py)
        self.record: Any = None
        # id(op) -> the recorder of the children for that op (recorder.dispatcher)
        self.recs: dict[int, Any] = {}


def root_for(ctx: "LazyContext") -> Step:
    """The trie root of a block's recording decisions (its config and defer_matmuls)."""
    key = (ctx.token, ctx.defer_matmuls)
    root = _ROOTS.get(key)
    if root is None:
        root = _ROOTS[key] = Step(None, (), (), (), None, None)
    return root


def clear() -> None:
    global _num_steps
    _ROOTS.clear()
    _num_steps = 0


def reset(ctx: "LazyContext") -> None:
    """Start a new trace (after a flush): predictions continue from the root."""
    ctx.trace = []
    ctx.cursor = root_for(ctx)


def stop(ctx: "LazyContext") -> None:
    """No prediction (and no replay) until the next flush."""
    ctx.cursor = None


# --------------------------------------------------------------------------------------------
# matching an op against the cursor's children
# --------------------------------------------------------------------------------------------

def _match_arg(spec: tuple, a: Any, trace: list, inputs: list) -> bool:
    kind = spec[0]
    if kind == _PENDING:
        if type(a) is not LazyTensor or a._lz_real is not None or a._lz_node is not trace[spec[1]] \
                or a._lz_idx != spec[2]:
            return False
        inputs.append((a._lz_node, spec[2]))
        return True
    if kind == _VALUE:
        return type(a) is spec[1] and a == spec[2]
    if kind == _FLOAT:      # by repr too: -0.0 != 0.0 (nan never matches: a miss, not an error)
        return type(a) is float and a == spec[1] and (a != 0.0 or repr(a) == spec[2])
    if kind == _REAL:
        t = type(a)
        if t is LazyTensor:
            a = a._lz_real
            if a is None:
                return False
        elif t is not torch.Tensor and t is not torch.nn.Parameter:
            return False
        _, dtype, size, stride, offset, device = spec
        if a.dtype is not dtype or a.size() != size or a.stride() != stride or \
                a.storage_offset() != offset or a.device != device:
            return False
        inputs.append(a)
        return True
    # _TLIST: a list of tensors (cat, stack)
    if type(a) is not spec[1] or len(a) != len(spec[2]):
        return False
    for s, x in zip(spec[2], a):
        if not _match_arg(s, x, trace, inputs):
            return False
    return True


def match(cands: list[Step], trace: list, args: tuple, kwargs: dict | None) -> tuple[Step, list] | None:
    """The step of `cands` (children of the cursor, for one op) whose specs `args`/`kwargs`
    satisfy, and the node inputs it gives, or None.  The common specs are checked inline: this
    runs for every recorded op."""
    nargs = len(args)
    for step in cands:
        specs = step.specs
        if len(specs) != nargs:
            continue
        inputs: list = []
        try:
            for s, a in zip(specs, args):
                kind = s[0]
                if kind == _PENDING:
                    if type(a) is LazyTensor and a._lz_node is trace[s[1]] and a._lz_real is None \
                            and a._lz_idx == s[2]:
                        inputs.append((a._lz_node, s[2]))
                        continue
                    break
                if kind == _VALUE:
                    if type(a) is s[1] and a == s[2]:
                        continue
                    break
                if not _match_arg(s, a, trace, inputs):
                    break
            else:
                if kwargs or step.kwnames:
                    if tuple(kwargs) != step.kwnames or not all(
                            _match_arg(s, kwargs[n], trace, inputs) for s, n in zip(step.kwspecs, step.kwnames)):
                        continue
                if step.device is not None and torch.get_default_device() != step.device:
                    continue
                return step, inputs
        except (RuntimeError, NotImplementedError):     # stride() of a sparse tensor, ...
            continue
    return None


# --------------------------------------------------------------------------------------------
# learning a step from an op recorded the usual way
# --------------------------------------------------------------------------------------------

class _NoSpec(Exception):
    pass


def _spec_of(a: Any, trace: list) -> tuple:
    t = type(a)
    if t is LazyTensor:
        if a._lz_real is None:
            node = a._lz_node
            pos = node.tpos
            if pos < 0 or pos >= len(trace) or trace[pos] is not node:
                raise _NoSpec("a pending input recorded before the trace began")
            return (_PENDING, pos, a._lz_idx)
        a = a._lz_real
        t = type(a)
    if t is torch.Tensor or t is torch.nn.Parameter:
        return (_REAL, a.dtype, a.size(), a.stride(), a.storage_offset(), a.device)
    if t is float:
        if a != a:
            raise _NoSpec("nan")        # never equal to itself: it would be learnt on every call
        return (_FLOAT, a, repr(a))
    if (t is list or t is tuple) and any(isinstance(x, torch.Tensor) for x in a):
        return (_TLIST, t, tuple(_spec_of(x, trace) for x in a))
    if t is list or t is tuple:
        if not all(type(x) is int for x in a):     # (floats in a list: -0.0 == 0.0)
            raise _NoSpec("a list of non-integers")
        return (_VALUE, t, a if t is tuple else list(a))
    if t in (bool, int, str, type(None), torch.dtype, torch.device, torch.layout, torch.memory_format):
        return (_VALUE, t, a)
    raise _NoSpec(f"argument of type {t.__name__}")


def learn(ctx: "LazyContext", func: Any, args: tuple, kwargs: dict, plan: Any, node: "LazyNode") -> Step | None:
    """`node` was recorded without a prediction: add its step below the cursor, move there.
    Returns the step (None: prediction is off until the next flush)."""
    global _num_steps
    try:
        specs = tuple(_spec_of(a, ctx.trace) for a in args)
        kwnames = tuple(kwargs)
        kwspecs = tuple(_spec_of(kwargs[n], ctx.trace) for n in kwnames)
    except _NoSpec as e:
        log.debug("lazy: no prediction for %s: %s", func, e)
        stop(ctx)
        return None
    has_tensor = any(s[0] in (_PENDING, _REAL, _TLIST) for s in (*specs, *kwspecs))
    step = Step(func, specs, kwnames, kwspecs, plan, None if has_tensor else torch.get_default_device(),
                node.is_view, node.depth)
    cands = ctx.cursor.children.setdefault(id(func), [])
    if len(cands) >= MAX_VARIANTS:
        # the oldest variant goes (the first op of a trace has one per program seen; an op
        # whose scalar changes every call churns here instead of slowing every match)
        del cands[0]
    if _num_steps >= MAX_STEPS:
        clear()               # the cursor's detached subtree lives on until the next flush
    _num_steps += 1
    cands.append(step)
    advance(ctx, step, node)
    return step


def advance(ctx: "LazyContext", step: Step, node: "LazyNode") -> None:
    node.tpos = len(ctx.trace)
    ctx.trace.append(node)
    ctx.cursor = step


# --------------------------------------------------------------------------------------------
# replaying a flush
# --------------------------------------------------------------------------------------------

class Replay:
    """A flush seen at a trie step: everything `graph._run_graph` derived from the nodes."""
    __slots__ = ("entry", "order_pos", "leaf_occ", "leaf_pattern", "roots_pos", "views_pos",
                 "funcs", "n_requested")

    def __init__(self, entry: "Entry", order_pos: tuple, leaf_occ: tuple, leaf_pattern: tuple,
                 roots_pos: tuple, views_pos: tuple, funcs: tuple, n_requested: int):
        self.entry = entry
        self.order_pos = order_pos          # trace positions of the graph's nodes
        self.leaf_occ = leaf_occ            # (trace position, input index) of each real input
        self.leaf_pattern = leaf_pattern    # leaf index of each occurrence (shared leaves)
        self.roots_pos = roots_pos          # (trace position, output) of each graph output
        self.views_pos = views_pos          # live pending views to replay afterwards
        self.funcs = funcs
        self.n_requested = n_requested


def replay_key(ctx: "LazyContext", values: list) -> tuple | None:
    """What a flush of `values` at this point depends on besides the trie path: the values
    requested and the pending values still alive (they become outputs too)."""
    trace = ctx.trace
    req = []
    for node, k in values:
        pos = node.tpos
        if pos < 0 or pos >= len(trace) or trace[pos] is not node:
            return None
        req.append((pos, k))
    alive = []
    for pos, node in enumerate(trace):
        if node.results is not None:
            return None            # computed meanwhile (a flush of another block): not this graph
        for k, ref in enumerate(node.wrappers):
            if ref is not None:
                w = ref()
                if w is not None and w._lz_node is node:
                    alive.append((pos, k))
    return tuple(req), tuple(alive)


def remember(ctx: "LazyContext", key: tuple | None, entry: "Entry", order: list, roots: list, views: list,
             leaves: list, n_requested: int) -> None:
    """After an ordinary flush on a predicted trace: keep what a replay needs."""
    step = ctx.cursor
    if step is None or key is None or step.func is None:
        return
    trace = ctx.trace
    for n in order:
        if n.tpos < 0 or n.tpos >= len(trace) or trace[n.tpos] is not n:
            return
    index = {id(t): j for j, t in enumerate(leaves)}
    occ, pattern = [], []
    for n in order:
        for i, ref in enumerate(n.inputs):
            if type(ref) is not tuple:
                occ.append((n.tpos, i))
                pattern.append(index[id(ref)])
            elif ref[0].tpos < 0 or trace[ref[0].tpos] is not ref[0]:
                return
    if len(step.replays) >= 8:
        step.replays.clear()
    step.replays[key] = Replay(entry, tuple(n.tpos for n in order), tuple(occ), tuple(pattern),
                               tuple((n.tpos, k) for n, k in roots), tuple((n.tpos, k) for n, k in views),
                               tuple(n.func for n in order), n_requested)

