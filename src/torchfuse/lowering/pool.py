"""Lowerings of 2-d pooling windows: max pooling (with its indices or window offsets), its
backward, and average pooling, for the Triton backend (GPU; CPU tensors under `cpu_backend="triton"`).

Each output element loads its window (at most `MAX_WINDOW` elements) as a stencil of the
input, so a pooling fuses with the pointwise op that feeds it (batch norm + ReLU + max-pool
in one kernel) and writes in the input's memory format. ATen's channels-last pooling kernels
are slow (an inception forward spent 3 ms of 10 in `avg_pool2d_out_cuda_frame_nhwc`), and a
fallback also cuts the fusion around it. Larger windows run through ATen.  In training the
forward saves int8 window offsets and the backward gathers the output gradients per input
element (no atomics), reading the offsets converted back to indices in the same kernel.

Semantics follow ATen's kernels exactly: padded positions never win a max (and are skipped
by its index), the first strict maximum wins and a NaN always wins; an average divides by
the window clipped to the padded input (or to the input with `count_include_pad=False`),
or by `divisor_override`.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Sequence

import torch

from ..ir.buffers import ComputedValue, TensorValue, Unsupported
from .pointwise import register, upcast
from .views import masked
from .values import shape_of
from ..ir.nodes import INDEX, Node, as_node, cast, const, floordiv, mod, op, where

if TYPE_CHECKING:
    from .graph import GraphLowering

aten = torch.ops.aten

try:
    # Inductor's low-memory max-pool ops: the forward saves each output's position in its
    # window (int8) instead of its int64 index in the input, and the backward converts it back
    # (frontend/decompositions.py; AOTAutograd's min-cut partitioner knows the conversion as
    # cheap to recompute, so the backward reads 1 byte per pooled element instead of 8)
    import torch._inductor.inductor_prims  # noqa: F401  (registers the two prims)
    POOL_WITH_OFFSETS = torch.ops.prims._low_memory_max_pool_with_offsets.default
    OFFSETS_TO_INDICES = torch.ops.prims._low_memory_max_pool_offsets_to_indices.default
except (ImportError, AttributeError):    # a torch without them: ATen's indices are saved
    POOL_WITH_OFFSETS = OFFSETS_TO_INDICES = None

MAX_WINDOW = 64      # window elements unrolled into one kernel; larger windows run through ATen


def pair(v: Any, default: Sequence[int] | None = None) -> tuple[int, int]:
    """A pooling argument (an int, or one or two ints) as two ints; `default` for an empty one
    (a stride left out is the kernel size)."""
    if v is None or (isinstance(v, (list, tuple)) and len(v) == 0):
        if default is None:
            raise Unsupported("pooling without a kernel size")
        return pair(default)
    if isinstance(v, int):
        return (v, v)
    if len(v) == 1:
        return (int(v[0]), int(v[0]))
    return (int(v[0]), int(v[1]))


def _window(lw: GraphLowering, x: TensorValue, kernel: Any, stride: Any, padding: Any, dilation: Any) -> tuple:
    if lw.backend is not None and not lw.backend.features.pooling:
        raise Unsupported(f"pooling on the {lw.backend.title} backend (ATen's vectorized pooling is faster)")
    if not isinstance(x, TensorValue) or x.ndim not in (3, 4):
        raise Unsupported("pooling of a tensor that is not 3-d or 4-d")
    if not x.dtype.is_floating_point:
        raise Unsupported(f"pooling of {x.dtype}")
    k, s = pair(kernel), pair(stride, kernel)
    p, d = pair(padding), pair(dilation)
    if any(not isinstance(v, int) for v in (*k, *s, *p, *d)):
        raise Unsupported("pooling with symbolic window parameters")
    if k[0] * k[1] > MAX_WINDOW:
        raise Unsupported(f"pooling window of {k[0] * k[1]} elements (more than {MAX_WINDOW})")
    return k, s, p, d


def _inside(h: Node, w: Node, h_size: Node, w_size: Node) -> Node:
    """0 <= h < h_size and 0 <= w < w_size."""
    mask = None
    for c in (op("ge", h, const(0), dtype=torch.bool), op("lt", h, h_size, dtype=torch.bool),
              op("ge", w, const(0), dtype=torch.bool), op("lt", w, w_size, dtype=torch.bool)):
        mask = c if mask is None else op("and", mask, c, dtype=torch.bool)
    return mask


def _positions(x: TensorValue, idx: Sequence[Node], k, s, p, d):
    """Every window position of output `idx`: (input index, in-bounds mask or None,
    flat offset ih * W + iw), in ATen's scan order (rows, then columns)."""
    h_size, w_size = x.shape[-2], x.shape[-1]
    lead = list(idx[:-2])
    h0 = idx[-2] * s[0] - p[0]
    w0 = idx[-1] * s[1] - p[1]
    out = []
    for kh in range(k[0]):
        ih = h0 + kh * d[0]
        for kw in range(k[1]):
            iw = w0 + kw * d[1]
            out.append((lead + [ih, iw], _inside(ih, iw, h_size, w_size), ih * w_size + iw))
    return out


