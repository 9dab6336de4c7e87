"""The pending graph of a lazy block: recorded aten ops, their metadata, and flushing.

A recorded op is a `LazyNode`.  Nodes form a DAG through their `inputs`: each input is either a
real tensor (a graph leaf) or a `(node, k)` reference to output `k` of another node.  There is
no global "pending graph" object: a flush walks the DAG backwards from the values it needs, so
only their ancestors are computed and values nobody holds any more are never computed.

Flushing (`flush`) turns the needed sub-DAG into an aten FX graph (make_fx over a replay of the
ops, which also applies torchfuse's decompositions and gives every node a FakeTensor
`meta["val"]`), compiles it with `compile_graph`, runs it on the leaves and publishes the results
into the waiting `LazyTensor` wrappers.  Compiled graphs are cached by a structural signature
(op sequence with baked-in scalar arguments, how nodes connect, and dtype/size/stride of every
leaf), so a loop that records the same ops every step compiles once; a flush at a point of a
predicted trace that flushed before runs again what that flush ran (`try_replay`, see trace.py).
"""
from __future__ import annotations

import itertools
import logging
import time
import weakref
from dataclasses import dataclass
from operator import attrgetter
from typing import TYPE_CHECKING, Any

import torch

from ..counters import counters
from . import cache, trace
from .cache import Slot, fill
from .state import hooks, pop_lazy_modes, push_modes
from .tensor import attach_real

if TYPE_CHECKING:
    from .context import LazyContext

log = logging.getLogger("torchfuse.lazy")

# dtypes the loop IR handles; an op producing anything else (complex, float8, ...) runs eagerly.
SUPPORTED_DTYPES = frozenset({torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int8,
                              torch.uint8, torch.int16, torch.int32, torch.int64, torch.bool})

Desc = tuple  # (size, stride, storage_offset, dtype) of one output, enough to make its wrapper
Ref = Any     # an input of a node: a real torch.Tensor or a (LazyNode, output index) tuple


class Unrecordable(Exception):
    """Raised while scanning an op's arguments when the op cannot be deferred."""


_TENSOR_KEY = "\x00T"      # marks a tensor position in a structural key


def scan(args: tuple, kwargs: dict, tensors: list) -> tuple[tuple, dict, tuple]:
    """Split an op's arguments into tensors (appended to `tensors`), a template with `Slot`s in
    their place (to replay the op later on other tensors) and a hashable key of everything else.

    Scalars are part of the key by value (and type: `x * 2` and `x * 2.0` promote differently);
    floats by repr so that -0.0 and nan are keyed exactly.  (Runs for every recorded op: plain
    loops, no closures.)
    """
    key: list = []
    targs = tuple([_conv(a, key, tensors) for a in args])
    if not kwargs:
        return targs, kwargs, tuple(key)
    tkwargs = {}
    for name, a in kwargs.items():
        key.append(name)
        tkwargs[name] = _conv(a, key, tensors)
    return targs, tkwargs, tuple(key)


_PLAIN_TYPES = (bool, int, str, type(None), torch.dtype, torch.device, torch.layout, torch.memory_format)


def _conv(a: Any, key: list, tensors: list) -> Any:
    t = type(a)
    if t is float:
        key.append(repr(a))
        return a
    if isinstance(a, torch.Tensor):
        key.append(_TENSOR_KEY)
        tensors.append(a)
        return Slot(len(tensors) - 1)
    if t is list or t is tuple:
        key.append((t is list, len(a)))
        return t([_conv(x, key, tensors) for x in a])
    if t in _PLAIN_TYPES:
        key.append((t, a))
        return a
    raise Unrecordable(f"argument of type {t.__name__}")


def tensor_meta(t: torch.Tensor) -> tuple:
    return (t.dtype, t.size(), t.stride(), t.storage_offset())


def meta_tensor(t: torch.Tensor) -> torch.Tensor:
    """An empty tensor on the meta device with `t`'s dtype, sizes, strides and storage offset."""
    size, stride, off = t.size(), t.stride(), t.storage_offset()
    if off == 0:
        return torch.empty_strided(size, stride, dtype=t.dtype, device="meta")
    span = off + 1 + sum((s - 1) * st for s, st in zip(size, stride) if s > 0)
    return torch.empty((span,), dtype=t.dtype, device="meta").as_strided(size, stride, off)


