"""Lowerings of scatters: ops that store or accumulate into an output at computed indices.

    scatter_add, scatter (src / value / reduce), scatter_reduce.two, index_put (and
    _unsafe_index_put), index_add, index_copy, embedding_dense_backward

Each becomes two steps.  The output is first initialised by an ordinary pointwise buffer (a
copy of `self`, or zeros), which fuses with its neighbours like any other; then a scatter
(`ComputedBuffer.scatter`) runs over the *source* domain (the index tensor's, or the values')
and does `out[index(i)] (op)= value(i)`, where `value` is a fused expression of its inputs (a
GNN's message `x[src] * w` is computed in the scatter's own loop, never stored; a value that
several scatters read, a GAT's edge score, is stored once where recomputing it costs more:
realize.py `scatter_recomputes`).  The backends
accumulate with atomics (Triton) or `omp atomic` / compare-and-swap (C++).

A negative index counts from the end, as in eager; an index still out of range after that is
reported by its run-time check (`check_index`, codegen/checks.py: the call raises eager's
IndexError) and writes nothing (`in_bounds`: the check hands on index 0, which would otherwise
take the write, and an input written in place must keep its rows).  Sums in floating point depend on the order of the adds, so with
`torch.use_deterministic_algorithms(True)` (Dynamo guards on that flag, so the choice made at
compile time holds for every call of the compiled graph) accumulating float scatters run in ATen,
unless the backend's scatters can add in a fixed order (Features.deterministic_scatters: the
buffer is marked `deterministic`).  A 16-bit sum accumulates in an fp32 buffer where the backend
says so (Features.scatter_wide_sums), rounded once by its readers, except for the ops whose eager
kernel rounds every add to 16 bits itself (`rounds`: CUDA's scatter_add, index_add and
scatter_reduce sum add with atomics in the value's dtype), which add in 16 bits straight into
their output where the backend's atomics can (Features.half_atomic_add).  CUDA's embedding
backward and accumulating index_put sum in fp32 (sort-based): those stay wide.

In place: when the scatter's `self` is a graph input that the graph then overwrites with the
result (AOTAutograd's `copy_` epilogue of a mutated input: a static KV cache's
`cache[:, :, pos] = k`, `cache.index_copy_(2, pos, k)`) and nothing else reads the input, the
scatter writes the input's rows directly: no initial copy and no copy back (the wrapper drops
the `copy_`, codegen/wrapper.py `_mutations_in_place`).  slice_scatter and select_scatter of such
an input become scatters too, writing only the slice.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Sequence

import torch
import torch.fx as fx

from ..ir.buffers import ComputedBuffer, ComputedValue, StridedValue, TensorValue, Unsupported, guarded_offset
from ..ir.nodes import INDEX, Node, cast, const, op, var, where
from .pointwise import bcast_load, register
from .values import meta_val
from .views import _norm, _scatter_value, _select_scatter, _slice_scatter, _wrap_index

if TYPE_CHECKING:
    from .graph import GraphLowering

aten = torch.ops.aten

def in_bounds(i: Node, size: Node) -> Node:
    """0 <= i < size for an index already wrapped from the end: the condition under which a
    scatter may write.  The index check replaces a bad index by 0 and reports it (a gather may
    read row 0); a store must not write there, so this condition stays beside the check, and
    tests the index as loaded (wrapped), not the check's result (always in range: a bad index
    wrote its value into row 0 of a tensor written in place)."""
    if i.op == "check_index":
        raw, _, negative = i.args
        i = where(op("lt", raw, const(0), dtype=torch.bool), op("add", raw, size, dtype=INDEX), raw) \
            if negative.arg else raw
    return op("and", op("ge", i, const(0), dtype=torch.bool), op("lt", i, size, dtype=torch.bool), dtype=torch.bool)


def _check_mode(lw: GraphLowering, mode: str, dtype: torch.dtype, rounds: bool = False) -> bool:
    """Raises Unsupported where the backend cannot run the scatter; returns whether its adds
    must come in a fixed order (a float sum or product under deterministic algorithms)."""
    if mode == "store":
        return False
    features = lw.backend.features if lw.backend is not None else None
    modes = features.scatter_dtypes if features is not None else {}
    if dtype not in modes.get(mode, ()) and not half_sum(lw, mode, dtype, rounds):
        raise Unsupported(f"no atomic {mode} of {dtype} in this backend")
    if mode in ("sum", "prod") and dtype.is_floating_point and torch.are_deterministic_algorithms_enabled():
        if not (features is not None and features.deterministic_scatters):
            raise Unsupported("deterministic algorithms: a float sum in a scatter depends on the order of its adds")
        return True
    return False


_HALF = (torch.float16, torch.bfloat16)


def half_sum(lw: GraphLowering, mode: str, dtype: torch.dtype, rounds: bool) -> bool:
    """A 16-bit sum added atomically in its own dtype: the op's eager kernel rounds every add
    too (`rounds`) and the backend's atomics take the dtype (Features.half_atomic_add).  The
    error is then of eager's own kind, and the sum needs no fp32 buffer, no conversion pass
    and half the atomic traffic (bf16 GNN inference on an H200: Inductor's adds are 16-bit)."""
    return rounds and mode == "sum" and dtype in _HALF and lw.backend is not None and \
        dtype in lw.backend.features.half_atomic_add


def wide_sum(lw: GraphLowering, mode: str, dtype: torch.dtype, rounds: bool = False) -> bool:
    """A 16-bit sum the backend accumulates in fp32 (Features.scatter_wide_sums): rounding every
    add to bf16 gave a GCN layer's index_add 2.7x eager's error against fp64; one rounding at
    the end is below eager's.  Not where `half_sum` adds in 16 bits."""
    return mode == "sum" and dtype in _HALF and lw.backend is not None and \
        lw.backend.features.scatter_wide_sums and not half_sum(lw, mode, dtype, rounds)


def _wide_extremum(lw: GraphLowering, mode: str, dtype: torch.dtype) -> bool:
    """A 16-bit amax/amin the backend has no atomic for, but an fp32 one: exact in an fp32
    buffer (every 16-bit value is an fp32 value, and so is their max), rounded back without
    loss.  Triton has no 16-bit atomic max: a GAT's softmax max over each node's edges went to
    ATen, behind a materialized int64 copy of its expanded index."""
    if mode not in ("amax", "amin") or dtype not in _HALF or lw.backend is None:
        return False
    dtypes = lw.backend.features.scatter_dtypes.get(mode, ())
    return dtype not in dtypes and torch.float32 in dtypes


def _input_in_place(lw: GraphLowering, base: TensorValue) -> str | None:
    """The graph input buffer the current scatter may write in place, or None: its `self` is a
    graph input read by nothing but this op and the `copy_` that stores this op's result back
    into it (so no reader can see the input change early), stored as the input's own layout."""
    node = lw.current
    ph = node.args[0] if node.args else None
    if not (isinstance(ph, fx.Node) and ph.op == "placeholder" and isinstance(base, StridedValue)):
        return None
    copies = [u for u in ph.users if u is not node and not _only_copied_over(u)]
    if len(copies) != 1 or copies[0].target is not aten.copy_.default or tuple(copies[0].args) != (ph, node):
        return None
    meta = lw.buffer_meta.get(base.buffer)
    if not base.buffer.startswith("in") or meta is None or base.layout.offset != const(0) or \
            tuple(meta[0]) != base.layout.sizes or tuple(meta[1]) != base.layout.strides:
        return None
    out = meta_val(node)
    if not isinstance(out, torch.Tensor) or out.dtype != base.dtype:
        return None
    return base.buffer


def _only_copied_over(view: fx.Node) -> bool:
    """A view of the input that is only the destination of functional copies (`cache[:, :, p] =
    v` traces as copy(select(cache), v) then select_scatter): a copy's value is its source's, so
    the view's elements are never read."""
    return bool(view.users) and all(u.target is aten.copy.default and u.args[0] is view and view not in u.args[1:]
                                    for u in view.users)


def scatter_into(lw: GraphLowering, base: TensorValue | None, fill: float | None, domain: Sequence[Node],
                 target: Callable[[list[Node]], tuple[list[Node], list[tuple[Node, Node]]]],
                 value: Callable[[list[Node]], Node], mode: str, *, dtype: torch.dtype | None = None,
                 in_place: bool = True, skip: Callable[[list[Node]], Node] | None = None,
                 wide: bool = False, rounds: bool = False, owned: bool = False) -> TensorValue:
    """Initialise the output (a copy of `base`, or `fill` everywhere), then for every point `i`
    of `domain` update it at `target(i)` with `value(i)` (`mode`: "store", "sum", "prod", "amax",
    "amin").  `target` returns the output index and the (index, size) pairs that must be checked
    to be in range; `skip(i)`, if given, is true where nothing is written (a padding index).
    A 16-bit sum the backend widens (`wide_sum`) accumulates in an fp32 buffer, returned as is
    with `wide`, else as its value rounded to `dtype` (fused into the readers); `rounds`: the
    op's eager kernel rounds every add to `dtype` (`half_sum`); `owned`: `base` is a buffer this
    op made and nothing else reads (include_self=False's marked copy), updated where it is."""
    dtype = dtype or lw.out_dtype()
    if wide_sum(lw, mode, dtype, rounds) or _wide_extremum(lw, mode, dtype):
        acc = scatter_into(lw, base, fill, domain, target, lambda idx: cast(value(idx), torch.float32), mode,
                           dtype=torch.float32, in_place=False, skip=skip)
        if wide:
            return acc
        out = ComputedValue(lw.out_shape(), dtype, lambda idx: cast(acc.load(list(idx)), dtype))
        out.meta, out.origins = lw.out_meta(), [lw.current.name]
        return out
    deterministic = _check_mode(lw, mode, dtype, rounds)
    out_shape = lw.out_shape()
    into = _input_in_place(lw, base) if in_place and base is not None else None
    if owned and isinstance(base, StridedValue) and base.dtype == dtype:
        into, layout = base.buffer, base.layout
    elif into is not None:
        layout = base.layout
    else:
        if base is not None:
            init = ComputedValue(out_shape, dtype, lambda idx: cast(base.load(list(idx)), dtype))
        else:
            init = ComputedValue(out_shape, dtype, lambda idx: const(fill, dtype))
        init.meta = lw.out_meta()
        init.origins = [lw.current.name]
        stored = lw.realize(init)
        into, layout = stored.buffer, stored.layout
    idx = [var(f"i{k}") for k in range(len(domain))]
    sub, checks = target(idx)
    ok = None
    for i, size in checks:
        c = in_bounds(i, size)
        ok = c if ok is None else op("and", ok, c, dtype=torch.bool)
    if skip is not None:
        c = op("not", skip(idx), dtype=torch.bool)
        ok = c if ok is None else op("and", ok, c, dtype=torch.bool)
    offset = layout.index(sub)
    store = guarded_offset(ok, offset)
    body = cast(value(idx), dtype)
    name = lw.new_name()
    origins: list[str] = []      # the fused producers of its value (a message x[src] * w), then the op
    for a in lw.current.all_input_nodes:
        v = lw.env.get(a)
        if base is not None and a is lw.current.args[0]:
            continue             # (the initial value's producers are the init kernel's)
        if isinstance(v, ComputedValue):
            origins += [o for o in v.origins if o not in origins]
    origins.append(lw.current.name)
    buf = ComputedBuffer(name, dtype, layout, tuple(domain), body, origins=origins,
                         scatter=mode, into=into, scatter_index=store, deterministic=deterministic)
    lw.steps.append(buf)
    lw.buffer_meta[name] = lw.buffer_meta[into]
    return StridedValue(name, layout, dtype)


def _along(dim: int, size: Node, index: TensorValue, by_dim: bool):
    """target() of a scatter along `dim`: index[i] (by_dim False: scatter/gather-shaped index)
    or index[i[dim]] (index_add/index_copy: a 1-d index) replaces coordinate `dim`."""
    def target(idx: list[Node]):
        if index.ndim == 0:
            raw = index.load([])
        else:
            raw = index.load([idx[dim]] if by_dim else list(idx))
        i = _wrap_index(raw, size, f"scatter dim {dim}")
        return list(idx[:dim]) + [i] + list(idx[dim + 1:]), [(i, size)]
    return target


def _scatter_like(lw, x, dim, index, src_load, mode, include_self=True, wide=False, rounds=False):
    if x.ndim == 0 or index.ndim != x.ndim:
        raise Unsupported("scatter of a 0-d tensor or with an index of other rank")
    dim = _norm(dim, x.ndim)
    target = _along(dim, x.shape[dim], index, by_dim=False)
    if not include_self:
        # positions the scatter reaches start from the op's identity, the others keep `self`
        ident = {"sum": 0, "prod": 1, "amax": float("-inf"), "amin": float("inf")}[mode]
        dtype = lw.out_dtype()
        if not dtype.is_floating_point and mode in ("amax", "amin"):
            info = torch.iinfo(dtype)
            ident = info.min if mode == "amax" else info.max
        x = scatter_into(lw, x, None, index.shape, target, lambda idx: const(ident, dtype), "store", in_place=False)
        # (the marked copy is this op's own: the reduction updates it, no second copy)
        return scatter_into(lw, x, None, index.shape, target, src_load, mode, wide=wide, rounds=rounds, owned=True)
    return scatter_into(lw, x, None, index.shape, target, src_load, mode, wide=wide, rounds=rounds)


@register(aten.scatter_add.default)
def _scatter_add(lw, x, dim, index, src):
    # (CUDA's scatter_add, scatter.reduce and scatter_reduce sum: atomics in the value's dtype,
    # ScatterGatherKernel.cu's ReduceAdd)
    return _scatter_like(lw, x, dim, index, lambda idx: src.load(list(idx)), "sum", rounds=True)


@register(aten.scatter.src)
def _scatter_src(lw, x, dim, index, src):
    return _scatter_like(lw, x, dim, index, lambda idx: src.load(list(idx)), "store")


@register(aten.scatter.value)
def _scatter_val(lw, x, dim, index, value):
    try:
        return _scatter_value(lw, x, dim, index, value)      # a few indices per row: one pass
    except Unsupported:
        pass
    dtype = x.dtype
    fill = cast(value, dtype) if isinstance(value, Node) else const(value, dtype)
    return _scatter_like(lw, x, dim, index, lambda idx: fill, "store")


_REDUCE_ARG = {"add": "sum", "multiply": "prod", "sum": "sum", "prod": "prod", "amax": "amax", "amin": "amin"}


@register(aten.scatter.reduce)
def _scatter_reduce_src(lw, x, dim, index, src, *, reduce):
    return _scatter_like(lw, x, dim, index, lambda idx: src.load(list(idx)), _REDUCE_ARG[reduce], rounds=True)


@register(aten.scatter.value_reduce)
def _scatter_reduce_value(lw, x, dim, index, value, *, reduce):
    fill = cast(value, x.dtype) if isinstance(value, Node) else const(value, x.dtype)
    return _scatter_like(lw, x, dim, index, lambda idx: fill, _REDUCE_ARG[reduce], rounds=True)


@register(aten.scatter_reduce.two)
def _scatter_reduce(lw, x, dim, index, src, reduce, *, include_self=True):
    if reduce == "mean":
        return _scatter_mean(lw, x, dim, index, src, include_self)
    if reduce not in _REDUCE_ARG:
        raise Unsupported(f"scatter_reduce {reduce}")
    return _scatter_like(lw, x, dim, index, lambda idx: src.load(list(idx)), _REDUCE_ARG[reduce], include_self,
                         rounds=True)


def _scatter_mean(lw, x, dim, index, src, include_self):
    """sum / count, where count counts the values scattered to each position (plus one for
    `self` when included); positions nothing reaches keep `self`.  Integer means floor, as eager."""
    dtype = out_dtype = lw.out_dtype()
    total = _scatter_like(lw, x, dim, index, lambda idx: src.load(list(idx)), "sum", include_self, wide=True)
    if wide_sum(lw, "sum", dtype):
        dtype = torch.float32        # sum, count and quotient in fp32, rounded once
    ones = const(1, dtype)
    _check_mode(lw, "sum", dtype)
    count = scatter_into(lw, None, 1 if include_self else 0, index.shape,
                         _along(_norm(dim, x.ndim), x.shape[_norm(dim, x.ndim)], index, by_dim=False),
                         lambda idx: ones, "sum", in_place=False, dtype=dtype)

    def body(idx):
        s, n = total.load(list(idx)), count.load(list(idx))
        n = where(op("eq", n, const(0, dtype), dtype=torch.bool), const(1, dtype), n)
        return cast(op("truediv" if dtype.is_floating_point else "pyfloordiv", s, n, dtype=dtype), out_dtype)
    return ComputedValue(lw.out_shape(), out_dtype, body)


def _index_put_target(x: TensorValue, indices: list):
    """The domain of x[indices] (as the gather x[indices] would have it) and target() into x."""
    indices = list(indices) + [None] * (x.ndim - len(indices))
    tensor_dims = [d for d, t in enumerate(indices) if t is not None]
    if not tensor_dims:
        raise Unsupported("index_put without index tensors")
    if any(indices[d].dtype in (torch.bool, torch.uint8) for d in tensor_dims):
        raise Unsupported("boolean mask indices have a data-dependent count")
    bshape_len = max(indices[d].ndim for d in tensor_dims)
    bshape: list[Node] = [const(1)] * bshape_len
    for d in tensor_dims:
        t = indices[d]
        for k, s in enumerate(t.shape):
            pos = bshape_len - t.ndim + k
            if not (s.op == "const" and s.arg == 1):
                bshape[pos] = s
    adjacent = tensor_dims == list(range(tensor_dims[0], tensor_dims[-1] + 1))
    first = tensor_dims[0] if adjacent else 0
    rest_dims = [d for d in range(x.ndim) if indices[d] is None]
    rest_sizes = [x.shape[d] for d in rest_dims]
    domain = rest_sizes[:first] + bshape + rest_sizes[first:] if adjacent else bshape + rest_sizes

    def target(idx: list[Node]):
        bidx = list(idx[first:first + bshape_len])
        rest = list(idx[:first]) + list(idx[first + bshape_len:])
        it = iter(rest)
        sub, checks = [], []
        for d in range(x.ndim):
            t = indices[d]
            if t is None:
                sub.append(next(it))
            else:
                i = _wrap_index(bcast_load(t, tuple(bshape), bidx, INDEX), x.shape[d], f"index_put dim {d}")
                sub.append(i)
                checks.append((i, x.shape[d]))
        return sub, checks
    return tuple(domain), target


@register(aten.index_put.default, aten._unsafe_index_put.default)
def _index_put(lw, x, indices, values, accumulate=False):
    domain, target = _index_put_target(x, indices)
    return scatter_into(lw, x, None, domain, target, lambda idx: bcast_load(values, domain, list(idx), x.dtype),
                        "sum" if accumulate else "store")


def _index_dim(lw, x, dim, index, source, mode, scale=None, rounds=False):
    if x.ndim == 0 or index.ndim > 1:
        raise Unsupported("index_add/index_copy of a 0-d tensor")
    dim = _norm(dim, x.ndim)
    if source.ndim != x.ndim:
        raise Unsupported("index_add/index_copy with a source of other rank")
    target = _along(dim, x.shape[dim], index, by_dim=True)

    def value(idx):
        v = source.load(list(idx))
        return v if scale is None else op("mul", cast(v, x.dtype), scale, dtype=x.dtype)
    return scatter_into(lw, x, None, source.shape, target, value, mode, rounds=rounds)


@register(aten.index_add.default)
def _index_add(lw, x, dim, index, source, *, alpha=1):
    scale = None if (not isinstance(alpha, Node) and alpha == 1) else \
        (cast(alpha, lw.out_dtype()) if isinstance(alpha, Node) else const(alpha, lw.out_dtype()))
    # (CUDA's index_add: gpuAtomicAdd in the value's dtype)
    return _index_dim(lw, x, dim, index, source, "sum", scale, rounds=True)


@register(aten.index_copy.default)
def _index_copy(lw, x, dim, index, source):
    return _index_dim(lw, x, dim, index, source, "store")


@register(aten.embedding_dense_backward.default)
def _embedding_dense_backward(lw, grad, indices, num_weights, padding_idx, scale_grad_by_freq):
    if scale_grad_by_freq:
        raise Unsupported("embedding backward scaled by frequency")
    k = indices.ndim
    rows = lw.out_shape()[0]

    def target(idx):
        i = _wrap_index(indices.load(list(idx[:k])), rows, "embedding_dense_backward")
        return [i] + list(idx[k:]), [(i, rows)]

    pad = padding_idx if isinstance(padding_idx, Node) else const(padding_idx)
    skip = None if (not isinstance(padding_idx, Node) and padding_idx < 0) else \
        (lambda idx: op("eq", cast(indices.load(list(idx[:k])), INDEX), pad, dtype=torch.bool))
    return scatter_into(lw, None, 0, grad.shape, target, lambda idx: grad.load(list(idx)), "sum", skip=skip)


@register(aten.slice_scatter.default)
def _slice_scatter_in_place(lw, x, src, dim=0, start=None, end=None, step=1):
    """Into a graph input updated in place (a KV cache's slice): only the slice is written."""
    if _input_in_place(lw, x) is None or isinstance(step, Node):
        return _slice_scatter(lw, x, src, dim, start, end, step)
    dim = _norm(dim, x.ndim)
    start = 0 if start is None else start
    if isinstance(start, int) and start < 0:
        if x.shape[dim].op != "const":
            return _slice_scatter(lw, x, src, dim, start, end, step)
        start += x.shape[dim].arg
    start_n = start if isinstance(start, Node) else const(start)

    def target(idx):
        sub = list(idx)
        sub[dim] = start_n + idx[dim] * step
        return sub, []
    return scatter_into(lw, x, None, src.shape, target, lambda idx: src.load(list(idx)), "store")


@register(aten.select_scatter.default)
def _select_scatter_in_place(lw, x, src, dim, index):
    if _input_in_place(lw, x) is None:
        return _select_scatter(lw, x, src, dim, index)
    dim = _norm(dim, x.ndim)
    size = x.shape[dim]
    i = _wrap_index(index if isinstance(index, Node) else const(index), size, "select_scatter")

    def target(idx):
        return list(idx[:dim]) + [i] + list(idx[dim:]), [(i, size)]
    return scatter_into(lw, x, None, src.shape, target, lambda idx: src.load(list(idx)), "store")


