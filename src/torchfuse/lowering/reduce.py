"""Lowerings of reductions: sum, mean, prod, amax/amin, max/min(dim), argmax/argmin, any/all.

A reduction realizes a buffer over the kept dims; its body is the (fused) expression of the
input at (kept index, reduced index).  keepdim is a zero-stride view of that buffer.
Accumulation happens in fp32 for fp16/bf16 and in int64 for integer sums, as in eager.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Sequence

import torch

from ..ir.buffers import ComputedValue, Layout, StridedValue, TensorValue, Unsupported, contiguous_strides
from .pointwise import register, upcast
from ..ir.nodes import Node, cast, const, op

if TYPE_CHECKING:
    from .graph import GraphLowering

aten = torch.ops.aten
prims = torch.ops.prims


def _dims(x: TensorValue, dim: Any) -> list[int]:
    if dim is None or (isinstance(dim, (list, tuple)) and len(dim) == 0):
        return list(range(x.ndim))
    if isinstance(dim, int):
        dim = [dim]
    nd = max(x.ndim, 1)
    return sorted({d + nd if d < 0 else d for d in dim} & set(range(x.ndim)))


def reduction(lw: GraphLowering, x: TensorValue, dims: Sequence[int], red_op: str, acc_dtype: torch.dtype,
              out_dtype: torch.dtype, keepdim: bool, pre=None) -> TensorValue:
    """Reduce `x` over `dims`; `pre(value)` maps each loaded element before it is accumulated."""
    kept = [d for d in range(x.ndim) if d not in dims]
    out_ranges = tuple(x.shape[d] for d in kept)
    red_ranges = tuple(x.shape[d] for d in dims)

    def body(idx: list[Node], ridx: list[Node]) -> Node:
        full: list[Node] = [const(0)] * x.ndim
        for d, i in zip(kept, idx):
            full[d] = i
        for d, r in zip(dims, ridx):
            full[d] = r
        v = cast(x.load(full), acc_dtype) if red_op not in ("any", "all") else \
            op("ne", x.load(full), const(0, x.dtype), dtype=torch.bool)
        return pre(v) if pre is not None else v

    proto = ComputedValue(out_ranges, out_dtype, lambda idx: const(0))
    stored = lw.realize(proto, reduction=(red_op, red_ranges, body))
    if not keepdim:
        return stored
    strides = list(contiguous_strides(out_ranges))
    sizes, full_strides = [], []
    for d in range(x.ndim):
        if d in dims:
            sizes.append(const(1))
            full_strides.append(const(0))
        else:
            sizes.append(x.shape[d])
            full_strides.append(strides.pop(0))
    return StridedValue(stored.buffer, Layout(tuple(sizes), tuple(full_strides)), out_dtype)


def _acc(x: TensorValue, out_dtype: torch.dtype) -> torch.dtype:
    if out_dtype.is_floating_point:
        return upcast(out_dtype)
    if out_dtype == torch.bool:
        return torch.bool
    return torch.int64


@register(aten.sum.dim_IntList, aten.sum.default)
def _sum(lw, x, dim=None, keepdim=False, *, dtype=None):
    if x.dtype.is_complex:
        raise Unsupported("complex dtypes")
    out = lw.out_dtype()
    acc = _acc(x, out)
    if acc == torch.bool:
        acc = torch.int64
    return reduction(lw, x, _dims(x, dim), "sum", acc, out, keepdim)


@register(aten.prod.default, aten.prod.dim_int)
def _prod(lw, x, dim=None, keepdim=False, *, dtype=None):
    out = lw.out_dtype()
    acc = _acc(x, out)
    if acc == torch.bool:
        acc = torch.int64
    return reduction(lw, x, _dims(x, dim), "prod", acc, out, keepdim)


@register(aten.mean.dim, aten.mean.default)
def _mean(lw, x, dim=None, keepdim=False, *, dtype=None):
    out = lw.out_dtype()
    acc = upcast(out)
    dims = _dims(x, dim)
    count = const(1)
    for d in dims:
        count = count * x.shape[d]
    total = reduction(lw, x, dims, "sum", acc, acc, keepdim)
    return ComputedValue(total.shape, out, lambda idx: cast(
        op("truediv", total.load(list(idx)), cast(count, acc), dtype=acc), out))


@register(aten.amax.default, aten.amin.default, aten.max.default, aten.min.default)
def _amax(lw, x, dim=None, keepdim=False):
    name = lw.current.target._opname
    red = "max" if name in ("amax", "max") else "min"
    if x.ndim > 0 and any(s.op == "const" and s.arg == 0 for s in x.shape) and name in ("max", "min"):
        raise Unsupported("max/min of an empty tensor raises in eager")
    out = lw.out_dtype()
    return reduction(lw, x, _dims(x, dim), red, upcast(out), out, keepdim)


@register(aten.max.dim, aten.min.dim)
def _max_dim(lw, x, dim, keepdim=False):
    red = "max" if lw.current.target._opname == "max" else "min"
    dims = _dims(x, dim)
    values = reduction(lw, x, dims, red, upcast(x.dtype), x.dtype, keepdim)
    indices = reduction(lw, x, dims, "arg" + red, upcast(x.dtype), torch.int64, keepdim)
    return (values, indices)


@register(aten.argmax.default, aten.argmin.default)
def _argmax(lw, x, dim=None, keepdim=False):
    red = lw.current.target._opname
    if dim is None:
        if x.ndim == 0:
            return ComputedValue((), torch.int64, lambda idx: const(0))
        out = reduction(lw, x, list(range(x.ndim)), red, upcast(x.dtype), torch.int64, False)
        if keepdim:
            return ComputedValue(lw.out_shape(), torch.int64, lambda idx: out.load([]))
        return out
    return reduction(lw, x, _dims(x, dim), red, upcast(x.dtype), torch.int64, keepdim)


@register(aten.any.default, aten.any.dim, aten.any.dims, aten.all.default, aten.all.dim, aten.all.dims)
def _any(lw, x, dim=None, keepdim=False):
    red = lw.current.target._opname
    return reduction(lw, x, _dims(x, dim), red, torch.bool, lw.out_dtype(), keepdim)


@register(prims.sum.default)
def _prims_sum(lw, x, dims, *, output_dtype=None):
    out = lw.out_dtype()
    return reduction(lw, x, _dims(x, list(dims)), "sum", _acc(x, out) if out != torch.bool else torch.int64, out, False)


@register(prims.var.default)
def _prims_var(lw, x, dims, correction=1, *, output_dtype=None):
    """Two-pass variance: mean first, then the mean of squared deviations (more accurate than
    E[x^2]-E[x]^2); both reductions run over the same rows in one kernel."""
    dims = _dims(x, list(dims) if dims is not None else None)
    out = lw.out_dtype()
    acc = upcast(x.dtype)
    count = const(1)
    for d in dims:
        count = count * x.shape[d]
    total = reduction(lw, x, dims, "sum", acc, acc, True)

    def centered(idx_full: list[Node]) -> Node:
        mean = op("truediv", total.load(idx_full), cast(count, acc), dtype=acc)
        return op("sub", cast(x.load(idx_full), acc), mean, dtype=acc)

    sq = ComputedValue(x.shape, acc, lambda idx: (lambda c: op("mul", c, c, dtype=acc))(centered(list(idx))))
    sq_sum = reduction(lw, sq, dims, "sum", acc, acc, False)
    corr = correction if not isinstance(correction, Node) else cast(correction, acc)
    denom = op("sub", cast(count, acc), const(corr, acc) if not isinstance(corr, Node) else corr, dtype=acc)
    return ComputedValue(sq_sum.shape, out, lambda idx: cast(
        op("truediv", sq_sum.load(list(idx)), op("maximum", denom, const(0, acc), dtype=acc), dtype=acc), out))