# Output metadata per (op, non-tensor arguments, input metadata): recording the same op on
# same-shaped inputs again (every step of a loop) skips running the meta kernel.
_META_CACHE: dict[tuple, tuple[list[Desc], type | None]] = {}
_META_CACHE_MAX = 65536


def output_descs(func: Any, targs: tuple, tkwargs: dict, skel: tuple, tensors: list,
                 device_arg: bool) -> tuple[list[Desc], type | None]:
    """The (size, stride, offset, dtype) of each output of `func` on these inputs, from the meta
    kernels.  Returns (descs, container type or None for a single tensor)."""
    key = (func, skel, tuple([(t.dtype, t.size(), t.stride(), t.storage_offset()) for t in tensors]))
    hit = _META_CACHE.get(key)
    if hit is not None:
        return hit
    metas = [meta_tensor(t) for t in tensors]
    kwargs = fill(tkwargs, metas)
    if device_arg:
        kwargs["device"] = "meta"      # factories: never allocate real memory to learn a shape
    try:
        out = func(*fill(targs, metas), **kwargs)
    except Exception as e:            # no meta kernel, data-dependent shape, invalid arguments
        raise Unrecordable(f"meta: {type(e).__name__}: {e}") from None
    outs = [out] if isinstance(out, torch.Tensor) else out
    # Besides tensors: None, an optional output not computed (convolution_backward's
    # output_mask), and plain ints (flash attention's max_q/max_k: the desc is the int itself)
    if not isinstance(outs, (list, tuple)) or not any(isinstance(o, torch.Tensor) for o in outs) or \
            not all(o is None or type(o) is int or isinstance(o, torch.Tensor) for o in outs):
        raise Unrecordable("outputs are not all tensors")
    descs = [o if o is None or type(o) is int else (o.size(), o.stride(), o.storage_offset(), o.dtype)
             for o in outs]
    if any(type(d) is tuple and d[3] not in SUPPORTED_DTYPES for d in descs):
        raise Unrecordable("unsupported dtype")
    result = (descs, None if isinstance(out, torch.Tensor) else type(out))
    if len(_META_CACHE) >= _META_CACHE_MAX:
        _META_CACHE.clear()
    _META_CACHE[key] = result
    return result


class LazyNode:
    """One recorded aten op: its recording plan (`mode.Plan`: the op, its argument template and
    output layouts, shared by every node recorded from the same op on the same layouts), its
    inputs, and `results[k]` once output k has been computed."""
    __slots__ = ("plan", "inputs", "results", "wrappers", "has_views", "depth", "mark", "pos", "tpos",
                 "__weakref__")

    def __init__(self, plan: Any, inputs: list[Ref], depth: int = 0, tpos: int = -1,
                 wrappers: list[weakref.ref | None] | None = None):
        # (runs for every recorded op: the plan's fields are read through it, not copied)
        self.plan = plan
        self.inputs = inputs
        self.results: list[torch.Tensor | None] | None = None
        # weak references to the wrappers handed out for the outputs
        self.wrappers = wrappers if wrappers is not None else [None] * len(plan.descs)
        self.has_views = False       # a pending view of this node exists (blocks in-place rebinding)
        self.mark = 0                # last `topo` walk that visited this node
        self.pos = 0                 # position in that walk's order
        self.tpos = tpos             # position in its block's trace (see trace.py), -1: none
        # longest chain of pending ops ending here: bounds the graph a flush of this value builds
        # (given when predicted: the same inputs are pending as when the step was learnt)
        if not depth:
            for r in inputs:
                if type(r) is tuple and r[0].results is None and r[0].depth > depth:
                    depth = r[0].depth
            depth += 1
        self.depth = depth

    # the plan's fields, read where a node is replayed, compiled or published
    func = property(attrgetter("plan.func"))
    targs = property(attrgetter("plan.targs"))
    tkwargs = property(attrgetter("plan.tkwargs"))
    skey = property(attrgetter("plan.skey"))
    descs = property(attrgetter("plan.descs"))
    container = property(attrgetter("plan.container"))
    device = property(attrgetter("plan.device"))
    is_view = property(attrgetter("plan.is_view"))
    dids = property(attrgetter("plan.dids"))     # interned layout ids of the outputs (see mode.Plan)

    def resolved(self, k: int) -> bool:
        return self.results is not None and self.results[k] is not None

    def name(self) -> str:
        return str(self.func)

    def call(self, tensors: list) -> list:
        out = self.func(*fill(self.targs, tensors), **fill(self.tkwargs, tensors))
        return [out] if self.container is None else list(out)


