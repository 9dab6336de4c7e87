"""Lowerings of views (index remapping, no data movement) and indexing ops (indirect loads).

A view of a value whose layout is the fx node's own layout (graph inputs, ATen outputs, buffers
we realized with eager's strides) is a new `StridedValue` whose layout is read off the view's fake
tensor: zero-copy, and usable by ATen fallbacks.  A view of an unrealized value becomes a closure
that remaps the index, so it fuses into its consumers.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Sequence

import torch

from ..ir.buffers import ComputedValue, Layout, StridedValue, TensorValue, Unsupported, contiguous_strides
from ..backends.base import Features
from .cat_slots import cat_in_place
from .pointwise import bcast_load, register, upcast
from .values import layout_of, meta_val, shape_of, size_hint, sym_to_node
from ..ir.nodes import INDEX, Node, cast, const, cost, floordiv, load, mod, op, var, where

if TYPE_CHECKING:
    from .graph import GraphLowering

aten = torch.ops.aten
prims = torch.ops.prims


def _meta_view(lw: GraphLowering, x: Any, out: Any = None) -> StridedValue | None:
    """Zero-copy view when `x` is stored exactly as its fx node's fake tensor says (`out`: the
    fake tensor of the view, by default the node's own)."""
    if not isinstance(x, StridedValue):
        return None
    src = lw.current.args[0]
    meta_in, meta_out = meta_val(src), lw.out_meta() if out is None else out
    if not isinstance(meta_in, torch.Tensor) or not isinstance(meta_out, torch.Tensor):
        return None
    lin = layout_of(meta_in)
    # a size-1 dimension's stride says nothing (a keepdim reduction's is 0, its fake tensor's
    # the row length): compared, a bias gradient's `sum(keepdim).view(-1)` was a copy kernel
    if lin.sizes != x.layout.sizes or any(a != b for a, b, n in zip(lin.strides, x.layout.strides, lin.sizes)
                                          if not (n.op == "const" and n.arg == 1)):
        return None
    try:
        delta = sym_to_node(meta_out.storage_offset()) - sym_to_node(meta_in.storage_offset())
    except Unsupported:
        return None
    out = layout_of(meta_out)
    return StridedValue(x.buffer, Layout(out.sizes, out.strides, x.layout.offset + delta), x.dtype)


def remap(lw: GraphLowering, x: TensorValue, fn) -> TensorValue:
    """A view: the zero-copy strided form when possible, else a closure `out index -> x index`."""
    strided = _meta_view(lw, x)
    if strided is not None:
        return strided
    return ComputedValue(lw.out_shape(), x.dtype, lambda idx: x.load(fn(list(idx))))


def _norm(d: int, n: int) -> int:
    return d + n if d < 0 else d


def _empty(shape: Sequence[Node]) -> bool:
    return any(s.op == "const" and s.arg == 0 for s in shape)


def _nothing(lw: GraphLowering, x: TensorValue) -> ComputedValue:
    """An empty result: its loops never run, so the body only needs to be well formed (the index
    maths of a reshape or repeat would divide by the zero size)."""
    return ComputedValue(lw.out_shape(), x.dtype, lambda idx: x.load([const(0)] * x.ndim))


@register(aten.view.default, aten._unsafe_view.default, aten.reshape.default, aten.view.dtype)
def _view(lw, x, size):
    if isinstance(size, torch.dtype):
        if size != x.dtype:
            raise Unsupported("view as another dtype (bit cast)")
        return x
    out_shape = lw.out_shape()
    in_shape = x.shape
    if out_shape == in_shape:
        return x
    if _empty(out_shape):
        return _meta_view(lw, x) or _nothing(lw, x)
    in_strides = contiguous_strides(in_shape)
    out_strides = contiguous_strides(out_shape)

    def fn(idx):
        flat = const(0)
        for i, st in zip(idx, out_strides):
            flat = flat + i * st
        sub = []
        for k, st in enumerate(in_strides):
            q = floordiv(flat, st)
            sub.append(q if k == 0 else mod(q, in_shape[k]))
        return sub
    return remap(lw, x, fn)