def _needs_mask(x: TensorValue, out_shape: Sequence[Node], k, s, p, d) -> bool:
    """False when every window lies inside the input (no padding, no ceil_mode overhang)."""
    if p != (0, 0):
        return True
    for dim, kk, ss, dd in ((-2, k[0], s[0], d[0]), (-1, k[1], s[1], d[1])):
        n_in, n_out = x.shape[dim], out_shape[dim]
        if n_in.op != "const" or n_out.op != "const":
            return True
        if (n_out.arg - 1) * ss + (kk - 1) * dd >= n_in.arg:
            return True
    return False


def _max_window(lw: GraphLowering, x, kernel_size, stride, padding, dilation, offsets: bool):
    """Max pooling's values and, per output, where its maximum was: the flat index into the
    input plane (ATen's int64 indices) or, with `offsets`, the position in the window (int8)."""
    k, s, p, d = _window(lw, x, kernel_size, stride, padding, dilation)
    metas = lw.out_meta()
    out_shape = shape_of(metas[0])
    guard = _needs_mask(x, out_shape, k, s, p, d)
    acc = upcast(x.dtype)
    lowest = const(float("-inf"), acc)

    def scan(idx):
        best, arg = None, None
        for j, (sub, mask, flat) in enumerate(_positions(x, idx, k, s, p, d)):
            where_ = const(j) if offsets else flat
            val = cast(masked(x, sub, mask) if guard else x.load(sub), acc)
            if best is None and not guard:
                best, arg = val, where_
                continue
            if best is None:
                best, arg = lowest, where_
            take = op("or", op("gt", val, best, dtype=torch.bool), op("isnan", val, dtype=torch.bool),
                      dtype=torch.bool)
            if guard:
                take = op("and", mask, take, dtype=torch.bool)
            best, arg = where(take, val, best), where(take, where_, arg)
        return best, arg

    values = ComputedValue(out_shape, x.dtype, lambda idx: cast(scan(idx)[0], x.dtype))
    arg_dtype = metas[1].dtype
    positions = ComputedValue(out_shape, arg_dtype, lambda idx: cast(scan(idx)[1], arg_dtype))
    values.meta, positions.meta = metas[0], metas[1]
    values.window = positions.window = True
    return values, positions


@register(aten.max_pool2d_with_indices.default)
def _max_pool2d_with_indices(lw: GraphLowering, x, kernel_size, stride=(), padding=0, dilation=1, ceil_mode=False):
    return _max_window(lw, x, kernel_size, stride, padding, dilation, offsets=False)


def _max_pool_with_offsets(lw: GraphLowering, x, kernel_size, stride, padding, dilation, ceil_mode=False):
    return _max_window(lw, x, kernel_size, stride, padding, dilation, offsets=True)


def _offsets_to_indices(lw: GraphLowering, offsets, kernel_size, input_size, stride, padding, dilation):
    """Window positions back to ATen's flat indices into the input plane: pointwise, so it fuses
    into the backward kernel that reads them."""
    if not isinstance(offsets, TensorValue) or len(kernel_size) != 2:
        raise Unsupported("max-pool offsets that are not 2-d")
    k, s, p, d = pair(kernel_size), pair(stride), pair(padding), pair(dilation)
    if any(not isinstance(v, int) for v in (*k, *s, *p, *d)):
        raise Unsupported("pooling with symbolic window parameters")
    width = as_node(input_size[-1])

    def body(idx):
        off = cast(offsets.load(idx), INDEX)
        ih = idx[-2] * s[0] - p[0] + floordiv(off, k[1]) * d[0]
        iw = idx[-1] * s[1] - p[1] + mod(off, k[1]) * d[1]
        return ih * width + iw

    return ComputedValue(offsets.shape, INDEX, body)


