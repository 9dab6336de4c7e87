"""When the lowering stores a value instead of inlining it into its readers.

A lowered pointwise value is an expression (`ComputedValue`) that each reader recomputes, fused
into its own kernel.  It is stored in a buffer (realized) instead when:
- several kernels would read it and recomputing it in each reads more bytes than storing it
  once (`kernels_reading`, `full_read_buffers`), or a reader runs past an ATen call that the
  value itself feeds (the next residual add of a transformer block) and would keep its inputs
  alive across that call;
- it is a window of its input (pooling: each reader would read the input that many times);
- ATen calls read it through different views (`aten_views_read`): each would store its own
  copy, in its own layout (the all-gathered, concatenated gradient of a tensor-parallel linear
  layer, read by the input-gradient matmul and, transposed, by the weight-gradient matmul, was
  computed and written twice, and the gathered buffer kept alive between the two);
- inlining it would keep more than MAX_DEFERRED_READS buffers of its size alive across an ATen
  call, buffers nothing else reads later (`defers_dying_reads`: a gradient summed over layers);
- on the CPU, its readers broadcast a transcendental (`broadcast_recomputes`: rotary embeddings'
  sin and cos tables, read by every batch and head);
- several scatters would each compute it, in kernels of their own, at a higher cost than
  storing it (`scatter_recomputes`: a GAT layer's edge scores; never an index expanded over
  heads, which each scatter reads at its smaller size, nor on a GPU a gather of whole rows,
  `gathers_rows`, or cheap arithmetic on one buffer of its size, `reads_as_stored`).
Where it is stored: channels-last when computed from channels-last buffers only
(`channels_last_inputs`); row-major when computed from smaller inputs only and read by kernels
only (`broadcast_only_for_kernels`); an attention bias with aligned strides, once per broadcast mask
(`aligned_attention_bias`).
"""
from __future__ import annotations

import itertools
import logging
import operator
from typing import Any, Sequence

import torch
import torch.fx as fx

from ..ir.buffers import ComputedValue, Layout, StridedValue, TensorValue, Unsupported, is_row_major
from .registry import LOWERINGS, REDUCTIONS, SCATTERS, is_view
from .values import ATTENTION_BIAS_ARG, CONVOLUTIONS, aligned_bias_layout, is_dense, layout_of, meta_val, misaligned, shape_of
from ..ir.nodes import EXPENSIVE_OPS, Node, const, cost, substitute, unit_move, var
from ..ir.nodes import loads as _loads, walk as _walk

log = logging.getLogger("torchfuse.lowering")


def should_store(lowering: Any, node: fx.Node, value: ComputedValue) -> bool:
    """Does the lowering store `node`'s value (module docstring)?"""
    config = lowering.config
    window = getattr(value, "window", False)
    if not config.fuse:
        return True
    if read_only_as_attention_bias(node):
        return False        # the attention lowering stores it, once (`aligned_attention_bias`)
    if aten_views_read(node) > 1:
        return True
    body = None
    if len(node.users) > 1 and (window or not readers_converge(node)):
        if window:
            return True
        body = _body(value)
        if cost(body) > config.inline_max_cost:
            return True
        recomputed_free = on_gpu(lowering) and (gathers_rows(value, body) or reads_as_stored(value, body))
        why = "" if recomputed_free else scatter_recomputes(node, value, body)
        if why:
            value.stored_because = why        # (explain() lists it with the refused fusions)
            log.debug("%s: stored, %s", node.name, why)
            return True
        # store it when that reads fewer bytes than recomputing it in every reader (each
        # reads its m inputs, where storing reads them once, writes it once and reads it
        # k times), or when readers past an ATen call would keep its inputs alive
        m = len(full_read_buffers(body, value.shape))
        if m >= 2:
            k, late = kernels_reading(node, lowering._node_order())
            if late or (k - 1) * (m - 1) > 2:
                return True
    if not window and lowering.device is not None and lowering.device.type == "cpu" and \
            broadcast_recomputes(node, value, body if body is not None else _body(value)):
        return True
    return not window and defers_dying_reads(lowering, node, value, body)