@register(aten.permute.default)
def _permute(lw, x, dims):
    dims = [_norm(d, x.ndim) for d in dims]

    def fn(idx):
        sub = [None] * len(dims)
        for out_pos, d in enumerate(dims):
            sub[d] = idx[out_pos]
        return sub
    return remap(lw, x, fn)


@register(aten.transpose.int)
def _transpose(lw, x, d0, d1):
    d0, d1 = _norm(d0, x.ndim), _norm(d1, x.ndim)

    def fn(idx):
        idx[d0], idx[d1] = idx[d1], idx[d0]
        return idx
    return remap(lw, x, fn)


@register(aten.t.default)
def _t(lw, x):
    return remap(lw, x, lambda idx: idx[::-1])


@register(aten.expand.default)
def _expand(lw, x, size, *, implicit=False):
    out_nd = len(lw.out_shape())
    off = out_nd - x.ndim
    return remap(lw, x, lambda idx: [const(0) if (s.op == "const" and s.arg == 1) else idx[off + k]
                                     for k, s in enumerate(x.shape)])


@register(aten.unsqueeze.default)
def _unsqueeze(lw, x, dim):
    dim = _norm(dim, x.ndim + 1)
    return remap(lw, x, lambda idx: idx[:dim] + idx[dim + 1:])


@register(aten.squeeze.default, aten.squeeze.dim, aten.squeeze.dims)
def _squeeze(lw, x, dims=None):
    if x.ndim == 0:
        return x              # squeeze(0) / squeeze(-1) of a 0-d tensor is the tensor itself
    if dims is None:
        dims = [k for k, s in enumerate(x.shape) if s.op == "const" and s.arg == 1]
    elif isinstance(dims, int):
        dims = [dims]
    dims = {_norm(d, x.ndim) for d in dims if x.shape[_norm(d, x.ndim)] == const(1)}

    def fn(idx):
        it = iter(idx)
        return [const(0) if k in dims else next(it) for k in range(x.ndim)]
    return remap(lw, x, fn)


@register(aten.slice.Tensor)
def _slice(lw, x, dim=0, start=None, end=None, step=1):
    dim = _norm(dim, x.ndim)
    meta_in = meta_val(lw.current.args[0])
    size = meta_in.shape[dim]
    start = 0 if start is None else start
    symbolic_from_end = False
    if isinstance(start, int):
        if isinstance(size, int):
            start = max(0, min(start + size, size) if start < 0 else start)
        elif start < 0:
            # x[:, -k:] of a symbolic size: counted from the end (tracing the slice guarded that
            # size - k >= 0, as eager would otherwise clamp it to 0)
            start, symbolic_from_end = x.shape[dim] + const(start), True
    elif not isinstance(start, Node):
        raise Unsupported("symbolic negative slice start")
    start_n = start if isinstance(start, Node) else const(start)
    if isinstance(start, Node) and start.op != "const" and not symbolic_from_end:
        # symbolic start may be negative at run time; only the meta path knows
        strided = _meta_view(lw, x)
        if strided is None:
            raise Unsupported("slice with a symbolic start of an unrealized value")
        return strided

    def fn(idx):
        idx[dim] = start_n + idx[dim] * step
        return idx
    return remap(lw, x, fn)


@register(aten.select.int)
def _select(lw, x, dim, index):
    dim = _norm(dim, x.ndim)
    if isinstance(index, int) and index < 0:
        index = index + x.shape[dim] if isinstance(x.shape[dim], Node) else index
    index_n = index if isinstance(index, Node) else const(index)
    return remap(lw, x, lambda idx: idx[:dim] + [index_n] + idx[dim:])