def ref_real(ref: Ref) -> torch.Tensor | None:
    """The real tensor behind an input reference, or None while it is pending."""
    if type(ref) is tuple:
        node, k = ref
        return node.results[k] if node.results is not None else None
    return ref


_walks = itertools.count(1)


def topo(nodes: list[LazyNode]) -> list[LazyNode]:
    """Pending ancestors of `nodes` (inclusive) in dependency order; sets each one's `pos` to
    its index.  Iterative (chains of hundreds of ops must not hit Python's recursion limit);
    visited nodes are marked with the walk's number instead of being put in a set."""
    walk = next(_walks)
    order: list[LazyNode] = []
    stack = list(nodes)
    while stack:
        n = stack[-1]
        if n.mark == walk:
            stack.pop()
            continue
        pushed = False
        for ref in n.inputs:
            if type(ref) is tuple:
                p = ref[0]
                if p.mark != walk:
                    res = p.results
                    if res is None or res[ref[1]] is None:
                        stack.append(p)
                        pushed = True
        if not pushed:
            stack.pop()
            n.mark = walk
            n.pos = len(order)
            order.append(n)
    return order


def view_root(node: LazyNode, k: int) -> tuple[LazyNode, int] | None:
    """Follow a chain of pending views up to the pending non-view value it aliases; None when
    the chain ends at a real tensor (so the view can simply be replayed)."""
    while not node.resolved(k):
        if not node.is_view:
            return node, k
        ref = node.inputs[0]
        if type(ref) is not tuple:
            return None
        node, k = ref
    return None


def storage_key(t: torch.Tensor) -> tuple[str, int]:
    """Identifies the memory a real tensor lives in (views share it)."""
    try:
        return ("storage", t.untyped_storage()._cdata)
    except (RuntimeError, NotImplementedError):     # sparse, nested, ...: no shared storage
        return ("tensor", id(t))


def clear_cache() -> None:
    """Forget compiled graphs, recording plans and op predictions (kernel libraries stay in
    their own cache)."""
    cache.clear()
    trace.clear()
    _META_CACHE.clear()
    hooks.clear_plans()


@dataclass
class FlushRecord:
    """One flush of a lazy block: why it happened and what it ran."""
    reason: str
    ops: int                  # recorded aten ops computed by the flush (graph nodes)
    outputs: int              # values computed (graph outputs)
    kernels: int              # kernels of the compiled graph (0: nothing compiled, or eager)
    cache_hit: bool           # the compiled graph came from the signature cache
    graph: str | None = None  # compile_graph's name of the graph (also its debug folder name)
    ms: float = 0.0           # wall time of the flush
    funcs: tuple = ()         # the aten ops computed, in order
    extra_outputs: int = 0    # outputs not asked for, but computed on the way and still referenced

    @property
    def op_names(self) -> list[str]:
        return [str(f) for f in self.funcs]

    def __str__(self) -> str:
        src = "cached" if self.cache_hit else (self.graph or "compiled")
        return (f"{self.reason}: {self.ops} op(s) -> {self.outputs} output(s), {self.kernels} kernel(s) "
                f"[{src}, {self.ms:.2f} ms]")


class FlushLog(list):
    """A block's `FlushRecord`s (a list) that prints as a table, one row per flush:
    `print(ctx.flushes)`."""

    def table(self, width: int = 52) -> str:
        rows = [("#", "reason", "ops", "outputs", "kernels", "graph", "ms")]
        for i, f in enumerate(self):
            reason = f.reason if len(f.reason) <= width else f.reason[:width - 3] + "..."
            src = "eager" if f.graph == "eager" else "module" if f.graph == "module" else \
                ("cache hit" if f.cache_hit else "compiled")
            rows.append((str(i), reason, str(f.ops), str(f.outputs), str(f.kernels), src, f"{f.ms:.2f}"))
        rows.append(("", "total", str(sum(f.ops for f in self)), str(sum(f.outputs for f in self)),
                     str(sum(f.kernels for f in self)), f"{sum(not f.cache_hit for f in self)} compiled",
                     f"{sum(f.ms for f in self):.2f}"))
        widths = [max(len(r[c]) for r in rows) for c in range(len(rows[0]))]
        left = {1, 5}                                  # text columns; numbers align right
        return "\n".join("  ".join(v.ljust(w) if c in left else v.rjust(w)
                                   for c, (v, w) in enumerate(zip(r, widths))).rstrip()
                         for r in rows)

    def __str__(self) -> str:
        return self.table()

    __repr__ = __str__


