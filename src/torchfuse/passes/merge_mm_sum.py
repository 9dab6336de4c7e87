"""A sum of matrix products becomes one product over the concatenated inner dim.

    mm(a1, b1) + mm(a2, b2) + ... + mm(an, bn)  ->  mm(cat([a1, ..., an], 1), cat([b1, ..., bn], 0))

Autograd makes such sums for a weight used at every step of an unrolled loop (an RNN's
recurrent weight, a GRU's gates): one weight-gradient product per step, whose inner size is the
batch, then a chain of adds.  On the zoo's CPU LSTM that was 32 products of [512, 4] @ [4, 128]
per step (each mostly call overhead, at 4 multiply-adds per output) and an add chain reading 16
[512, 128] matrices per weight; one [512, 64] @ [64, 128] product replaces each group.

Only where the concatenation costs less than the sum it saves: every product's operands
((M + N) * K elements to copy) no larger than its result (M * N elements to add), so a weight
shared by big products (ALBERT's one layer used twelve times over 4096 tokens) keeps its
products.  Static shapes only; the other addends of the sum stay.
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


def merge_mm_sum(gm: fx.GraphModule, ctx: PassContext) -> int:
    """Rewrite sums of two or more small-inner-size matrix products (see the module docstring)."""
    graph = gm.graph
    changes = 0
    for root in reversed(list(graph.nodes)):
        if root.graph is not graph or not _is_plain_add(root):
            continue
        if any(_is_plain_add(u) and len(root.users) == 1 for u in root.users):
            continue                  # not the top of its tree
        out = val_of(root)
        if out is None or out.ndim != 2 or not out.dtype.is_floating_point:
            continue
        leaves = _addends(root)
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