@register(aten.alias.default)
def _alias(lw, x):
    return x


@register(aten.as_strided.default)
def _as_strided(lw, x, size, stride, storage_offset=None):
    strided = _meta_view(lw, x)
    if strided is None:
        if isinstance(x, ComputedValue) and x.meta is not None:
            strided = _meta_view(lw, lw.realize(x))
        if strided is None:
            raise Unsupported("as_strided of a value not stored as its fake tensor says")
    return strided


@register(aten.split.Tensor, aten.split_with_sizes.default, aten.unbind.int)
def _split(lw, x, split=None, dim=0):
    outs = lw.out_meta()
    views = [_meta_view(lw, x, meta) for meta in outs]
    if views and all(v is not None for v in views):
        return tuple(views)     # zero-copy pieces of a stored tensor, aliasing it as in eager
    if lw.current.target == aten.unbind.int:
        dim = split if split is not None else 0
    dim = _norm(dim, x.ndim)
    results, start = [], const(0)
    for meta in outs:
        if lw.current.target == aten.unbind.int:
            s0 = start
            results.append(ComputedValue(shape_of(meta), x.dtype,
                                         lambda idx, s0=s0: x.load(list(idx[:dim]) + [s0] + list(idx[dim:]))))
            start = start + 1
            continue
        s0 = start
        results.append(ComputedValue(shape_of(meta), x.dtype,
                                     lambda idx, s0=s0: x.load(list(idx[:dim]) + [s0 + idx[dim]] + list(idx[dim + 1:]))))
        start = start + sym_to_node(meta.shape[dim])
    return tuple(results)


@register(aten.flip.default)
def _flip(lw, x, dims):
    dims = {_norm(d, x.ndim) for d in dims}
    return ComputedValue(lw.out_shape(), x.dtype,
                         lambda idx: x.load([x.shape[k] - 1 - i if k in dims else i for k, i in enumerate(idx)]))


def _rolled(i: Node, shift: Any, size: Node) -> Node:
    """The source index of `i` in a roll by `shift` along a dim of `size`: (i - shift) mod size,
    written as a select between i - s and i - s + size (s = shift mod size), so the index never
    goes through `%` of a value that index simplification could make negative."""
    if isinstance(shift, Node) or size.op != "const":
        raise Unsupported("roll with a symbolic shift or size")
    if size.arg == 0:
        return i
    s = int(shift) % size.arg
    if s == 0:
        return i
    return where(op("ge", i, const(s), dtype=torch.bool), i - s, i + (size.arg - s))


@register(aten.roll.default)
def _roll(lw, x, shifts, dims=()):
    if _empty(x.shape):
        return _nothing(lw, x)
    if not dims:
        # roll of the flattened tensor: flat index -> rolled flat index -> n-d index
        if len(shifts) != 1:
            raise Unsupported("roll without dims takes one shift")
        shape, strides = x.shape, contiguous_strides(x.shape)
        numel = const(1)
        for sz in shape:
            numel = numel * sz

        def flat_fn(idx):
            flat = const(0)
            for i, st in zip(idx, strides):
                flat = flat + i * st
            src = _rolled(flat, shifts[0], numel)
            return [mod(floordiv(src, st), sz) if k else floordiv(src, st) for k, (st, sz) in enumerate(zip(strides, shape))]
        return ComputedValue(lw.out_shape(), x.dtype, lambda idx: x.load(flat_fn(list(idx))))
    pairs = {_norm(d, x.ndim): s for d, s in zip(dims, shifts)}

    def fn(idx):
        return [_rolled(i, pairs[k], x.shape[k]) if k in pairs else i for k, i in enumerate(idx)]
    return ComputedValue(lw.out_shape(), x.dtype, lambda idx: x.load(fn(list(idx))))