# --------------------------------------------------------------------------------------------
# flushing
# --------------------------------------------------------------------------------------------

def flush(values: list[tuple[LazyNode, int]], reason: str, ctx: "LazyContext | None") -> None:
    """Compute the pending `values` (and nothing they do not need) and publish them."""
    values = [v for v in values if v[0].results is None or v[0].results[v[1]] is None]
    if not values:
        return
    popped = pop_lazy_modes()          # flushing runs plain torch code, not recorded
    try:
        predicted = ctx is not None and ctx.cursor is not None and ctx.cursor.func is not None
        if predicted and try_replay(ctx, values, reason):
            return
        key = trace.replay_key(ctx, values) if predicted else None
        roots: dict[tuple[int, int], tuple[LazyNode, int]] = {}
        for node, k in values:
            r = view_root(node, k)
            if r is not None:
                roots.setdefault((id(r[0]), r[1]), r)
        by_device: dict[torch.device, list[tuple[LazyNode, int]]] = {}
        for r in roots.values():
            by_device.setdefault(r[0].device, []).append(r)
        views = values
        for device, rs in by_device.items():
            views += _run_graph(rs, device, reason, ctx, key if len(by_device) == 1 else None, len(values))
        for node, k in views:
            _replay_views(node, k)
    finally:
        if ctx is not None:
            trace.reset(ctx)           # the next ops start a new trace
        push_modes(popped)


def try_replay(ctx: "LazyContext", values: list, reason: str) -> bool:
    """Run the flush of `values` the way it ran the last time the trace ended at this step;
    False if there is no such flush (the caller does the ordinary flush, then `trace.remember`)."""
    step = ctx.cursor
    if step is None or not step.replays:
        return False
    key = trace.replay_key(ctx, values)
    rep = step.replays.get(key) if key is not None else None
    if rep is None:
        return False
    if rep.entry.evicted:          # the compiled-graph cache dropped it (LRU bound, clear())
        del step.replays[key]
        return False
    if not rep.entry.checked:      # its first run failed before its outputs were checked
        return False
    t0 = time.perf_counter()
    nodes = ctx.trace
    leaves: list = []
    seen: dict[int, int] = {}
    pattern = rep.leaf_pattern
    for (pos, i), want in zip(rep.leaf_occ, pattern):
        t = nodes[pos].inputs[i]
        j = seen.get(id(t))
        if j is None:
            j = seen[id(t)] = len(leaves)
            leaves.append(t)
        if j != want:
            return False           # other tensors shared (or not) than when the graph was made
    roots = [(nodes[p], k) for p, k in rep.roots_pos]
    outs = call_no_grad(rep.entry, leaves)
    del leaves
    finish_outputs(rep.entry, outs, roots)
    for (node, k), out in zip(roots, outs):
        publish(node, [out if j == k else None for j in range(len(node.descs))])
    for node, k in values:
        _replay_views(node, k)
    for p, k in rep.views_pos:
        _replay_views(nodes[p], k)
    counters.bump("lazy_flushes")
    counters.bump("lazy_cache_hits")
    counters.bump("lazy_replays")
    ctx._log_flush(FlushRecord(reason, len(rep.order_pos), len(roots), rep.entry.kernels, True, None,
                               1e3 * (time.perf_counter() - t0), rep.funcs, len(roots) - rep.n_requested))
    return True