# transcendentals: a vectorized sin costs tens of cycles a lane (sqrt, division: a few)
_TRANSCENDENTAL = EXPENSIVE_OPS - {"truediv", "sqrt", "rsqrt", "hypot", "fmod", "remainder"}
# a reader computing this many elements per element of the value, the readers this many in all
# (fewer cost less than the kernel call that stores the value): storing it pays
BROADCAST_RECOMPUTE_FACTOR = 4
BROADCAST_RECOMPUTE_MIN = 32768


def broadcast_recomputes(node: fx.Node, value: ComputedValue, body: Node) -> bool:
    """Would inlining this transcendental value evaluate it many times per element, because its
    readers broadcast it?  Rotary embeddings' sin and cos of a [seq, head_dim] table, read by
    q and k of every batch and head (and by both again in the backward), were evaluated
    batch * heads times per element, about half the time of llama's rotary kernels on the CPU.
    Stored, each element is evaluated once.  (On the GPU a memory-bound kernel recomputes them
    for free, where storing costs a launch: CPU only, see should_store.)

    Only for values computed from stored inputs: a per-row statistic (layer norm's rsqrt of
    the variance, softmax's exp(x - max)) is a reduction's epilogue, evaluated once per row in
    the kernel that reduces, which storing it would split."""
    if not any(n.op in _TRANSCENDENTAL for n in _walk(body)):
        return False
    size = _static_numel(value.shape)
    users = [u for u in readers(node) if u.target in LOWERINGS]     # (an ATen call reads it stored)
    sizes = [_static_numel(shape_of(meta_val(u))) if isinstance(meta_val(u), torch.Tensor) else None for u in users]
    if size is None or not users or any(n is None for n in sizes):
        return False
    if max(sizes) < BROADCAST_RECOMPUTE_FACTOR * size or sum(sizes) < BROADCAST_RECOMPUTE_MIN or \
            _inlines_reduction(node):
        return False
    log.debug("%s: stored, since its readers would evaluate its transcendental %d times (%d elements)",
              node.name, sum(sizes), size)
    return True


def scatter_recomputes(node: fx.Node, value: ComputedValue, body: Node) -> str:
    """Why the value is stored because several scatters would each compute it, or "".

    A scatter is a kernel of its own (registry.SCATTERS): a value that k kernels read, s >= 1 of
    them scatters and the other readers (elementwise, reductions) counted as one more kernel,
    is evaluated k times if inlined.  An evaluation costs `cost(body)` per element plus one per
    gather (a load at a loaded index); storing costs a write and a read in each reader, so the
    value is stored where (k - 1) evaluations cost more than k + 1.  A GAT layer's edge score
    leaky_relu(a[src] + b[dst]) was computed by its scatter amax, its scatter sum of exp(score -
    max[dst]) and its sum of weighted messages, the exp by the last two: 0.52 + 0.33 ms of a
    3.8 ms layer on one CPU thread, where Inductor computes each once.  A scatter whose loops are
    the value's own takes the stored value's loop as its prologue (scheduler/fusion.py
    `_scatter_prologue`): no kernel more.  Where none does, the store is a kernel call more, paid
    only from BROADCAST_RECOMPUTE_MIN elements on."""
    scatters, other, direct = _scatter_readers(node)
    k = len(scatters) + int(other)
    if not scatters or k < 2 or _broadcasts_smaller(node):
        return ""
    per_eval = cost(body) + _gathers(body)
    if (k - 1) * per_eval <= k + 1:
        return ""
    size = _static_numel(value.shape)
    if not direct and size is not None and size < BROADCAST_RECOMPUTE_MIN:
        return ""
    return (f"{k} kernels read it, {len(scatters)} of them scatters ({', '.join(u.name for u in scatters)}), "
            f"and each would compute it (cost {per_eval} an element, {k * per_eval} in all, where storing "
            f"costs {per_eval + k + 1})")


# A gathered row at least this long (bytes) is read as whole cache lines however it is gathered
ROW_GATHER_BYTES = 128


def on_gpu(lowering: Any) -> bool:
    return lowering.device is not None and lowering.device.type == "cuda"


