"""Pad matrix products whose sizes break cuBLAS's 16-byte alignment.

    mm(a[M, K], b[K, N])  ->  mm(pad(a)[M, K'], pad(b)[K', N'])[:, :N]     (K', N' rounded up)

cuBLAS picks its fast tensor-core kernels only when every matrix's leading dimension is a
multiple of 16 bytes.  A language model's vocabulary projection is the classic miss: GPT-2's
50257-wide logits make the output's rows 50257 * 2 bytes long, and the H100 runs an `align1`
CUTLASS kernel 7x slower than the aligned one (3.3 ms vs 0.45 ms for 4096x768x50257 in bf16).
Copying the weight into a padded buffer costs one pass over it (~0.05 ms), and the result is
a strided view of the padded product, so no copy of the (large) output is made.  Zero padding
along K adds zeros to every dot product, so the values are unchanged.

Applied to mm, addmm and bmm of fp16/bf16 (and fp32 where TF32 is allowed) on the devices in
`ctx.cublas_devices` (CUDA: CPU BLAS does not care), when the product is large enough for the
copy to be worth it and the padded sizes are compile-time integers (a symbolic M is fine: only K
and N are padded).
"""
from __future__ import annotations

import logging
from typing import Any

import torch
import torch.fx as fx

from ._meta import _fake_arg, create_node, fake_mode_of, size_hint, val_of
from .context import PassContext

aten = torch.ops.aten
log = logging.getLogger("torchfuse.passes")

# elements per 16 bytes
_ALIGN = {torch.float16: 8, torch.bfloat16: 8, torch.float32: 4}
# below this many multiply-adds the padding copies cost more than the slow kernel loses
MIN_MACS = 1 << 24


def _int(x: Any) -> int | None:
    return x if isinstance(x, int) else None


def _pad(graph: fx.Graph, node: fx.Node, pads: list[int], meta_from: fx.Node) -> fx.Node:
    """constant_pad_nd(node, pads) (pads as F.pad: last dim first), or node itself if no padding.

    A matrix stored transposed (a weight used as `w.t()`: unit stride along rows) is padded in
    its own layout, transposed back afterwards: the copy then reads and writes contiguous rows,
    ~5x faster than a transposing copy, and cuBLAS takes the transposed operand as it is."""
    if not any(pads):
        return node
    val = val_of(node)
    if len(pads) == 4 and val.ndim >= 2 and val.stride(-2) == 1 and val.stride(-1) != 1:
        swap = list(range(val.ndim - 2)) + [val.ndim - 1, val.ndim - 2]
        t = create_node(graph, aten.permute.default, (node, swap), meta_from=meta_from)
        t = create_node(graph, aten.constant_pad_nd.default, (t, [pads[2], pads[3], pads[0], pads[1]], 0.0),
                        meta_from=meta_from)
        return create_node(graph, aten.permute.default, (t, swap), meta_from=meta_from)
    return create_node(graph, aten.constant_pad_nd.default, (node, pads, 0.0), meta_from=meta_from)


def _rewrite(graph: fx.Graph, mm: fx.Node, ctx: PassContext) -> bool:
    out = val_of(mm)
    if not isinstance(out, torch.Tensor) or out.device.type not in ctx.cublas_devices:
        return False
    align = _ALIGN.get(out.dtype)
    if align is None:
        return False
    if out.dtype == torch.float32 and not ctx.fp32_matmul_tf32:
        # CUDA-core (SIMT) kernels: as fast unaligned (H100: 6.49 vs 6.49 ms for GPT-2's logits,
        # 0.077 vs 0.082 ms for an attention's probabilities @ values at 198 tokens), so the
        # copies would be pure cost
        log.debug("pad_mm: %s left alone: fp32 without TF32", mm.name)
        return False
    if mm.target is aten.addmm.default:
        bias, a, b = mm.args[:3]
    else:
        bias, (a, b) = None, mm.args[:2]
    va, vb = val_of(a), val_of(b)
    if not (isinstance(va, torch.Tensor) and isinstance(vb, torch.Tensor)) or va.dtype != vb.dtype:
        return False
    k, n = _int(va.shape[-1]), _int(vb.shape[-1])
    if k is None or n is None or k == 0 or n == 0:
        return False
    pad_k, pad_n = -k % align, -n % align
    if not (pad_k or pad_n):
        return False
    macs = size_hint(va.shape[-2]) * k * n * (size_hint(va.shape[0]) if va.ndim == 3 else 1)
    if macs < MIN_MACS:
        log.debug("pad_mm: %s %s x %s left alone: %d multiply-adds are too few to pay for the copies",
                  mm.name, list(va.shape), list(vb.shape), macs)
        return False
    with graph.inserting_before(mm):
        a2 = _pad(graph, a, [0, pad_k, 0, 0], mm)
        b2 = _pad(graph, b, [0, pad_n, 0, pad_k], mm)
        args: tuple
        if bias is not None:
            vbias = val_of(bias)
            # a bias broadcast along N (size 1 or missing) needs no padding
            wide = isinstance(vbias, torch.Tensor) and vbias.ndim >= 1 and _int(vbias.shape[-1]) == n and n != 1
            bias2 = _pad(graph, bias, [0, pad_n], mm) if wide and pad_n else bias
            args = (bias2, a2, b2)
        else:
            args = (a2, b2)
        padded = create_node(graph, mm.target, args, dict(mm.kwargs), meta_from=mm)
        result = padded
        if pad_n:
            result = create_node(graph, aten.slice.Tensor, (padded, out.ndim - 1, 0, n), meta_from=mm)
    mm.replace_all_uses_with(result)
    graph.erase_node(mm)
    if pad_n and not _refresh_views(result):
        # a view that cannot take the sliced (row-padded) layout, e.g. one merging the sliced dim
        # with its neighbour: hand the views a contiguous copy (rare: projections are usually
        # only split along rows)
        with graph.inserting_after(result):
            contiguous = create_node(graph, aten.clone.default, (result,),
                                     {"memory_format": torch.contiguous_format}, meta_from=mm)
        result.replace_all_uses_with(contiguous, delete_user_cb=lambda user: user is not contiguous)
        _refresh_views(contiguous)
    log.debug("pad_mm: %s %s x %s padded K+%d N+%d", mm.name, list(va.shape), list(vb.shape), pad_k, pad_n)
    return True


def _is_view(node: fx.Node) -> bool:
    t = node.target
    return isinstance(t, torch._ops.OpOverload) and (t.is_view or t is aten._unsafe_view.default)


def _refresh_views(node: fx.Node) -> bool:
    """Recompute meta["val"] of the views reading `node` (and views of those): the lowering takes
    a view's strides from it, and the rewrite changed the layout underneath.  False if one of
    them cannot view the new layout."""
    mode = fake_mode_of(node.graph)
    for user in list(node.users):
        if user.op != "call_function" or not _is_view(user):
            continue
        args, kwargs = fx.node.map_arg((user.args, user.kwargs), lambda n: _fake_arg(n, mode))
        try:
            with mode:
                val = user.target(*args, **kwargs)
        except Exception:
            return False
        user.meta["val"] = val
        if not _refresh_views(user):
            return False
    return True


def pad_mm(gm: fx.GraphModule, ctx: PassContext) -> int:
    """Pad the K and N sizes of large unaligned mm/addmm/bmm to 16-byte multiples; returns how many."""
    targets = (aten.mm.default, aten.addmm.default, aten.bmm.default)
    changes = 0
    for node in list(gm.graph.nodes):
        if node.op == "call_function" and node.target in targets:
            changes += _rewrite(gm.graph, node, ctx)
    return changes