def _replay_views(node: LazyNode, k: int) -> None:
    """Materialize a pending view by re-applying the view ops to its (now real) base: views stay
    views of their base's storage, as in eager mode."""
    chain = []
    while not node.resolved(k):
        if not node.is_view:
            raise RuntimeError("torchfuse.lazy: internal error: a value was not computed by its flush")
        chain.append(node)
        ref = node.inputs[0]
        if type(ref) is not tuple:       # the chain starts at a real tensor (see view_root)
            break
        node, k = ref
    for n in reversed(chain):
        if n.results is None:
            publish(n, n.call([ref_real(r) for r in n.inputs]))


def publish(node: LazyNode, outs: list[torch.Tensor | None]) -> None:
    """Store computed outputs in `node` and hand them to its live wrappers."""
    results = node.results
    if results is None:
        results = node.results = [None] * len(node.descs)
    for k, real in enumerate(outs):
        if real is None or results[k] is not None:
            continue
        results[k] = real
        ref = node.wrappers[k]
        w = ref() if ref is not None else None
        if w is not None and w._lz_node is node:
            attach_real(w, real)
    if all(r is not None or type(d) is not tuple for r, d in zip(results, node.descs)):
        # (`None in results` would call Tensor.__eq__)
        # Fully computed: the node is a leaf from now on; drop its inputs so that their memory
        # (and the whole chain of ancestors) can be freed.  (Its plan holds no tensors.)
        node.inputs = []


def _live_extras(order: list[LazyNode], roots: list[tuple[LazyNode, int]]
                 ) -> list[tuple[LazyNode, int]]:
    """Values computed anyway by this graph that a live wrapper still waits for become outputs
    too, and pending views of them are replayed: otherwise a value that is only observed
    through reductions (`acc.sum().item()` every step of a loop) would stay pending and its
    ever-growing history would be recomputed by every flush.  Returns the views to replay."""
    have = {(id(n), k) for n, k in roots}
    views = []
    for n in order:
        for k, ref in enumerate(n.wrappers):
            w = ref() if ref is not None else None
            if w is None or w._lz_node is not n or n.resolved(k):
                continue
            if n.is_view:
                r = view_root(n, k)
                views.append((n, k))
                if r is None:
                    continue
                n_root, k_root = r
            else:
                n_root, k_root = n, k
            if (id(n_root), k_root) not in have:
                have.add((id(n_root), k_root))
                roots.append((n_root, k_root))
    return views


def _signature(order: list[LazyNode], roots: list[tuple[LazyNode, int]], device: torch.device, token: int
               ) -> tuple[tuple, list[torch.Tensor], list[list]]:
    """The exact cache key of the graph computing `roots` (needs `order` from `topo`: it uses
    the nodes' `pos`), its leaves, and per node the code of each input (a leaf index or the
    (position, output) of a node of the graph)."""
    leaves: list[torch.Tensor] = []
    leaf_index: dict[int, int] = {}
    entries = []
    codes: list[list] = []
    for n in order:
        refs: list = []
        for ref in n.inputs:
            if type(ref) is tuple:
                p, k = ref
                res = p.results
                if res is None or res[k] is None:
                    refs.append((p.pos, k))
                    continue
                t = res[k]
            else:
                t = ref
            j = leaf_index.get(id(t))
            if j is None:
                j = leaf_index[id(t)] = len(leaves)
                leaves.append(t)
            refs.append(j)
        codes.append(refs)
        entries.append((n.skey, tuple(refs)))
    outs = tuple([(n.pos, k) for n, k in roots])
    leaf_key = tuple([(t.dtype, t.size(), t.stride(), t.storage_offset()) for t in leaves])
    return (token, device, leaf_key, tuple(entries), outs), leaves, codes