@register(aten.diagonal.default)
def _diagonal(lw, x, offset=0, dim1=0, dim2=1):
    d1, d2 = _norm(dim1, x.ndim), _norm(dim2, x.ndim)
    if isinstance(offset, Node):
        raise Unsupported("diagonal with a symbolic offset")
    rest = [k for k in range(x.ndim) if k not in (d1, d2)]

    def fn(idx):
        sub = [None] * x.ndim
        for k, i in zip(rest, idx):
            sub[k] = i
        diag = idx[-1]
        sub[d1] = diag + max(-offset, 0)
        sub[d2] = diag + max(offset, 0)
        return sub
    return remap(lw, x, fn)


@register(aten.repeat.default)
def _repeat(lw, x, repeats):
    if _empty(lw.out_shape()):
        return _nothing(lw, x)
    off = len(repeats) - x.ndim
    return ComputedValue(lw.out_shape(), x.dtype,
                         lambda idx: x.load([mod(idx[off + k], s) for k, s in enumerate(x.shape)]))


# --------------------------------------------------------------------------------------------
# piecewise loads: cat, pad, scatter of slices
# --------------------------------------------------------------------------------------------

def masked(x: TensorValue, idx: Sequence[Node], mask: Node) -> Node:
    """Load `x[idx]` only where `mask` holds (0 elsewhere): the load is never issued out of bounds.
    Every load inside is guarded, the loads that make an address too: a gather's index
    (`src[idx[i - 2]]` in a concatenation's second part) read at i - 2 < 0 is out of bounds,
    and its garbage value would fail the index check or address anything."""
    value = x.load(list(idx))
    from ..ir.nodes import map_nodes
    return map_nodes(value, lambda n, args: Node_load_masked(type(n)(n.op, args, n.arg, n.dtype), mask)
                     if n.op == "load" else type(n)(n.op, args, n.arg, n.dtype) if args != n.args else n)


def Node_load_masked(ld: Node, mask: Node) -> Node:
    if len(ld.args) == 2:
        mask = op("and", ld.args[1], mask, dtype=torch.bool)
    return type(ld)("load", (ld.args[0], mask), ld.arg, ld.dtype)


# The default of backends.base.Features, which holds before the graph's device is known.
CAT_MAX_FUSED_PARTS = Features.max_fused_cat_parts


def _stored_in_order_of(lw, t: TensorValue, out: Any) -> TensorValue:
    """`t` stored for a concatenation: channels-last where computed from channels-last buffers,
    else its dims in the memory order of the concatenation's result, so that the cat kernel
    copies it in runs.  Stored as its own node says, a U-Net's
    bilinear upsample (NCHW by its decomposition's gathers) was written NCHW between two
    channels-last buffers: a transposed write, then a transposed read by the cat (0.73x
    Inductor on the CPU)."""
    from .values import channels_last_layout
    from .realize import channels_last_inputs
    if t.ndim == 4 and isinstance(t, ComputedValue) and channels_last_inputs(lw, t):
        return lw.stored(t, channels_last_layout(t.shape))    # as `_maybe_realize_one` stores it
    if not isinstance(out, torch.Tensor) or out.ndim != t.ndim:
        return lw.stored(t)
    order = sorted(range(t.ndim), key=lambda d: (-size_hint(out.stride()[d]), d))    # outermost first
    strides: list[Node] = [const(1)] * t.ndim
    for d, stride in zip(order, contiguous_strides([t.shape[d] for d in order])):
        strides[d] = stride
    return lw.stored(t, Layout(tuple(t.shape), tuple(strides)))