def gathers_rows(value: ComputedValue, body: Node) -> bool:
    """Is the value a gather of whole rows (`grad[dst]` of [nodes, heads, channels] rows, and
    nothing computed on them but a cast)?  On a GPU, where these kernels are memory-bound, each
    reader gathering the rows again reads the bytes it would read from a stored copy, and the
    copy's write (and its memory) is saved: a GAT training step's backward stored its gathered
    gradient ([edges, heads, channels], 1 GB a layer at a million edges) for the index_add and
    the attention gradient's sum to read (`scatter_recomputes` counts a gather as compute, as
    it is on a CPU).  Rows of ROW_GATHER_BYTES or more: a narrower row (a per-edge score
    gathered from [nodes, heads]) reads whole sectors for a few bytes, where a stored copy is
    read contiguously."""
    while body.op == "cast":
        body = body.args[0]
    if body.op != "load" or not value.ndim:
        return False
    address = body.args[0]
    inner = [x for x in _walk(address) if x.op == "load"]
    last = var(f"i{value.ndim - 1}")
    if not inner or any(last in _walk(ld) for ld in inner):
        return False
    gathered = {x: const(0) for x in _walk(address) if x.op in ("load", "check_index")}
    width = value.shape[-1]
    return unit_move(substitute(address, gathered), last.arg) == 1 and width.op == "const" and \
        int(width.arg) * value.dtype.itemsize >= ROW_GATHER_BYTES


def reads_as_stored(value: ComputedValue, body: Node) -> bool:
    """Does recomputing the value in a reader read what reading it stored would?  Cheap
    arithmetic (nothing from EXPENSIVE_OPS) on one buffer of the value's size, plus broadcast
    ones (a bias), loaded at the value's own indices (no gather): each reader loads that buffer
    where it would load the stored copy, and on a GPU, where such kernels are memory-bound, the
    arithmetic is free, so storing only adds a write (and the memory).  GIN's activation
    relu(x @ w + b), read by the next layer's gather-scatter and by its (1 + eps) * x term, was
    stored (`scatter_recomputes` counts the arithmetic, as a CPU pays it): 100 MB a layer written
    and read again, peak memory +15% against Inductor's, which recomputes it."""
    if any(n.op in EXPENSIVE_OPS for n in _walk(body)):
        return False
    return not _gathers(body) and len(full_read_buffers(body, value.shape)) <= 1


def _gathers(body: Node) -> int:
    """The body's gathers: loads at a loaded index."""
    return sum(1 for ld in _loads(body) if any(x.op == "load" for x in _walk(ld.args[0])))


def _broadcasts_smaller(node: fx.Node) -> bool:
    """Is `node` an `expand` of a smaller tensor?  Stored, it is written and read at its full
    size; inlined, each reader loads the smaller tensor, which stays in cache across the
    broadcast dims.  torch_geometric's scatters expand an edge index [E] to [E, heads] for every
    scatter: stored, GAT wrote and read an int64 [E, heads] per layer (8 bytes an element)
    where the index it repeats is E elements."""
    if node.op != "call_function" or node.target is not torch.ops.aten.expand.default:
        return False
    out, src = meta_val(node), meta_val(node.args[0])
    return isinstance(out, torch.Tensor) and isinstance(src, torch.Tensor) and out.numel() > src.numel()


def _scatter_readers(node: fx.Node, depth: int = 8) -> tuple[list[fx.Node], bool, bool]:
    """(the scatters that would compute `node`'s value in their loops, reached through views
    and elementwise ops; whether anything else reads it; whether a scatter reads it itself over
    loops of its shape).  Past `depth` elementwise ops, a reader counts as another."""
    scatters: list[fx.Node] = []
    other = direct = False
    own = _squeezed(node)
    stack, seen = [(node, 0)], set()
    while stack:
        n, d = stack.pop()
        for user in n.users:
            if user in seen or user.target in _SHAPE_ONLY:
                continue
            seen.add(user)
            spec = SCATTERS.get(user.target) if user.op == "call_function" else None
            if spec is not None:
                start, domain = spec
                at = [i for i, a in enumerate(user.args) if a is n or (isinstance(a, (list, tuple)) and n in a)]
                if start in at:
                    other = True        # the kernel that initialises the output reads it
                if any(i != start for i in at) or any(v is n for v in user.kwargs.values()):
                    scatters.append(user)
                    direct |= d == 0 and domain is not None and _squeezed(user.args[domain]) == own
            elif user.op == "call_function" and user.target in REINDEX:
                stack.append((user, d))
            elif user.op == "call_function" and user.target in LOWERINGS and user.target not in REDUCTIONS \
                    and d < depth:
                stack.append((user, d + 1))
            else:
                other = True
    return scatters, other, direct


