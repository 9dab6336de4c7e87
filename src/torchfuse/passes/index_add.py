"""Run an accumulating index_put along one index tensor as ATen's index_add.

    index_put(base, [idx], values, accumulate=True)
      ->  index_add(base, 0, where(idx < 0, idx + base.size(0), idx).view(-1),
                    values.expand(idx.shape + base.shape[1:]).contiguous().view(-1, *base.shape[1:]))

Why: the backward of a gather `table[idx]` (Swin's relative position bias, any `x[idx]` that
needs a gradient) is an accumulating index_put into zeros.  On CUDA, ATen runs every accumulating
index_put through its sorting path (`index_put_with_sort`): about ten kernels and host work per
call (Swin-T training: 12 of them, ~100 kernel launches per step), where index_add adds each
row with atomics in one kernel, as Inductor's generated scatter does.  Like Inductor's, the sum
order then depends on the schedule, so with `torch.use_deterministic_algorithms(True)` (which
Dynamo guards on) the index_put is kept, and so it is for fp16 and bf16, whose atomics round
every partial sum.

The rewrite is exact: `base[idx] += values` with one index tensor on dim 0 adds row `values[j]`
(broadcast to `idx.shape + base.shape[1:]`) into row `idx[j]`, duplicates accumulating; index_add
does the same, given non-negative indices (index_put counts negative ones from the end).  Only on
the devices in `ctx.index_add_devices` (CUDA): on the CPU, index_put's serial loop beats
index_add's one tensor add per index for the narrow rows these gradients have.

Why it stays now that accumulating index_put and index_add both lower to the same scatter kernel
(lowering/scatter.py; Triton's atomic sums cover every dtype this pass rewrites): on the CPU it
never ran, and enabling it there changed nothing (same kernels; a [169, 3] position-bias and a
[100k, 64] gather gradient timed alike, 1 thread), so there is nothing to remove there.  On CUDA
it is a no-op for graphs the lowering takes, but it still decides what ATen runs whenever the
index_put is left to ATen (`fuse` off, a graph that falls back, a lowering refused for another
reason): ATen's sorting index_put against one atomic index_add, unmeasured on a GPU since.
"""
from __future__ import annotations

import logging

import torch
import torch.fx as fx

from ._meta import create_node, has_symbols, same_seq, val_of
from .context import PassContext

aten = torch.ops.aten
log = logging.getLogger(__name__)

_INDEX_PUTS = (aten.index_put.default, aten._unsafe_index_put.default)
# index_add's atomics add in the tensor's own dtype, where index_put sums a row's duplicates in
# fp32 first: in bf16 a [169, 3] position-bias gradient came out at 1.8x eager's error against
# fp64 on an H100 (Inductor keeps ATen's index_put for bf16 and fp16 too)
_EXACT_ENOUGH = (torch.float32, torch.float64, torch.int32, torch.int64)


def _rewritable(node: fx.Node, ctx: PassContext) -> bool:
    if node.op != "call_function" or node.target not in _INDEX_PUTS or len(node.args) < 4 or node.args[3] is not True:
        return False
    base, indices, values = node.args[:3]
    if len(indices) != 1 or not isinstance(indices[0], fx.Node):
        return False
    bv, iv, vv = val_of(base), val_of(indices[0]), val_of(values)
    if not all(isinstance(v, torch.Tensor) for v in (bv, iv, vv)):
        return False
    if has_symbols([*bv.shape, *iv.shape, *vv.shape]):
        return False        # (the new nodes would need the sizes as graph values: kept as it is)
    return (bv.device.type in ctx.index_add_devices and bv.ndim >= 1 and iv.dtype in (torch.int64, torch.int32)
            and vv.dtype == bv.dtype and bv.dtype in _EXACT_ENOUGH and not torch.are_deterministic_algorithms_enabled())


def accumulate_by_index_add(gm: fx.GraphModule, ctx: PassContext) -> int:
    """Replace each accumulating single-index index_put on `ctx.index_add_devices` by
    index_add (module docstring)."""
    changes = 0
    graph = gm.graph
    for node in list(graph.nodes):
        if not _rewritable(node, ctx):
            continue
        base, (idx,), values = node.args[:3]
        bv, iv, vv = val_of(base), val_of(idx), val_of(values)
        rows = [*iv.shape, *bv.shape[1:]]
        with graph.inserting_before(node):
            # index_put counts a negative index from the end; index_add's kernels assert >= 0
            negative = create_node(graph, aten.lt.Scalar, (idx, 0), meta_from=node)
            wrapped = create_node(graph, aten.add.Tensor, (idx, bv.shape[0]), meta_from=node)
            idx = create_node(graph, aten.where.self, (negative, wrapped, idx), meta_from=node)
            if iv.ndim != 1:
                idx = create_node(graph, aten.view.default, (idx, [-1]), meta_from=node)
            # (index_add reads a source of any strides: a copy only where it must be reshaped)
            full = same_seq(vv.shape, rows)
            if not full:
                values = create_node(graph, aten.expand.default, (values, rows), meta_from=node)
            if iv.ndim != 1 or not full:
                values = create_node(graph, aten.clone.default, (values,),
                                     {"memory_format": torch.contiguous_format}, meta_from=node)
                values = create_node(graph, aten.view.default, (values, [-1, *bv.shape[1:]]), meta_from=node)
            added = create_node(graph, aten.index_add.default, (base, 0, idx, values), meta_from=node)
        node.replace_all_uses_with(added)
        graph.erase_node(node)
        changes += 1
    if changes:
        graph.lint()
        gm.recompile()
        log.debug("accumulate_by_index_add: %d index_put(accumulate=True) -> index_add", changes)
    return changes
