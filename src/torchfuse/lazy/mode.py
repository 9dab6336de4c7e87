"""What happens to each aten op inside a lazy block: record it, or run it eagerly.

`LazyMode` is a TorchDispatchMode pushed by `torchfuse.lazy()`.  It sees every aten op (after
autograd), on plain tensors and on `LazyTensor`s alike, and decides:

* record: a fusible op (one torchfuse lowers, or decomposes into ops it lowers; not random, not
  mutating) whose tensors are all strided and on one CPU/CUDA device.  The
  output metadata comes from the op's meta kernel; the outputs are new pending `LazyTensor`s.
  A view of a *real* tensor is not recorded: running it is free and keeps later graphs smaller.
* record functionally: an in-place op (`y.add_(1)`) on a pending value that nothing else
  aliases: `y` is re-pointed at a recorded out-of-place `add`.
* run eagerly: everything else.  Pending inputs are computed first (one flush for all of them);
  before an op mutates memory, every pending value that read that memory through a computation
  is computed, so it sees the old contents as it would have in eager mode.

Autograd: the mode sits below autograd, so autograd records exactly what it records in eager
mode -- its graph simply holds LazyTensors (saved activations included).  The ops of a backward
pass reach this mode too and are recorded like any others: forward and backward pointwise work
are both fused, and a backward pass ends with one flush of the gradients it produced (see
`_note_graph_task`).  Random ops run eagerly (same random stream as eager).
"""
from __future__ import annotations

import itertools
import logging
import math
import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from .. import extend
from . import cache, recorder, trace
from .graph import LazyNode, Unrecordable, flush, output_descs, ref_real, scan, storage_key, topo, view_root
from .state import LazyMode, current_context, hooks, open_contexts
from .tensor import LazyTensor, materialized_wrapper, new_wrapper, sync_storage, unwrap

if TYPE_CHECKING:
    from .context import LazyContext

log = logging.getLogger("torchfuse.lazy")
aten = torch.ops.aten


