"""Fold an inference-mode batch norm into the convolution that feeds it.

    y = bn(conv(x, w, b))  =  conv(x, w * scale[:, None, ...], (b - mean) * scale + beta)
    where scale = gamma * rsqrt(running_var + eps)

The folded weight and bias are computed *in the graph* from the bn parameters (which are graph
inputs after AOTAutograd, so they may change between calls): the added nodes work on
parameter-sized tensors, while the activation-sized normalization pass disappears.

Only for inference graphs: in a training graph the batch norm's statistics and the gradient
w.r.t. its own parameters need the un-folded form.  Skipped: transposed convolutions (their
weight is [in, out/groups, ...], so the channel axis differs), convolutions read by anyone
besides the batch norm, batch norms whose saved mean/rstd outputs are used, and anything whose
folded result would not have the batch norm output's exact shape/strides/dtype.

The fold is computed in at least float32 (eager batch norm uses float32 math for half inputs)
and cast back to the convolution weight's dtype.
"""
from __future__ import annotations

import operator
from typing import Any

import torch
import torch.fx as fx

from ._meta import create_node, same_meta, same_seq, val_of
from .context import PassContext

aten, prims = torch.ops.aten, torch.ops.prims

# batch norm op -> index of its `training` argument (None: implicitly False), of eps
_BN_OPS: dict[Any, tuple[int | None, int]] = {
    aten._native_batch_norm_legit_no_training.default: (None, 6),
    aten._native_batch_norm_legit.default: (5, 7),
    aten.native_batch_norm.default: (5, 7),
    aten.batch_norm.default: (5, 7),
}


def _bn_outputs(bn: fx.Node) -> list[fx.Node]:
    """The nodes carrying the normalized activation (getitem 0 for tuple-returning variants)."""
    if bn.target is aten.batch_norm.default:
        return [bn]
    outs = list(bn.users)
    if not all(u.target is operator.getitem for u in outs):
        return []
    if any(u.args[1] != 0 and u.users for u in outs):
        return []  # the saved statistics are read: keep the batch norm
    return [u for u in outs if u.args[1] == 0]


def _match(bn: fx.Node) -> tuple[fx.Node, list[fx.Node]] | None:
    """(conv, bn outputs) if `bn` is an inference batch norm of a foldable convolution."""
    training_idx, eps_idx = _BN_OPS[bn.target]
    if len(bn.args) <= eps_idx or (training_idx is not None and bn.args[training_idx] is not False):
        return None
    conv, w_bn, b_bn, mean, var = bn.args[:5]
    if not (isinstance(conv, fx.Node) and conv.target is aten.convolution.default and len(conv.users) == 1):
        return None
    if len(conv.args) != 9 or conv.args[6] is not False:  # transposed
        return None
    if not (isinstance(mean, fx.Node) and isinstance(var, fx.Node) and isinstance(conv.args[1], fx.Node)):
        return None
    if not isinstance(bn.args[eps_idx], (int, float)):
        return None
    w, m, v = val_of(conv.args[1]), val_of(mean), val_of(var)
    if not all(isinstance(t, torch.Tensor) for t in (w, m, v)) or not w.is_floating_point():
        return None
    if m.dim() != 1 or not same_seq(m.shape, w.shape[:1]) or not same_seq(v.shape, m.shape):
        return None  # the bn channels must be the conv's output channels
    for p in (w_bn, b_bn):
        if p is not None and not (isinstance(p, fx.Node) and isinstance(val_of(p), torch.Tensor)):
            return None
    outs = _bn_outputs(bn)
    return (conv, outs) if outs else None


def _fold(graph: fx.Graph, bn: fx.Node, conv: fx.Node) -> fx.Node:
    """Build the folded convolution before `bn`; return it."""
    def op(target: Any, *args: Any, **kwargs: Any) -> fx.Node:
        return create_node(graph, target, args, kwargs, meta_from=bn)

    def cast(n: fx.Node | None, dtype: torch.dtype) -> fx.Node | None:
        if n is None or val_of(n).dtype == dtype:
            return n
        return op(prims.convert_element_type.default, n, dtype)

    x, w, b = conv.args[:3]
    w_bn, b_bn, mean, var = bn.args[1:5]
    eps = bn.args[_BN_OPS[bn.target][1]]
    wdtype = val_of(w).dtype
    fdtype = torch.promote_types(torch.promote_types(wdtype, val_of(var).dtype), torch.float32)

    scale = op(aten.rsqrt.default, op(aten.add.Tensor, cast(var, fdtype), eps))
    if w_bn is not None:
        scale = op(aten.mul.Tensor, scale, cast(w_bn, fdtype))
    # broadcast the per-output-channel scale over [out, in/groups, k...]; groups do not matter
    # because dim 0 of a (non-transposed) weight is always the output channel
    shape = [-1] + [1] * (val_of(w).dim() - 1)
    new_w = op(aten.mul.Tensor, cast(w, fdtype), op(aten.view.default, scale, shape))
    shifted = (op(aten.sub.Tensor, cast(b, fdtype), cast(mean, fdtype)) if b is not None
               else op(aten.neg.default, cast(mean, fdtype)))
    new_b = op(aten.mul.Tensor, shifted, scale)
    if b_bn is not None:
        new_b = op(aten.add.Tensor, new_b, cast(b_bn, fdtype))
    bias_dtype = val_of(b).dtype if b is not None else wdtype
    return op(aten.convolution.default, x, cast(new_w, wdtype), cast(new_b, bias_dtype), *conv.args[3:])


def conv_bn_fold(gm: fx.GraphModule, ctx: PassContext) -> int:
    """Fold inference batch norms into their convolutions; return how many were folded."""
    if not ctx.inference:
        return 0
    graph, folded = gm.graph, 0
    for bn in list(graph.nodes):
        if bn.op != "call_function" or bn.target not in _BN_OPS:
            continue
        match = _match(bn)
        if match is None:
            continue
        conv, outs = match
        marker = bn.prev  # everything inserted lands between marker and bn
        try:
            with graph.inserting_before(bn):
                new_conv = _fold(graph, bn, conv)
            ok = same_meta(val_of(new_conv), val_of(outs[0]))
        except Exception:  # fake execution refused something (odd dtypes, devices): keep as is
            ok = False
        if not ok:
            _erase_between(graph, marker, bn)
            continue
        for out in outs:
            out.replace_all_uses_with(new_conv)
        for n in [*bn.users, bn, conv]:  # getitems, then the bn, then the conv: all dead now
            if not n.users:
                graph.erase_node(n)
        folded += 1
    return folded


def _erase_between(graph: fx.Graph, first: fx.Node, end: fx.Node) -> None:
    """Undo a failed fold: erase the (unused) nodes inserted after `first` and before `end`."""
    created = []
    n = first.next
    while n is not end:
        created.append(n)
        n = n.next
    for n in reversed(created):
        graph.erase_node(n)