if POOL_WITH_OFFSETS is not None:
    register(POOL_WITH_OFFSETS)(_max_pool_with_offsets)
    register(OFFSETS_TO_INDICES)(_offsets_to_indices)


@register(aten.max_pool2d_with_indices_backward.default)
def _max_pool2d_backward(lw: GraphLowering, grad, x, kernel_size, stride, padding, dilation, ceil_mode, indices):
    """The input's gradient as a gather: each input element sums the output gradients of the
    (at most ceil(k/s) per dim) windows that cover it and chose it as their maximum.  ATen's
    kernel scatters with atomics, and needs the indices as int64; this reads them computed from
    the saved int8 offsets, fused (x is read for its shape only)."""
    k, s, p, d = _window(lw, x, kernel_size, stride, padding, dilation)
    if d != (1, 1):
        raise Unsupported("max-pool backward with dilation")
    if not isinstance(grad, TensorValue) or not isinstance(indices, TensorValue):
        raise Unsupported("max-pool backward of a non-tensor")
    out_h, out_w = grad.shape[-2], grad.shape[-1]
    width = x.shape[-1]
    acc = upcast(grad.dtype)
    # windows covering one input row: oh from (ih + p) // s down to ceil((ih + p - k + 1) / s)
    reach_h, reach_w = (k[0] - 1) // s[0] + 1, (k[1] - 1) // s[1] + 1

    def body(idx):
        ih, iw = idx[-2], idx[-1]
        lead = list(idx[:-2])
        here = ih * width + iw
        top, left = floordiv(ih + p[0], s[0]), floordiv(iw + p[1], s[1])
        total = None
        for a in range(reach_h):
            oh = top + (-a)
            for b in range(reach_w):
                ow = left + (-b)
                mask = _inside(oh, ow, out_h, out_w)
                sub = lead + [oh, ow]
                chose = op("and", mask, op("eq", masked(indices, sub, mask), here, dtype=torch.bool),
                           dtype=torch.bool)
                term = where(chose, cast(masked(grad, sub, mask), acc), const(0.0, acc))
                total = term if total is None else op("add", total, term, dtype=acc)
        return cast(total, grad.dtype)

    return ComputedValue(x.shape, grad.dtype, body)


@register(aten.avg_pool2d.default)
def _avg_pool2d(lw: GraphLowering, x, kernel_size, stride=(), padding=0, ceil_mode=False,
                count_include_pad=True, divisor_override=None):
    k, s, p, d = _window(lw, x, kernel_size, stride, padding, 1)
    out_shape = lw.out_shape()
    guard = _needs_mask(x, out_shape, k, s, p, d)
    acc = upcast(x.dtype)
    h_end, w_end = x.shape[-2] + p[0], x.shape[-1] + p[1]     # the padded input's end

    def body(idx):
        total, count = None, None
        for sub, mask, _ in _positions(x, idx, k, s, p, d):
            val = cast(masked(x, sub, mask) if guard else x.load(sub), acc)
            total = val if total is None else op("add", total, val, dtype=acc)
            if divisor_override or not guard:
                continue
            if count_include_pad:     # positions inside the padded input count, overhang does not
                inside = op("and", op("lt", sub[-2], h_end, dtype=torch.bool),
                            op("lt", sub[-1], w_end, dtype=torch.bool), dtype=torch.bool)
            else:
                inside = mask
            one = where(inside, const(1.0, acc), const(0.0, acc))
            count = one if count is None else op("add", count, one, dtype=acc)
        if divisor_override:
            count = const(float(divisor_override), acc)
        elif count is None:
            count = const(float(k[0] * k[1]), acc)
        return cast(op("truediv", total, count, dtype=acc), x.dtype)

    result = ComputedValue(out_shape, x.dtype, body)
    result.window = True
    return result