@register(aten.cat.default)
def _cat(lw, tensors, dim=0):
    out_shape = lw.out_shape()
    dim = _norm(dim, len(out_shape))
    parts = [t for t in tensors if not (t.ndim == 1 and t.shape[0] == const(0) and len(out_shape) != 1)]
    dtype = lw.out_dtype()
    in_place = cat_in_place(lw, tensors)     # some part was stored into its slice already
    if in_place is not None:
        return in_place
    limit = lw.backend.features.max_fused_cat_parts if lw.backend is not None else CAT_MAX_FUSED_PARTS
    if len(parts) > limit:
        # 64 parts (an RNN's stacked hidden states) ran 25x slower fused than ATen's cat, which
        # copies the parts (stored anyway, for the next step's matmul) in one pass
        raise Unsupported(f"cat of {len(parts)} tensors (more than {limit} for this backend): "
                          "ATen's cat copies them in one pass")
    if len(parts) > 1:
        # Every element evaluates every part's expression (vector code and tl.where compute both
        # sides): past a budget, the expensive parts are stored first. An RNN's last cell, fused
        # into the stack of its hidden states, ran its gates over the whole sequence (20x its cost).
        limit = lw.config.inline_max_cost
        costs = [cost(t.load([var(f"i{k}") for k in range(t.ndim)])) if isinstance(t, ComputedValue) else 1
                 for t in parts]
        if sum(costs) > 2 * limit:
            stored = {id(t): _stored_in_order_of(lw, t, lw.out_meta()) for t, c in zip(parts, costs) if c > limit}
            parts = [stored.get(id(t), t) for t in parts]
            # A part planned for its slice (cat_slots.py) was just stored there, into the
            # concatenation's buffer: the concatenation is now that buffer, its other parts
            # written into their slices.  A fused copy would leave the buffer, allocated whole,
            # alive to the end of the graph beside the copy (GPT-NeoX's partial rotary: q and k
            # of every layer, 16 MiB per layer, held until the logits were written).
            in_place = cat_in_place(lw, [stored.get(id(t), t) for t in tensors])
            if in_place is not None:
                return in_place

    def body(idx):
        i = idx[dim]
        offsets, acc = [], const(0)
        for t in parts:
            offsets.append(acc)
            acc = acc + t.shape[dim]
        value = None
        for t, start in reversed(list(zip(parts, offsets))):
            sub = list(idx)
            sub[dim] = i - start
            if value is None:
                value = cast(masked(t, sub, op("ge", i, start, dtype=torch.bool)) if len(parts) > 1
                             else t.load(sub), dtype)
                continue
            inside = op("lt", i, start + t.shape[dim], dtype=torch.bool)
            if start != const(0):
                inside = op("and", op("ge", i, start, dtype=torch.bool), inside, dtype=torch.bool)
            value = where(inside, cast(masked(t, sub, inside), dtype), value)
        return value
    return ComputedValue(out_shape, dtype, body)