def _lazy_torch_dispatch(self: LazyMode, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
    ctx = self.ctx
    cursor = ctx.cursor
    if cursor is not None:
        rec = cursor.recs.get(id(func))      # an op seen after this step before (recorder.py)
        if rec is not None:
            out = rec(ctx, args, kwargs)
            if out is not None:
                return out
    return dispatch(ctx, func, args, kwargs or {})


# Assigned outside the class body (state.LazyMode) on purpose: TorchDispatchMode.__init_subclass__
# wraps a __torch_dispatch__ defined in the body with torch._disable_dynamo, which costs about
# 2 us on every op; this handler is never traced by Dynamo.
LazyMode.__torch_dispatch__ = _lazy_torch_dispatch  # type: ignore[method-assign]


# --------------------------------------------------------------------------------------------
# per-op facts, computed once per OpOverload
# --------------------------------------------------------------------------------------------

@dataclass
class OpInfo:
    fusible: bool
    is_view: bool
    mutated: tuple[tuple[int, str], ...]          # (position, name) of arguments written
    alias_returns: tuple[tuple[int, int, str], ...]  # (return index, arg position, arg name)
    functional: Any                               # out-of-place op of an in-place self-op
    device_arg: bool                              # has a `device=` argument (factories)
    op: Any = None                                # the OpOverload (kept alive: keys use its id)
    free_on_real: bool = False                    # on a real tensor: run it, nothing to record
    deferred_fallback: bool = False               # not lowered, but recorded (see _DEFERRED)


# Ops with a lowering that must still run eagerly.
_NEVER_DEFER = {
    # uninitialized memory: nothing to fuse, and deferring only delays the allocation
    "aten::empty", "aten::empty_like", "aten::empty_strided", "aten::new_empty", "aten::new_empty_strided",
    # training batch norm writes its running statistics (its schema does not say so)
    "aten::native_batch_norm", "aten::_native_batch_norm_legit", "aten::_native_batch_norm_legit_functional",
    "aten::lift_fresh_copy",
}

# Keyed by id(func): OpOverload.__hash__ is a Python method (~0.3 us); ops live forever (and
# each OpInfo holds its op), so ids are never reused.
_INFO: dict[int, OpInfo] = {}


def _forget(op: Any) -> None:
    """A decomposition or lowering was registered for `op`: decide about it again, and drop the
    graphs compiled with the old decision."""
    _INFO.pop(id(op), None)
    cache.clear()


extend.on_registration(_forget)


def op_info(func: Any) -> OpInfo:
    info = _INFO.get(id(func))
    if info is None:
        info = _make_info(func)
        info.op = func
        # Views of real tensors cost nothing eagerly and keep later graphs smaller; so does
        # `_unsafe_view` (a reshape of a temporary: HF's `logits.view(...)`), which recorded
        # would become a graph output aliasing its input and be copied on every flush.
        info.free_on_real = info.is_view or str(func) == "aten._unsafe_view.default"
        info.deferred_fallback = not info.fusible and _deferrable(func)
        _INFO[id(func)] = info
    return info


# Ops torchfuse does not lower but records anyway (unless `lazy(defer_matmuls=False)`): they run
# through ATen inside the compiled graph, exactly as in a torch.compile graph.  Recording them
# means a matmul no longer forces the pending values it reads, so the pointwise work before and
# after it -- a transformer layer's layer norm, bias, GELU, residual -- lands in one graph and
# a whole forward pass is typically a single flush instead of one per matmul.
_DEFERRED = {
    "aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::mv", "aten::addmv", "aten::dot",
    "aten::_scaled_dot_product_flash_attention_for_cpu", "aten::_scaled_dot_product_efficient_attention",
    "aten::_scaled_dot_product_cudnn_attention", "aten::_scaled_dot_product_flash_attention",
    "aten::convolution", "aten::cumsum", "aten::max_pool2d_with_indices",
    # their backward passes: a training step's backward is one graph, not one per layer
    "aten::_scaled_dot_product_flash_attention_for_cpu_backward",
    "aten::_scaled_dot_product_efficient_attention_backward",
    "aten::_scaled_dot_product_flash_attention_backward",
    "aten::_scaled_dot_product_cudnn_attention_backward",
    "aten::convolution_backward", "aten::embedding_dense_backward",
    "aten::max_pool2d_with_indices_backward", "aten::native_group_norm_backward",
}


def _deferrable(func: Any) -> bool:
    if not isinstance(func, torch._ops.OpOverload):
        return False
    schema = func._schema
    if schema.name not in _DEFERRED or schema.is_mutable:
        return False
    # Attention ops are tagged random for their dropout; `_make_plan` records them only with
    # dropout_p == 0 (inference).
    return torch.Tag.nondeterministic_seeded not in func.tags or _dropout_pos(func) is not None


def _dropout_pos(func: Any) -> int | None:
    for i, a in enumerate(func._schema.arguments):
        if a.name == "dropout_p":
            return i
    return None


def _fusible_target(func: Any) -> bool:
    # imported at the first op recorded: the lowerings take ~2 s to import, which
    # `import torchfuse` does not pay
    from ..frontend.decompositions import decomposition_table
    from ..lowering import ops as lower_ops  # noqa: F401  (registers the lowerings)
    from ..lowering.registry import LOWERINGS
    if not isinstance(func, torch._ops.OpOverload):
        return False
    schema = func._schema
    if schema.is_mutable or schema.name in _NEVER_DEFER or torch.Tag.nondeterministic_seeded in func.tags:
        return False
    return func in LOWERINGS or func in decomposition_table()


def _make_info(func: Any) -> OpInfo:
    if not isinstance(func, torch._ops.OpOverload):
        return OpInfo(False, False, (), (), None, False)
    schema = func._schema
    mutated = tuple((i, a.name) for i, a in enumerate(schema.arguments)
                    if a.alias_info is not None and a.alias_info.is_write)
    alias_returns = []
    for r, ret in enumerate(schema.returns):
        if ret.alias_info is not None and ret.alias_info.is_write:
            for i, a in enumerate(schema.arguments):
                if a.alias_info is not None and a.alias_info.before_set == ret.alias_info.before_set:
                    alias_returns.append((r, i, a.name))
                    break
    functional = None
    if mutated == ((0, "self"),) and len(schema.returns) == 1 and schema.name.endswith("_"):
        try:
            packet = getattr(torch.ops.aten, schema.name.split("::")[1][:-1])
            functional = getattr(packet, func._overloadname)
        except AttributeError:
            functional = None
        if functional is not None and not _fusible_target(functional):
            functional = None
    return OpInfo(_fusible_target(func), bool(func.is_view), mutated, tuple(alias_returns), functional,
                  any(a.name == "device" for a in schema.arguments))


# --------------------------------------------------------------------------------------------
# the dispatch decision
# --------------------------------------------------------------------------------------------

def dispatch(ctx: "LazyContext", func: Any, args: tuple, kwargs: dict) -> Any:
    info = _INFO.get(id(func)) or op_info(func)
    why = None
    if info.free_on_real:
        a0 = args[0]
        if type(a0) is not LazyTensor:
            return func(*args, **kwargs)    # a view of a real tensor: free, nothing to record
        if a0._lz_real is not None and not any(type(a) is LazyTensor for a in args[1:]):
            # a view of a computed value (after a flush): the same, on its real tensor
            return func(a0._lz_real, *args[1:], **kwargs)
    if info.fusible or (info.deferred_fallback and ctx.defer_matmuls):
        if ctx.forced_fallbacks and str(func) in ctx.forced_fallbacks:
            why = "in options['fallback_ops']"
        else:
            out, why = _try_record(ctx, func, info, args, kwargs)
            if why is None:
                return out
    elif info.functional is not None and type(args[0]) is LazyTensor:
        if args[0]._lz_real is None:
            out, why = _try_record_inplace(ctx, func, info, args, kwargs)
            if why is None:
                return out
        elif any(type(a) is LazyTensor and a._lz_real is None for a in args[1:]):
            # `grad += g`: a computed value updated from pending ones (gradient accumulation)
            out, why = _try_record_update(ctx, func, info, args, kwargs)
            if why is None:
                return out
    return eager_call(func, args, kwargs, ctx, why=why)


def _try_record(ctx: "LazyContext", func: Any, info: OpInfo, args: tuple, kwargs: dict,
                ) -> tuple[Any, str | None]:
    node, why, plan = _record_node(ctx, func, info, args, kwargs)
    if node is None:
        return None, why
    ctx.trace_misses += 1
    parent = ctx.cursor
    if parent is not None:
        step = trace.learn(ctx, func, args, kwargs, plan, node)
        if step is not None:
            step.record = recorder.recorder(step, ctx.trace)
            cands = parent.children[id(func)]
            if step.record is None:        # no prediction from this step (see recorder)
                cands.remove(step)
                trace.stop(ctx)
            if cands:
                parent.recs[id(func)] = recorder.dispatcher(cands)
            else:
                parent.recs.pop(id(func), None)
    _commit(ctx, node)
    if node.container is None:
        # The common case, inlined (this runs for every recorded op).
        size, stride, offset, dtype = node.descs[0]
        w = _make_wrapper(LazyTensor, size, strides=stride, storage_offset=offset, dtype=dtype,
                          device=node.device, requires_grad=False)
        w._lz_node = node
        w._lz_idx = 0
        w._lz_real = None
        ref = weakref.ref(w)
        node.wrappers[0] = ref
        live = ctx.live
        live.append(ref)
        if len(live) > 4 * ctx.max_nodes:
            ctx.pending_values()          # prune dead and computed entries
        return w, None
    outs = [new_wrapper(d, node.device, node, k) if type(d) is tuple else d for k, d in enumerate(node.descs)]
    ctx._track([r for r in node.wrappers if r is not None])
    return node.container(outs), None


_make_wrapper = torch.Tensor._make_wrapper_subclass


# Recording plans: everything `_make_node` learns about an op from its non-tensor arguments and
# the metadata of its tensor arguments (argument template, output layouts, or why it cannot be
# recorded), keyed by (op, scalars, tensor metadata).  A loop that records the same op on the
# same layouts again (every step, every layer) does one dict lookup instead of re-scanning the
# arguments and running the meta kernel.
@dataclass
class Plan:
    targs: tuple
    tkwargs: dict
    skey: tuple
    descs: list
    dids: tuple            # interned ids of the output layouts (keys of later plans)
    container: Any
    device: torch.device
    work: int = 0          # elements written by the op (0 for views): see lazy(pipeline_ops=)
    func: Any = None       # the op (a plan's key holds its id)
    is_view: bool = False  # the op is a view (OpInfo.is_view)
    gpu: bool = False      # on a CUDA device: pipelining may cut at it (see _flush_first)


_PLANS: dict[tuple, "Plan | str"] = {}
_PLANS_MAX = 1 << 16
_DIDS: dict[tuple, str] = {}
_did_counter = itertools.count()


def _did(desc: tuple, device: torch.device) -> str:
    """A small interned key for an output layout, used in place of a pending input's metadata in
    plan keys.  Strings from a counter that is never reset: after `_DIDS` is cleared an old id
    can only miss, never stand for another layout; the \x01 prefix keeps them apart from
    every scalar key."""
    k = (desc, device)
    d = _DIDS.get(k)
    if d is None:
        if len(_DIDS) >= _PLANS_MAX:
            _DIDS.clear()
        d = _DIDS[k] = f"\x01{next(_did_counter)}"
    return d


def clear_plans() -> None:
    _PLANS.clear()
    _DIDS.clear()


_SCALAR_TYPES = (bool, str, type(None), torch.dtype, torch.device, torch.layout, torch.memory_format)


def _key_of(a: Any, key: list, tensors: list) -> None:
    """Append `a`'s part of a plan key (and its tensors).  Raises Unrecordable for arguments
    that are never recordable (checked before any cache: they depend on the tensor's state)."""
    t = type(a)
    if t is LazyTensor:
        tensors.append(a)
        if a._lz_real is None:
            key.append(a._lz_node.dids[a._lz_idx])
            return
        a = a._lz_real
    elif t is float:
        key.append(repr(a))          # by repr: -0.0 != 0.0, nan == nan, 2.0 != 2
        return
    elif t is int:
        key.append(a)
        return
    elif t is torch.Tensor or t is torch.nn.Parameter:
        tensors.append(a)
    elif t is list or t is tuple:
        key.append((t is list, len(a)))
        for x in a:
            _key_of(x, key, tensors)
        return
    elif t in _SCALAR_TYPES:
        key.append((t, a))
        return
    elif isinstance(a, torch.Tensor):
        raise Unrecordable(f"tensor subclass {t.__name__}")
    else:
        raise Unrecordable(f"argument of type {t.__name__}")
    if a.layout is not torch.strided:
        raise Unrecordable("not strided")
    key.append((a.dtype, a.size(), a.stride(), a.storage_offset(), a.device))


def _make_node(ctx: "LazyContext", func: Any, info: OpInfo, args: tuple, kwargs: dict,
               ) -> tuple[LazyNode | None, str | None]:
    """A node for `func(*args, **kwargs)`, or (None, why not)."""
    node, why, _ = _record_node(ctx, func, info, args, kwargs)
    return node, why


def _record_node(ctx: "LazyContext", func: Any, info: OpInfo, args: tuple, kwargs: dict,
                 ) -> tuple[LazyNode | None, str | None, "Plan | None"]:
    """`_make_node`, also returning the node's plan."""
    tensors: list = []
    key: list = [id(func)]        # id: see _INFO; `dispatch` made an OpInfo that holds func
    try:
        for a in args:
            # pending tensors and numbers inline (the common arguments), the rest in _key_of
            t = type(a)
            if t is LazyTensor and a._lz_real is None:
                tensors.append(a)
                key.append(a._lz_node.dids[a._lz_idx])
            elif t is float:
                key.append(repr(a))          # by repr: -0.0 != 0.0, nan == nan, 2.0 != 2
            elif t is int:
                key.append(a)
            else:
                _key_of(a, key, tensors)
        if kwargs:
            for name, a in kwargs.items():
                key.append(name)
                _key_of(a, key, tensors)
    except Unrecordable as e:
        return None, str(e), None
    if not tensors:
        key.append(torch.get_default_device())      # where a factory without device= allocates
    k = tuple(key)
    plan = _PLANS.get(k)
    if plan is None:
        plan = _make_plan(func, info, args, kwargs)
        if len(_PLANS) >= _PLANS_MAX:
            _PLANS.clear()
        _PLANS[k] = plan
    if type(plan) is str:
        return None, plan, None
    node = _new_node(func, info, plan, tensors)
    why = _flush_first(ctx, plan, node.depth)
    if why is not None:
        ctx.flush_all(why)
        node = _new_node(func, info, plan, tensors)   # its inputs are computed values now
    ctx.work += plan.work
    return node, None, plan


def _flush_first(ctx: "LazyContext", plan: "Plan", depth: int) -> str | None:
    """Why everything pending must be computed before a node of `plan` whose longest pending
    chain is `depth` ops is recorded, or None."""
    recorded, why = ctx.recorded, None
    if recorded >= ctx.max_nodes or depth > ctx.max_nodes:
        # Bound compile time and the size of one graph: compute everything that is pending
        # (`recorded` estimates the pending graph: ops recorded since the last flush plus the
        # values still pending after it; `depth` catches one long chain).
        why = "size limit"
    elif recorded >= ctx.pipeline_ops and (ctx.pipelining or (
            plan.device.type == "cuda" and ctx.work + plan.work >= ctx.pipeline_min_work)):
        # Pipelining: compute what is pending now, so the GPU runs it while the rest of the
        # block is recorded (see `lazy(pipeline_ops=)`).  Once on, a block stays on: the cut
        # then falls at the same op every iteration of a loop, whatever the sizes, so each
        # part is a cache hit from the second iteration (or new size) on.
        ctx.pipelining = True
        ctx.flush_check_from_cpu = ctx.flush_check_from
        why = "pipeline"
    return why


def _new_node(func: Any, info: OpInfo, plan: "Plan", tensors: list) -> LazyNode:
    return LazyNode(plan, [_ref(t) for t in tensors])


def _make_plan(func: Any, info: OpInfo, args: tuple, kwargs: dict) -> "Plan | str":
    """The slow path of `_make_node`, once per plan key: everything that depends only on the key
    (argument structure, scalars, tensor layouts, dtypes and devices)."""
    tensors: list = []
    try:
        targs, tkwargs, skel = scan(args, kwargs, tensors)
    except Unrecordable as e:
        return str(e)
    device = None
    pending = False
    for t in tensors:
        if type(t) is LazyTensor and t._lz_real is None:
            pending = True
        d = t.device
        if device is None:
            device = d
        elif d != device:
            return "mixed devices"
    if device is None:                       # a factory: torch.zeros(...), torch.arange(...)
        dev = kwargs.get("device")
        device = torch.device(dev) if dev is not None else torch.get_default_device()
        if device.type != "cpu":
            return "factory on a non-CPU device"
    elif device.type not in ("cpu", "cuda"):
        return f"device {device.type}"
    elif info.device_arg and kwargs.get("device") is not None and torch.device(kwargs["device"]) != device:
        return "changes device"
    if info.free_on_real and not pending:
        return "view of a real tensor"
    if info.deferred_fallback and torch.Tag.nondeterministic_seeded in func.tags:
        pos = _dropout_pos(func)
        p = args[pos] if pos is not None and pos < len(args) else kwargs.get("dropout_p", 0.0)
        if p:
            return "dropout"
    if kwargs.get("pin_memory"):
        return "pin_memory"
    try:
        descs, container = output_descs(func, targs, tkwargs, skel, tensors, info.device_arg)
    except Unrecordable as e:
        return str(e)
    dids = tuple(_did(d, device) if type(d) is tuple else None for d in descs)
    work = 0 if info.is_view else sum(math.prod(d[0]) for d in descs if type(d) is tuple)
    return Plan(targs, tkwargs, (id(func), skel), descs, dids, container, device, work, func, info.is_view,
                device.type == "cuda")


def _commit(ctx: "LazyContext", node: LazyNode) -> None:
    """Bookkeeping once a node is part of the pending graph."""
    ctx.recorded += 1
    if _graph_task_id() != ctx.backward_task:
        _note_graph_task(ctx)
    if node.is_view and type(node.inputs[0]) is tuple:
        root = view_root(*node.inputs[0])
        if root is not None:
            root[0].has_views = True


_graph_task_id = torch._C._current_graph_task_id     # -1 outside a backward pass


def _note_graph_task(ctx: "LazyContext") -> None:
    """The first op recorded by a backward pass queues one flush of everything pending for
    when the pass ends: the gradients it produced are computed together, in one graph with the
    forward's pending work, as eager `backward()` returns with them computed.  Left pending,
    an optimizer's in-place update of each parameter (eager: it writes real memory) would
    force them out one gradient per flush."""
    task = _graph_task_id()
    ctx.backward_task = task
    if task != -1:
        torch.autograd.Variable._execution_engine.queue_callback(
            lambda: ctx.flush_all("end of a backward pass"))


def _ref(t: torch.Tensor) -> Any:
    if type(t) is LazyTensor:
        if t._lz_real is not None:
            return t._lz_real
        node, k = t._lz_node, t._lz_idx
        if node.resolved(k):
            return node.results[k]
        return (node, k)
    return t


def _try_record_inplace(ctx: "LazyContext", func: Any, info: OpInfo, args: tuple, kwargs: dict,
                        ) -> tuple[Any, str | None]:
    """`y.add_(1)` on a pending `y` that nothing aliases: record `add(y, 1)` and re-point `y`.

    Values recorded earlier from `y` keep referring to the old node, i.e. to the value before
    the update, exactly as in eager mode.  Not done when a pending view of `y` exists (it must
    see the update) or when the out-of-place result would differ in dtype or layout (in-place
    ops cast to `self`'s dtype; let eager mode do that, or raise).
    """
    target: LazyTensor = args[0]
    old = target._lz_node
    if old is None or old.is_view or old.has_views or old.container is not None:
        return None, "in-place on an aliased value"
    node, why = _functional_node(ctx, info, args, kwargs, target)
    if node is None:
        return None, why
    if target._lz_real is not None:         # a size-limit flush computed it meanwhile
        return None, "in-place on a computed value"
    _commit(ctx, node)
    trace.stop(ctx)            # the trie does not describe re-pointed wrappers
    old.wrappers[target._lz_idx] = None
    _repoint(target, node)
    return target, None


def _try_record_update(ctx: "LazyContext", func: Any, info: OpInfo, args: tuple, kwargs: dict,
                       ) -> tuple[Any, str | None]:
    """`w.add_(g)` on a *computed* `w` (a gradient from an earlier backward pass) with a pending
    `g`: record `add(w, g)` and make `w` pending again, instead of computing `g` now.

    Only when nothing else shares `w`'s memory (a view of it would have to see the update):
    its storage is then held by `w` and its computed tensor alone.  The computed tensor itself
    is not written, so values recorded from `w` before keep the old contents, as in eager mode.
    """
    target: LazyTensor = args[0]
    # held by the wrapper, its computed tensor and the storage object made for this call
    if torch._C._storage_Use_Count(target._lz_real.untyped_storage()._cdata) > 3:
        return None, "in-place on an aliased value"
    node, why = _functional_node(ctx, info, args, kwargs, target)
    if node is None:
        return None, why
    _commit(ctx, node)
    trace.stop(ctx)
    target._lz_real = None
    ctx._track([_repoint(target, node)])
    return target, None


def _functional_node(ctx: "LazyContext", info: OpInfo, args: tuple, kwargs: dict, target: LazyTensor,
                     ) -> tuple[LazyNode | None, str | None]:
    """A node for the out-of-place twin of an in-place op on `target` (not yet committed), or
    (None, why) when it cannot be recorded or its result would differ from `target` in dtype or
    layout (in-place ops cast to `self`'s dtype; let eager mode do that, or raise)."""
    node, why = _make_node(ctx, info.functional, op_info(info.functional), args, kwargs)
    if node is None:
        return None, why
    size, stride, _, dtype = node.descs[0]
    if node.container is not None or (size, stride, dtype) != (target.size(), target.stride(), target.dtype):
        return None, "in-place result differs in dtype or layout"
    return node, None


def _repoint(target: LazyTensor, node: LazyNode) -> weakref.ref:
    """Make `target` stand for `node`'s (single) output from now on."""
    target._lz_node, target._lz_idx = node, 0
    ref = node.wrappers[0] = weakref.ref(target)
    return ref


# --------------------------------------------------------------------------------------------
# eager execution
# --------------------------------------------------------------------------------------------

_REASONS = {
    "aten::_local_scalar_dense": "value read by .item()/bool()/int()/float()",
    "aten::is_nonzero": "value read by bool()",
    "aten::equal": "value read by torch.equal",
}


def _collect(a: Any, out: list) -> None:
    if isinstance(a, torch.Tensor):
        out.append(a)
    elif type(a) in (list, tuple):
        for x in a:
            _collect(x, out)


def _lazies(a: Any, out: list) -> None:
    if type(a) is LazyTensor:
        out.append(a)
    elif type(a) in (list, tuple):
        for x in a:
            _lazies(x, out)


# Ops that read only the metadata of their tensor argument: a pending argument is replaced by
# an uninitialized tensor of the same layout instead of being computed (dropout's empty_like).
_METADATA_ONLY = {aten.empty_like.default, aten.new_empty.default, aten.new_empty_strided.default}


def _standin(t: Any) -> Any:
    if type(t) is LazyTensor:
        if t._lz_real is not None:
            return t._lz_real      # the wrapper itself would dispatch back here, forever
        return torch.empty_strided(t.size(), t.stride(), dtype=t.dtype, device=t.device)
    return t


def eager_call(func: Any, args: tuple, kwargs: dict, ctx: "LazyContext | None", *, why: str | None = None,
               outside: bool = False) -> Any:
    """Run `func` eagerly: compute pending inputs, protect pending readers of memory it writes,
    run it on real tensors, hand back in-place / out= results as the caller's own tensors."""
    info = _INFO.get(id(func)) or op_info(func)
    if info.mutated:
        written: list = []
        for pos, arg_name in info.mutated:
            _collect(args[pos] if pos < len(args) else kwargs.get(arg_name), written)
        if written and (any(c.live for c in open_contexts()) or any(type(t) is LazyTensor for t in written)):
            _before_write(written, f"{func} writes memory that pending values read", ctx)
    lazies: list = []
    _lazies(args, lazies)
    if kwargs:
        _lazies(list(kwargs.values()), lazies)
    if not lazies:
        return func(*args, **kwargs)
    if func in _METADATA_ONLY:
        return func(*[_standin(a) for a in args], **kwargs)
    pend = [(t._lz_node, t._lz_idx) for t in lazies if t._lz_real is None]
    if pend:
        if outside:
            reason = f"{func} outside the lazy block"
        else:
            reason = _REASONS.get(func._schema.name if hasattr(func, "_schema") else "", None) or \
                f"{func} is not fusible" + (f" ({why})" if why else "")
        flush(pend, reason, ctx or current_context())
    rargs = unwrap(args, "eager op")
    rkwargs = {k: unwrap(v, "eager op") for k, v in kwargs.items()} if kwargs else kwargs
    out = func(*rargs, **rkwargs)
    if info.alias_returns:
        # `y.add_(1)` / `torch.add(a, b, out=y)` return `y` itself, not the real tensor inside it.
        outs = list(out) if isinstance(out, (tuple, list)) else [out]
        for r, pos, arg_name in info.alias_returns:
            orig = args[pos] if pos < len(args) else kwargs.get(arg_name)
            if type(orig) is LazyTensor:
                outs[r] = orig
        out = type(out)(outs) if isinstance(out, (tuple, list)) else outs[0]
    if info.mutated:
        for pos, arg_name in info.mutated:
            ws: list = []
            _lazies(args[pos] if pos < len(args) else kwargs.get(arg_name), ws)
            for w in ws:
                _resync(w)
    elif func is aten.detach.default:
        # keep the type through detach (nn.Parameter(t) requires detach() to return the same class)
        out = materialized_wrapper(out)
    return out


def _resync(w: LazyTensor) -> None:
    """After an eager in-place op on `w`'s real tensor: if it changed metadata or storage
    (`resize_`, `t_`, `set_`), move the wrapper along."""
    real = w._lz_real
    if real is None:
        return
    try:
        same_storage = w.untyped_storage()._cdata == real.untyped_storage()._cdata
    except Exception:
        same_storage = False
    if (w.size(), w.stride(), w.storage_offset()) != (real.size(), real.stride(), real.storage_offset()) \
            or not same_storage:
        sync_storage(w)


# --------------------------------------------------------------------------------------------
# writes to memory that pending values read
# --------------------------------------------------------------------------------------------

def _alias_key(ref: Any) -> Any:
    """Which memory a value lives in: a storage key for real tensors, the root node for pending
    values (a pending view lives in its root's future buffer)."""
    if type(ref) is tuple:
        node, k = ref
        if node.resolved(k):
            return storage_key(node.results[k])
        root = view_root(node, k)
        if root is None:   # pending view of something already real
            while not node.resolved(k):
                node, k = node.inputs[0]
            return storage_key(node.results[k])
        return ("node", id(root[0]))
    return storage_key(ref)


def _before_write(written: list, reason: str, ctx: "LazyContext | None") -> None:
    """Before `written` tensors are modified: compute pending values that read their memory
    through a computation (their eager value was fixed before the write).  Pending views of
    that memory are left alone, they must see the write.  Pending written tensors themselves are
    computed too (the eager op needs their memory)."""
    keys: set = set()
    need: list = []
    for t in written:
        if type(t) is LazyTensor and t._lz_real is None:
            need.append((t._lz_node, t._lz_idx))
            keys.add(_alias_key((t._lz_node, t._lz_idx)))
        else:
            real = t._lz_real if type(t) is LazyTensor else t
            keys.add(storage_key(real))
    live = []
    for c in open_contexts():
        live.extend(c.pending_values())
    if live:
        deps: dict[int, set] = {}
        for node in topo([v[0] for v in live]):
            d: set = set()
            if node.is_view:
                ref = node.inputs[0]
                if type(ref) is tuple and not ref[0].resolved(ref[1]):
                    d = deps.get(id(ref[0]), set())
            else:
                for ref in node.inputs:
                    r = ref_real(ref)
                    if r is not None:
                        d.add(storage_key(r))
                    else:
                        d.add(_alias_key(ref))
                        d |= deps.get(id(ref[0]), set())
            deps[id(node)] = d
        need.extend(v for v in live if deps.get(id(v[0]), set()) & keys)
    if need:
        flush(need, reason, ctx or current_context())


hooks.eager_call = eager_call
hooks.clear_plans = clear_plans
recorder.flush_first = _flush_first
recorder.note_graph_task = _note_graph_task
