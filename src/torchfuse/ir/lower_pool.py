"""Lowerings of 2-d pooling windows: max pooling (with its indices) and average pooling, for
the Triton backend (GPU; CPU tensors under `cpu_backend="triton"`).

Each output element loads its window (at most `MAX_WINDOW` elements) as a stencil of the
input, so a pooling fuses with the pointwise op that feeds it (batch norm + ReLU + max-pool
in one kernel) and writes in the input's memory format. ATen's channels-last pooling kernels
are slow (an inception forward spent 3 ms of 10 in `avg_pool2d_out_cuda_frame_nhwc`), and a
fallback also cuts the fusion around it. Larger windows run through ATen.

Semantics follow ATen's kernels exactly: padded positions never win a max (and are skipped
by its index), the first strict maximum wins and a NaN always wins; an average divides by
the window clipped to the padded input (or to the input with `count_include_pad=False`),
or by `divisor_override`.
"""
from __future__ import annotations

from typing import Any, Sequence

import torch

from .buffers import ComputedValue, TensorValue, Unsupported
from .lower_pointwise import register, upcast
from .lower_views import masked
from .lowering import GraphLowering, shape_of
from .nodes import INDEX, Node, cast, const, op, where

aten = torch.ops.aten

MAX_WINDOW = 64      # window elements unrolled into one kernel; larger windows run through ATen


def _pair(v: Any, default: Sequence[int] | None = None) -> tuple[int, int]:
    if v is None or (isinstance(v, (list, tuple)) and len(v) == 0):
        if default is None:
            raise Unsupported("pooling without a kernel size")
        return _pair(default)
    if isinstance(v, int):
        return (v, v)
    if len(v) == 1:
        return (int(v[0]), int(v[0]))
    return (int(v[0]), int(v[1]))


def _window(lw: GraphLowering, x: TensorValue, kernel: Any, stride: Any, padding: Any, dilation: Any) -> tuple:
    if lw.device is not None and lw.device.type == "cpu" and lw.config.cpu_backend == "cpp":
        # g++ does not vectorize the window's masked loads: 6-40x slower than ATen's oneDNN
        # pooling on channels-last tensors, and a fused producer is recomputed per window element
        raise Unsupported("pooling on the C++ backend (ATen's vectorized pooling is faster)")
    if not isinstance(x, TensorValue) or x.ndim not in (3, 4):
        raise Unsupported("pooling of a tensor that is not 3-d or 4-d")
    if not x.dtype.is_floating_point:
        raise Unsupported(f"pooling of {x.dtype}")
    k, s = _pair(kernel), _pair(stride, kernel)
    p, d = _pair(padding), _pair(dilation)
    if any(not isinstance(v, int) for v in (*k, *s, *p, *d)):
        raise Unsupported("pooling with symbolic window parameters")
    if k[0] * k[1] > MAX_WINDOW:
        raise Unsupported(f"pooling window of {k[0] * k[1]} elements (more than {MAX_WINDOW})")
    return k, s, p, d


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
            mask = None
            for c in (op("ge", ih, const(0), dtype=torch.bool), op("lt", ih, h_size, dtype=torch.bool),
                      op("ge", iw, const(0), dtype=torch.bool), op("lt", iw, w_size, dtype=torch.bool)):
                mask = c if mask is None else op("and", mask, c, dtype=torch.bool)
            out.append((lead + [ih, iw], mask, ih * w_size + iw))
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


@register(aten.max_pool2d_with_indices.default)
def _max_pool2d_with_indices(lw: GraphLowering, x, kernel_size, stride=(), padding=0, dilation=1, ceil_mode=False):
    k, s, p, d = _window(lw, x, kernel_size, stride, padding, dilation)
    metas = lw.out_meta()
    out_shape = shape_of(metas[0])
    guard = _needs_mask(x, out_shape, k, s, p, d)
    acc = upcast(x.dtype)
    lowest = const(float("-inf"), acc)

    def scan(idx):
        best, arg = None, None
        for sub, mask, flat in _positions(x, idx, k, s, p, d):
            val = cast(masked(x, sub, mask) if guard else x.load(sub), acc)
            if best is None and not guard:
                best, arg = val, flat
                continue
            if best is None:
                best, arg = lowest, flat
            take = op("or", op("gt", val, best, dtype=torch.bool), op("isnan", val, dtype=torch.bool),
                      dtype=torch.bool)
            if guard:
                take = op("and", mask, take, dtype=torch.bool)
            best, arg = where(take, val, best), where(take, flat, arg)
        return best, arg

    values = ComputedValue(out_shape, x.dtype, lambda idx: cast(scan(idx)[0], x.dtype))
    indices = ComputedValue(out_shape, torch.int64, lambda idx: cast(scan(idx)[1], torch.int64))
    values.meta, indices.meta = metas[0], metas[1]
    values.window = indices.window = True
    return values, indices


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
