"""Sums autograd builds from one piece per step of an unrolled loop, rewritten as one op.

    mm(a1, b1) + ... + mm(an, bn)  ->  mm(cat([a1, ..., an], 1), cat([b1, ..., bn], 0))
    select_backward(g0, s, d, 0) + ... + select_backward(g{n-1}, s, d, n-1)  ->  stack([g0, ..., g{n-1}], d)

A weight used at every step of an unrolled loop (an RNN's recurrent weight, a GRU's gates) gets
one weight-gradient product per step, whose inner size is the batch, then a chain of adds.  On
the zoo's CPU LSTM that was 32 products of [512, 4] @ [4, 128] per step (each mostly call
overhead, at 4 multiply-adds per output) and an add chain reading 16 [512, 128] matrices per
weight; one [512, 64] @ [64, 128] product replaces each group.  Products are merged only where
the concatenation costs less than the sum it saves: every product's operands ((M + N) * K
elements to copy) no larger than its result (M * N elements to add), so a weight shared by big
products (ALBERT's one layer used twelve times over 4096 tokens) keeps its products.

The gradient of a sequence sliced step by step (`xs[:, t]`) is a zero tensor per step with one
slice filled, all added: one kernel evaluated every step's slice test for every element (about
1 ms per call for a GRU's [4, 16, 384] input gradient on CPU).  When the slices are each index
of the dim once, it is the stack of the step gradients (ATen copies them in one pass).

Static shapes only; the other addends of a sum of products stay.
"""
from __future__ import annotations

import torch
import torch.fx as fx

from ._meta import create_node, val_of
from .context import PassContext
from .dce import dce

aten = torch.ops.aten


def _is_plain_add(node: fx.Node) -> bool:
    return (node.op == "call_function" and node.target is aten.add.Tensor and len(node.args) == 2
            and not node.kwargs and all(isinstance(a, fx.Node) for a in node.args))


def _addends(root: fx.Node) -> list[fx.Node]:
    """The leaves of the add tree under `root` (inner adds read only by the tree)."""
    leaves, stack = [], list(root.args)
    while stack:
        n = stack.pop()
        if _is_plain_add(n) and len(n.users) == 1:
            stack.extend(n.args)
        else:
            leaves.append(n)
    return leaves


def _as_product(n: fx.Node, shape: tuple, dtype: torch.dtype) -> tuple[fx.Node, fx.Node, bool] | None:
    """(a, b, flipped): the addend is mm(a, b), or its transpose when `flipped` (autograd's
    weight gradients of a linear layer come as t(t(mm(...))) or t(mm(...))).  Every node on
    the way must be read by the sum alone."""
    flipped = False
    while n.op == "call_function" and n.target is aten.t.default and len(n.users) == 1:
        n, flipped = n.args[0], not flipped
    if not (n.op == "call_function" and n.target is aten.mm.default and len(n.users) == 1):
        return None
    out, a = val_of(n), val_of(n.args[0])
    if out is None or a is None or out.dtype != dtype:
        return None
    if tuple(reversed(out.shape) if flipped else out.shape) != shape:
        return None
    if not all(isinstance(s, int) for s in (*a.shape, *out.shape)):
        return None
    m, k = a.shape
    if (m + out.shape[1]) * k > m * out.shape[1]:
        return None
    return n.args[0], n.args[1], flipped


_ZEROS = (aten.new_zeros.default, aten.zeros.default)


def _slice_grad(n: fx.Node) -> tuple[fx.Node, list, int, int] | None:
    """(g, sizes, dim, index) for select_backward(g, sizes, dim, index), or its decomposition
    select_scatter(new_zeros(sizes), g, dim, index), read by the sum alone."""
    if n.op != "call_function" or len(n.users) != 1 or len(n.args) != 4 or n.kwargs:
        return None
    if n.target is aten.select_backward.default:
        g, sizes, dim, index = n.args
    elif n.target is aten.select_scatter.default:
        zeros, g, dim, index = n.args
        if not (isinstance(zeros, fx.Node) and zeros.op == "call_function" and zeros.target in _ZEROS
                and len(zeros.users) == 1 and val_of(zeros) is not None):
            return None
        sizes = list(val_of(zeros).shape)
    else:
        return None
    if not (isinstance(dim, int) and isinstance(index, int) and all(isinstance(s, int) for s in sizes)):
        return None
    return g, list(sizes), dim % len(sizes), index


def _stacked_slices(leaves: list[fx.Node]) -> tuple[list[fx.Node], int] | None:
    """(step gradients in index order, dim) when the addends are slice gradients of one shape
    and dim filling each index of the dim exactly once."""
    if len(leaves) < 2:
        return None
    grads = [_slice_grad(n) for n in leaves]
    if any(g is None for g in grads):
        return None
    sizes, dim = grads[0][1], grads[0][2]
    by_index: dict[int, fx.Node] = {}
    for g, s, d, i in grads:
        if s != sizes or d != dim:
            return None
        by_index[i % sizes[dim]] = g
    if sorted(by_index) != list(range(sizes[dim])) or len(by_index) != len(leaves):
        return None
    return [by_index[i] for i in range(sizes[dim])], dim


def merge_step_sums(gm: fx.GraphModule, ctx: PassContext) -> int:
    """Rewrite sums of per-step products and per-step slice gradients (see the module docstring)."""
    graph = gm.graph
    changes = 0
    for root in reversed(list(graph.nodes)):
        if not _is_plain_add(root):
            continue
        if any(_is_plain_add(u) and len(root.users) == 1 for u in root.users):
            continue                  # not the top of its tree
        out = val_of(root)
        if out is None or not out.dtype.is_floating_point:
            continue
        leaves = _addends(root)
        steps = _stacked_slices(leaves)
        if steps is not None:
            with graph.inserting_before(root):
                stacked = create_node(graph, aten.stack.default, steps, meta_from=root)
            if val_of(stacked).dtype == out.dtype and tuple(val_of(stacked).shape) == tuple(out.shape):
                root.replace_all_uses_with(stacked)
                changes += 1
            continue
        if out.ndim != 2:
            continue
        products = {n: _as_product(n, tuple(out.shape), out.dtype) for n in leaves}
        products = {n: p for n, p in products.items() if p is not None}
        if len(products) < 2:
            continue
        rest = [n for n in leaves if n not in products]
        with graph.inserting_before(root):
            lhs, rhs = [], []
            for a, b, flipped in products.values():
                if flipped:           # t(mm(a, b)) = mm(t(b), t(a))
                    a, b = (create_node(graph, aten.t.default, (b,), meta_from=root),
                            create_node(graph, aten.t.default, (a,), meta_from=root))
                lhs.append(a)
                rhs.append(b)
            a = create_node(graph, aten.cat.default, (lhs, 1), meta_from=root)
            b = create_node(graph, aten.cat.default, (rhs, 0), meta_from=root)
            total = create_node(graph, aten.mm.default, (a, b), meta_from=root)
            for n in rest:
                total = create_node(graph, aten.add.Tensor, (total, n), meta_from=root)
        if val_of(total).dtype != out.dtype or tuple(val_of(total).shape) != tuple(out.shape):
            continue              # (a broadcasting addend: left for DCE to drop the new nodes)
        root.replace_all_uses_with(total)
        changes += 1
    if changes:
        dce(gm, ctx)          # the replaced products and adds (the pass manager recompiles)
    return changes