def _squeezed(node: Any) -> tuple | None:
    """The node's shape without its dims of size 1 (which never change a loop), or None."""
    val = meta_val(node) if isinstance(node, fx.Node) else None
    if not isinstance(val, torch.Tensor):
        return None
    return tuple(s for s in shape_of(val) if not (s.op == "const" and s.arg == 1))


def _static_numel(shape: Sequence[Node]) -> int | None:
    total = 1
    for dim in shape:
        if dim.op != "const":
            return None
        total *= dim.arg
    return total


def _inlines_reduction(node: fx.Node, depth: int = 12) -> bool:
    """Does the expression of `node` reach a reduction through lowered ops (looking up at most
    `depth` nodes; past that, assume it does)?"""
    stack, seen = [(node, 0)], set()
    while stack:
        n, d = stack.pop()
        if n in seen or n.op != "call_function":
            continue
        seen.add(n)
        if n.target in REDUCTIONS or d > depth:
            return True
        if n.target in LOWERINGS:
            stack.extend((a, d + 1) for a in n.all_input_nodes)
    return False


def read_only_as_attention_bias(node: fx.Node) -> bool:
    """Is every reader an attention call taking the value as its bias, and nothing else?  Then
    the attention lowering stores it: aligned, and with stride 0 over the dims it is broadcast
    over.  Stored here first, for its many readers (a decoder's mask, read by every layer), it
    was written dense: Mistral's mask, expanded to 32 heads, took 1 GiB where its values take
    32 MiB."""
    if not node.users:
        return False
    for user in node.users:
        spec = ATTENTION_BIAS_ARG.get(user.target)
        if spec is None:
            return False
        pos, name = spec
        bias = user.args[pos] if pos < len(user.args) else user.kwargs.get(name)
        if bias is not node or sum(a is node for a in (*user.args, *user.kwargs.values())) != 1:
            return False
    return True


# ops that read only their argument's shape and dtype (torch_geometric's aggregation starts from
# `src.new_zeros(size)` of the messages it scatters): no kernel computes the value for them
_SHAPE_ONLY = frozenset({
    torch.ops.aten.new_zeros.default, torch.ops.aten.new_ones.default, torch.ops.aten.new_empty.default,
    torch.ops.aten.new_full.default, torch.ops.aten.new_empty_strided.default, torch.ops.aten.zeros_like.default,
    torch.ops.aten.ones_like.default, torch.ops.aten.empty_like.default, torch.ops.aten.full_like.default,
    torch.ops.aten.sym_size.int, torch.ops.aten.sym_numel.default})


def readers_converge(node: fx.Node, depth: int = 6) -> bool:
    """Do all of the value's readers feed one elementwise expression within `depth` steps of
    single-reader elementwise ops?  A bilinear upsample's row interpolation `top` is read by
    `bottom - top` and by `top + (...) * w`, one expression: inlined, the kernel computes it
    once (the emitters share common subexpressions), where storing it writes and reads the
    whole upsampled tensor once more, however costly its expression.  Readers of its shape
    alone (`_SHAPE_ONLY`) read no element: with one other reader, that one is the expression."""
    every = readers(node)
    users = [u for u in every if u.target not in _SHAPE_ONLY]
    if len(users) < 2:
        return len(users) == 1 and len(every) > 1
    common: set[fx.Node] | None = None
    for user in users:
        chain, n = set(), user
        for _ in range(depth):
            # (a reduction or a scatter runs in a loop of its own: no expression goes through it)
            if n.target not in LOWERINGS or n.target in REDUCTIONS or n.target in SCATTERS:
                break
            chain.add(n)
            nxt = readers(n)
            if len(nxt) != 1:
                break
            n = nxt[0]
        common = chain if common is None else common & chain
        if not common:
            return False
    return True