@register(aten.constant_pad_nd.default)
def _pad(lw, x, pad, value=0):
    out_shape = lw.out_shape()
    dtype = x.dtype
    nd = x.ndim

    def body(idx):
        sub, conds = list(idx), []
        for k in range(len(pad) // 2):
            d = nd - 1 - k
            before = pad[2 * k]
            before = before if isinstance(before, Node) else const(before)
            sub[d] = idx[d] - before
            conds.append(op("ge", sub[d], const(0), dtype=torch.bool))
            conds.append(op("lt", sub[d], x.shape[d], dtype=torch.bool))
        mask = conds[0]
        for c in conds[1:]:
            mask = op("and", mask, c, dtype=torch.bool)
        return where(mask, masked(x, sub, mask), const(value, dtype))
    return ComputedValue(out_shape, dtype, body)


@register(aten.select_scatter.default)
def _select_scatter(lw, x, src, dim, index):
    dim = _norm(dim, x.ndim)
    index = index if isinstance(index, Node) else const(index % x.shape[dim].arg if index < 0 else index) \
        if x.shape[dim].op == "const" else const(index)

    def body(idx):
        hit = op("eq", idx[dim], index, dtype=torch.bool)
        return where(hit, masked(src, idx[:dim] + idx[dim + 1:], hit), cast(x.load(list(idx)), x.dtype))
    return ComputedValue(lw.out_shape(), x.dtype, body)


@register(aten.slice_scatter.default)
def _slice_scatter(lw, x, src, dim=0, start=None, end=None, step=1):
    dim = _norm(dim, x.ndim)
    size = x.shape[dim]
    start = 0 if start is None else start
    if isinstance(start, int) and start < 0:
        start = start + size if isinstance(size, Node) else start
    start_n = start if isinstance(start, Node) else const(start)
    length = src.shape[dim]

    def body(idx):
        rel = idx[dim] - start_n
        hit = op("and", op("ge", rel, const(0), dtype=torch.bool),
                 op("lt", rel, length * step, dtype=torch.bool), dtype=torch.bool)
        sub = list(idx)
        if step != 1:
            hit = op("and", hit, op("eq", op("mod", rel, const(step), dtype=INDEX), const(0), dtype=torch.bool),
                     dtype=torch.bool)
            sub[dim] = op("floordiv", rel, const(step), dtype=INDEX)
        else:
            sub[dim] = rel
        return where(hit, cast(masked(src, sub, hit), x.dtype), x.load(list(idx)))
    return ComputedValue(lw.out_shape(), x.dtype, body)


@register(aten.scatter.value)
def _scatter_value(lw, x, dim, index, value):
    """out = x with `value` written at index[..., j, ...] along `dim` (a one-hot, as in the backward
    of nll_loss): every output element compares its position with the few indices of its row."""
    dim = _norm(dim, max(x.ndim, 1))
    if x.ndim == 0 or index.ndim != x.ndim:
        raise Unsupported("scatter of a 0-d tensor")
    k = index.shape[dim]
    if k.op != "const" or k.arg > 8:
        raise Unsupported("scatter with many (or a symbolic number of) indices per row")
    dtype = x.dtype
    fill = cast(value, dtype) if isinstance(value, Node) else const(value, dtype)

    def body(idx):
        inside = None               # index may be smaller than x along the other dims
        for d in range(x.ndim):
            if d != dim and index.shape[d] != x.shape[d]:
                c = op("lt", idx[d], index.shape[d], dtype=torch.bool)
                inside = c if inside is None else op("and", inside, c, dtype=torch.bool)
        hit = None
        for j in range(k.arg):
            sub = list(idx)
            sub[dim] = const(j)
            target = cast(index.load(sub) if inside is None else masked(index, sub, inside), INDEX)
            h = op("eq", target, idx[dim], dtype=torch.bool)
            if inside is not None:
                h = op("and", inside, h, dtype=torch.bool)
            hit = h if hit is None else op("or", hit, h, dtype=torch.bool)
        base = x.load(list(idx))
        return base if hit is None else where(hit, fill, base)
    return ComputedValue(lw.out_shape(), dtype, body)


# --------------------------------------------------------------------------------------------
# indirect loads: gather, index_select, advanced indexing, embedding
# --------------------------------------------------------------------------------------------

def _wrap_index(i: Node, size: Node, what: str, negative: bool = True) -> Node:
    """Negative indices count from the end, as in eager's advanced indexing (`negative`; gather,
    index_select and embedding reject them); an index out of range is an error that the kernel
    reports (codegen/checks.py), never a load outside the tensor.  `what` names the op and dim
    in that error."""
    i = cast(i, INDEX)
    if size.op == "const" and size.arg == 0:
        raise Unsupported(f"{what}: indexing an empty dim")     # (ATen raises its error)
    if i.op == "const" and size.op == "const" and (-size.arg if negative else 0) <= i.arg < size.arg:
        return const(i.arg % size.arg)
    return Node("check_index", (i, size, const(int(negative))), what, INDEX)


def _checked_load(x: Any, sub: list[Node]) -> Node:
    """`x.load(sub)`, keeping the checks of indices into dims of one element: the load reads
    such a dim at 0 whatever the index, which would drop its check with it."""
    value = x.load(sub)
    for i, size in zip(sub, x.shape):
        if i.op == "check_index" and size.op == "const" and size.arg == 1:
            value = Node("checked", (value, i), None, value.dtype)
    return value


@register(aten.index_select.default)
def _index_select(lw, x, dim, index):
    if x.ndim == 0:       # a 0-d input gives a 0-d output (the index can only be 0 or -1)
        return ComputedValue(lw.out_shape(), x.dtype, lambda idx: x.load([]))
    dim = _norm(dim, x.ndim)
    return ComputedValue(lw.out_shape(), x.dtype, lambda idx: _checked_load(x,
        list(idx[:dim]) + [_wrap_index(index.load([idx[dim]] if index.ndim else []), x.shape[dim], f"index_select dim {dim}", False)] + list(idx[dim + 1:])))


@register(aten.gather.default)
def _gather(lw, x, dim, index, *, sparse_grad=False):
    dim = _norm(dim, max(x.ndim, 1))
    if x.ndim == 0:
        return ComputedValue(lw.out_shape(), x.dtype, lambda idx: x.load([]))
    return ComputedValue(lw.out_shape(), x.dtype, lambda idx: _checked_load(x,
        list(idx[:dim]) + [_wrap_index(index.load(list(idx)), x.shape[dim], f"gather dim {dim}", False)] + list(idx[dim + 1:])))


@register(aten.embedding.default)
def _embedding(lw, weight, indices, padding_idx=-1, scale_grad_by_freq=False, sparse=False):
    k = indices.ndim
    return ComputedValue(lw.out_shape(), weight.dtype, lambda idx: _checked_load(weight,
        [_wrap_index(indices.load(list(idx[:k])), weight.shape[0], "embedding", False)] + list(idx[k:])))


@register(aten._unsafe_index.Tensor)
def _unsafe_index(lw, x, indices):
    """Indices that decompositions computed in range (upsampling): no check, as in eager."""
    return _index(lw, x, indices, checked=False)


@register(aten.index.Tensor)
def _index(lw, x, indices, checked: bool = True):
    indices = list(indices) + [None] * (x.ndim - len(indices))
    tensor_dims = [d for d, t in enumerate(indices) if t is not None]
    if not tensor_dims:
        return x
    if any(t.dtype in (torch.bool, torch.uint8) for t in indices if t is not None):
        raise Unsupported("boolean mask indexing has a data-dependent shape")
    out_shape = lw.out_shape()
    bshape_len = max(t.ndim for t in indices if t is not None)
    adjacent = tensor_dims == list(range(tensor_dims[0], tensor_dims[-1] + 1))
    first = tensor_dims[0] if adjacent else 0
    bshape = out_shape[first:first + bshape_len]

    def body(idx):
        bidx = list(idx[first:first + bshape_len])
        rest = list(idx[:first]) + list(idx[first + bshape_len:])
        it = iter(rest)
        sub = []
        for d in range(x.ndim):
            t = indices[d]
            if t is None:
                sub.append(next(it))
            else:
                i = bcast_load(t, bshape, bidx, INDEX)
                sub.append(_wrap_index(i, x.shape[d], f"index dim {d}") if checked else
                           where(op("lt", i, const(0), dtype=torch.bool), op("add", i, x.shape[d], dtype=INDEX), i))
        return _checked_load(x, sub)
    return ComputedValue(out_shape, x.dtype, body)


__all__ = ["remap", "masked", "upcast", "load"]


@register(prims.broadcast_in_dim.default)
def _broadcast_in_dim(lw, x, shape, broadcast_dimensions):
    def fn(idx):
        return [const(0) if (x.shape[k].op == "const" and x.shape[k].arg == 1) else idx[d]
                for k, d in enumerate(broadcast_dimensions)]
    return ComputedValue(lw.out_shape(), x.dtype, lambda idx: x.load(fn(list(idx))))