def _run_graph(roots: list[tuple[LazyNode, int]], device: torch.device, reason: str,
               ctx: "LazyContext | None", replay_key: tuple | None = None, n_values: int = 0,
               ) -> list[tuple[LazyNode, int]]:
    """Compile (or take from the cache) and run the graph computing `roots`; returns the live
    pending views whose base it computed (to be replayed by the caller).  With a `replay_key`
    (see trace.py) the flush is remembered at the block's trie step for replaying."""
    ctx = ctx or hooks.default_context()
    t0 = time.perf_counter()
    order = topo([r[0] for r in roots])
    n_requested = len(roots)
    views = _live_extras(order, roots)
    sig, leaves, codes = _signature(order, roots, device, ctx.token)
    counters.bump("lazy_signatures")
    entry, hit = cache.lookup(sig, order, codes, sig[4], leaves, device, ctx)
    if replay_key is not None:
        trace.remember(ctx, replay_key, entry, order, roots, views, leaves, n_values)
    outs = call_no_grad(entry, leaves)
    if not entry.checked:
        _check_outputs(entry, outs, leaves, roots)
    del leaves
    finish_outputs(entry, outs, roots)
    if len(roots) == 1 and len(roots[0][0].descs) == 1:
        publish(roots[0][0], outs)
    else:
        # Group outputs per node (a multi-output node may have only some outputs computed).
        per_node: dict[int, tuple[LazyNode, list]] = {}
        for (node, k), out in zip(roots, outs):
            per_node.setdefault(id(node), (node, [None] * len(node.descs)))[1][k] = out
        for node, outs_k in per_node.values():
            publish(node, outs_k)
    counters.bump("lazy_flushes")
    ctx._log_flush(FlushRecord(reason, len(order), len(roots), entry.kernels, hit,
                               None if hit else entry.compiled.graph, 1e3 * (time.perf_counter() - t0),
                               tuple([n.func for n in order]), len(roots) - n_requested))
    return views


_set_grad_enabled = torch._C._set_grad_enabled


def call_no_grad(entry: "cache.Entry", leaves: list) -> list:
    """`entry.call(leaves)` under no_grad, without `torch.no_grad()`'s Python layers (2-3 us)."""
    if not torch.is_grad_enabled():
        return entry.call(leaves)
    _set_grad_enabled(False)
    try:
        return entry.call(leaves)
    finally:
        _set_grad_enabled(True)


def finish_outputs(entry: "cache.Entry", outs: list[torch.Tensor], roots: list[tuple[LazyNode, int]]) -> None:
    """Give each output its own memory and eager's dtype and layout (see `_check_outputs`)."""
    for i in entry.copy_outputs:
        outs[i] = _copy_like(outs[i])
    for i, fix in entry.fixes:
        node, k = roots[i]
        size, stride, _, dtype = node.descs[k]
        out = outs[i].to(dtype) if fix == "dtype" else outs[i]
        outs[i] = torch.empty_strided(size, stride, dtype=dtype, device=out.device).copy_(out)


def _check_outputs(entry: "cache.Entry", outs: list[torch.Tensor], leaves: list[torch.Tensor],
                   roots: list[tuple[LazyNode, int]]) -> None:
    """First run of a cache entry: outputs must have the sizes the meta kernels promised; note
    outputs that alias memory (copied every run) and dtypes / layouts that differ from eager's
    (converted every run).  The entry's key fixes all of this, so later runs skip the checks."""
    entry.copy_outputs = _aliasing_outputs(outs, leaves)
    fixes = []
    for i, ((node, k), out) in enumerate(zip(roots, outs)):
        size, stride, _, dtype = node.descs[k]
        if out.size() != size:
            raise RuntimeError(f"torchfuse.lazy: internal error: {node.name()} produced shape "
                               f"{tuple(out.shape)}, its meta kernel said {tuple(size)}")
        if out.dtype != dtype:       # a decomposition that promotes differently from the meta kernel
            log.warning("torchfuse.lazy: %s produced %s, eager gives %s; converting", node.name(), out.dtype, dtype)
            fixes.append((i, "dtype"))
        elif out.stride() != stride and out.numel() > 1:
            fixes.append((i, "layout"))
    entry.fixes = tuple(fixes)
    entry.checked = True


def _aliasing_outputs(outs: list[torch.Tensor], leaves: list[torch.Tensor]) -> tuple[int, ...]:
    """Outputs that share memory with a leaf or an earlier output.  Passes may turn `x.clone()`
    or `x * 1` into `x` itself, and CSE may merge two equal values; each lazy value must own its
    memory, as it would in eager mode."""
    seen = {storage_key(t) for t in leaves}
    bad = []
    for i, o in enumerate(outs):
        key = storage_key(o)
        if key in seen:
            bad.append(i)
        seen.add(key)
    return tuple(bad)


def _copy_like(t: torch.Tensor) -> torch.Tensor:
    return torch.empty_strided(t.size(), t.stride(), dtype=t.dtype, device=t.device).copy_(t)


hooks.flush = flush