def channels_last_inputs(lowering: Any, value: ComputedValue) -> bool:
    """Is a 4-d intermediate value computed from channels-last 4-d buffers only?  Then it is
    stored channels-last, whatever layout its node has: that layout comes from a decomposition
    (an upsample's gathers return NCHW tensors, and only the decomposition's final clone is
    channels-last again), and storing it so makes its kernel a transpose, uncoalesced on one
    side, for readers that read it back in channels-last order.  Not where the value's last dim
    is the buffers' channels (unit stride in them): a permuted view of a channels-last map
    ([N, H, W, C], ConvNeXt's LayerNorm2d) is already laid out by its own node, and
    channels-last strides over its dims put H, not C, at stride 1 (an fp32 copy of the map
    written across memory: 0.34 ms per call at [64, 56, 56, 96] on an H100).  (A channel
    shuffle's dim 1 moves its input by several channels, an upsample's last dim by 0 or C.)"""
    body = _body(value)
    found = False
    for name in full_read_buffers(body, value.shape):
        sizes, strides = lowering.buffer_meta.get(name, ((), ()))[:2]
        if len(sizes) != 4:
            continue
        if not (strides[1] == const(1) and strides[3] == sizes[1] and sizes[1] != const(1)):
            return False
        if any(unit_move(ld.args[0], "i3") == 1 for ld in _loads(body) if ld.arg == name):
            return False
        found = True
    return found


def broadcast_only_for_kernels(lowering: Any, node: fx.Node, value: ComputedValue) -> bool:
    """Is a value to be stored computed from smaller (broadcast or gathered) inputs only, read
    by generated kernels only, and laid out by its node other than row-major?  Then it is
    stored row-major.  Its node's strides are eager's TensorIterator following a permuted input
    (T5's position bias: an embedding lookup [S, S, H] permuted to [H, S, S], plus a [B, 1, 1, S]
    mask, came out [B, H, S, S] with the heads at stride 1), and there is no input layout to
    keep: every layer's softmax then read it along its rows at a stride of H elements (0.152
    against Inductor's 0.101 ms per layer at [8, 12, 512, 512] on an H100).  ATen readers and
    the graph's outputs keep the node's strides (their fake tensors were traced with them)."""
    meta = getattr(value, "meta", None)
    if meta is None or value.ndim < 2 or not is_dense(meta) or _row_major(meta):
        return False
    if full_read_buffers(_body(value), value.shape):
        return False
    pending, seen = list(node.users), set()
    while pending:
        user = pending.pop()
        if user in seen:
            continue
        seen.add(user)
        if user.op != "call_function" or user.target not in LOWERINGS or str(user.target) in lowering.forced_fallbacks:
            return False
        if is_view(user):          # (a view's readers read the value through it)
            pending += list(user.users)
    return True


def _row_major(t: torch.Tensor) -> bool:
    try:
        layout = layout_of(t)
    except Unsupported:
        return True
    return is_row_major(layout.sizes, layout.strides)


def _body(value: ComputedValue) -> Node:
    """The value's element expression at symbolic indices i0, i1, ..."""
    return value.load([var(f"i{k}") for k in range(value.ndim)])


def defers_dying_reads(lowering: Any, node: fx.Node, value: ComputedValue, body: Node | None = None) -> bool:
    """Would inlining this value into its readers keep more than MAX_DEFERRED_READS buffers of its
    size alive across an ATen call, buffers nothing else reads after it, which storing it frees
    at once?  A gradient summed over the layers that share a tensor (T5's attention bias) is a
    chain of adds, each read by the next past the next layer's ATen calls: inlined, the whole
    chain became one kernel at the end reading every layer's term, all alive until then, however
    deep the model.  Stored every few layers, at most four are.  A sum of three (a layer's q, k
    and v input gradients, read by its layer norm's backward past one more matmul) stays
    inlined: storing it saves one buffer and costs a kernel in every layer.  `body`: the value's
    expression, if the caller built it."""
    order = lowering._node_order()
    if not aten_call_before_readers(node, order):     # (cheap first: most readers are next)
        return False
    full = full_read_buffers(body if body is not None else _body(value), value.shape)
    if len(full) <= MAX_DEFERRED_READS:
        return False
    if lowering.producers is None:
        lowering.producers = ProducerIndex()
    producers = lowering.producers.update(lowering.env)
    start, dying = order[node], 0
    for name in full:
        nodes = producers.get(name)
        if nodes and max((order[r] for p in nodes for r in readers(p)), default=start) <= start:
            dying += 1
    return dying > MAX_DEFERRED_READS


class ProducerIndex:
    """Buffer name -> the fx nodes whose lowered value is that buffer (or a strided view of it),
    updated with the values lowered since the last call (the lowering's env only grows)."""

    def __init__(self) -> None:
        self.producers: dict[str, list[fx.Node]] = {}
        self.seen = 0

    def update(self, env: dict[fx.Node, Any]) -> dict[str, list[fx.Node]]:
        if self.seen < len(env):
            for fx_node, val in itertools.islice(env.items(), self.seen, None):
                for v in val if isinstance(val, (list, tuple)) else (val,):
                    if isinstance(v, StridedValue):
                        self.producers.setdefault(v.buffer, []).append(fx_node)
            self.seen = len(env)
        return self.producers


# Ops that only re-index their input: their readers read the value.
REINDEX = frozenset({
    torch.ops.aten.view.default, torch.ops.aten.reshape.default, torch.ops.aten._unsafe_view.default,
    torch.ops.aten.permute.default, torch.ops.aten.transpose.int, torch.ops.aten.t.default,
    torch.ops.aten.expand.default, torch.ops.aten.unsqueeze.default, torch.ops.aten.squeeze.dim,
    torch.ops.aten.squeeze.dims, torch.ops.aten.squeeze.default, torch.ops.aten.alias.default,
    torch.ops.prims.broadcast_in_dim.default})


def item_readers(node: fx.Node, i: int) -> list[fx.Node]:
    """The nodes reading item `i` of a node with several outputs (through its getitem)."""
    return [u for g in node.users if g.target is operator.getitem and g.args[1] == i for u in g.users]


def kernels_reading(node: fx.Node, order: dict[fx.Node, int], horizon: int = 400) -> tuple[int, bool]:
    """(k, late): how many kernels will read this value, at least, and whether one of them runs
    after an op that is not lowered (a matmul, a convolution) and itself reads the value.

    Reductions of one output size share a loop (a batch norm's two sums); elementwise readers
    may fuse into one kernel, except those downstream of an ATen call fed by the value (the
    next residual add of a transformer block, past the block's matmuls): those run later and
    keep whatever the value reads alive across the call.  Readers more than `horizon` nodes
    away count as late without looking."""
    reduction_sizes, elementwise = set(), []
    for user in readers(node):
        if user.target in REDUCTIONS:
            val = meta_val(user)
            val = val[0] if isinstance(val, (list, tuple)) else val
            reduction_sizes.add(str(val.numel()) if isinstance(val, torch.Tensor) else None)   # (SymInts do not hash)
        else:
            elementwise.append(user)
    if not elementwise:
        return len(reduction_sizes), False
    start, last = order[node], max(order[u] for u in elementwise)
    if last - start > horizon:
        return len(reduction_sizes) + 2, True
    # forward from the value: which nodes depend on it through an ATen call
    depends, across = {node}, set()
    n = node.next
    while order.get(n, last + 1) <= last:
        ins = [a for a in n.all_input_nodes if a in depends]
        if ins:
            depends.add(n)
            if any(a in across or (a is not node and a.op == "call_function" and a.target not in LOWERINGS
                                   and a.target is not operator.getitem) for a in ins):
                across.add(n)
        n = n.next
    late = [u for u in elementwise if u in across]
    return len(reduction_sizes) + int(len(late) < len(elementwise)) + int(bool(late)), bool(late)


def readers(node: fx.Node) -> list[fx.Node]:
    """The nodes that read `node`'s elements, looking through views and reindexing."""
    found: list[fx.Node] = []
    stack, seen = list(node.users), set()
    while stack:
        user = stack.pop()
        if user not in seen:
            seen.add(user)
            if user.target in REINDEX:
                stack.extend(user.users)
            else:
                found.append(user)
    return found


def aten_views_read(node: fx.Node) -> int:
    """Through how many different views (the value itself counting as one) ops without a
    lowering (matmuls, collectives, attention) read the value.  Each call stores the value it
    is given (`GraphLowering.stored`, once per value): a view of an unstored value is a value of
    its own, so two calls given two views of it (`x` and `x.t()`) stored it twice, where
    storing it at its node makes both views of one buffer.  Convolutions and attention calls
    given a bias are left out: they store what they are given in a layout of their own
    (channels-last, aligned rows broadcast over heads), once per value."""
    seen_through: set[fx.Node] = set()
    stack, seen = [(u, node) for u in node.users], set()
    while stack:
        user, parent = stack.pop()
        if user in seen:
            continue
        seen.add(user)
        if user.target in REINDEX:
            stack.extend((u, user) for u in user.users)
        elif user.op == "call_function" and user.target not in LOWERINGS and user.target is not operator.getitem \
                and user.target not in CONVOLUTIONS and user.target not in ATTENTION_BIAS_ARG:
            seen_through.add(parent)
    return len(seen_through)


# see defers_dying_reads
MAX_DEFERRED_READS = 3


def aten_call_before_readers(node: fx.Node, order: dict[fx.Node, int], horizon: int = 400) -> bool:
    """Do the value's readers run after an op that is not lowered (a matmul, an attention
    backward), so that inlining it there keeps what it reads alive across that op's allocation?"""
    users = readers(node)
    if not users:
        return False
    start, last = order[node], max(order[u] for u in users)
    if last - start > horizon:
        return True
    n = node.next
    while order.get(n, last) < last:
        if n.op == "call_function" and n.target not in LOWERINGS and n.target is not operator.getitem:
            return True
        n = n.next
    return False


def full_read_buffers(body: Node, shape: Sequence[Node]) -> set[str]:
    """The buffers an inlined value reads one element of per element of its own (indices that
    use every non-trivial loop variable): a broadcast bias or a per-row statistic does not count.
    Inlining a value that reads two such buffers into two kernels reads both in each, and keeps
    both alive until the last one ran, where storing it reads one buffer and frees both early (a
    residual sum `x + f(x)` read by a LayerNorm's statistics, its normalization and the next
    residual)."""
    needed = {f"i{k}" for k, size in enumerate(shape) if not (size.op == "const" and size.arg == 1)}
    return {ld.arg for ld in _loads(body) if needed <= {x.arg for x in _walk(ld.args[0]) if x.op == "var"}}


def aligned_attention_bias(lowering: Any, node: fx.Node, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """A computed attention bias is written with aligned strides (`aligned_bias_layout`): a
    contiguous [windows, heads, 49, 49] bias has a batch stride of 7203 elements, which the
    CUDA kernels refuse."""
    pos, name = ATTENTION_BIAS_ARG[node.target]
    bias = args[pos] if pos < len(args) else kwargs.get(name)
    if not isinstance(bias, TensorValue) or bias.ndim < 2:
        return args, kwargs
    layout = aligned_bias_layout(bias.shape)
    stored = _broadcast_bias(lowering, bias) or lowering.stored(bias, layout)
    if stored.layout.strides != layout.strides and misaligned(stored.layout, layout):
        # realized earlier for another reader, or a dense input: an aligned copy (one for
        # all the layers reading the same mask)
        key = (stored.buffer, stored.layout)
        copy = lowering._aligned_copies.get(key)
        if copy is None:
            copy = lowering._aligned_copies[key] = lowering.realize(stored, layout=layout)
        stored = copy
    if pos < len(args):
        return args[:pos] + (stored,) + args[pos + 1:], kwargs
    return args, {**kwargs, name: stored}


def _broadcast_bias(lowering: Any, bias: TensorValue) -> StridedValue | None:
    """A computed bias broadcast over some dims (a [B, 1, S, S] mask expanded to every head)
    stored without them: aligned over its own dims, stride 0 over the broadcast ones.
    Written dense, Mistral's [2, 32, 2048, 2048] fp32 mask took 1 GiB, where its values
    take 32 MiB (the kernels read a broadcast bias through its strides, as eager passes it)."""
    if not isinstance(bias, ComputedValue):
        return None
    done = lowering._broadcast_biases.get(id(bias))
    if done is not None:
        return done[1]
    used = {n.arg for n in _walk(_body(bias)) if n.op == "var"}
    broadcast = [k for k, size in enumerate(bias.shape)
                 if f"i{k}" not in used and not (size.op == "const" and size.arg == 1)]
    if not broadcast:
        return None
    own = tuple(const(1) if k in broadcast else size for k, size in enumerate(bias.shape))
    values = ComputedValue(own, bias.dtype, bias.load)
    stored = lowering.realize(values, layout=aligned_bias_layout(own))
    strides = tuple(const(0) if k in broadcast else st for k, st in enumerate(stored.layout.strides))
    result = StridedValue(stored.buffer, Layout(tuple(bias.shape), strides), bias.dtype)
    lowering._broadcast_biases[id(bias)] = (bias, result)
    return result
