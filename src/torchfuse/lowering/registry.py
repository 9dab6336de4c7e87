"""The op lowerings' registry: `register` maps aten overloads to functions that build loop IR
(`fn(lw, *args, **kwargs)`, lw the GraphLowering running).  Kept apart from the engine
(graph.py) so that the lowering files, the engine and the graph passes can all import it."""
from __future__ import annotations

from typing import Any, Callable

import torch
import torch.fx as fx

aten = torch.ops.aten

Lowering = Callable[..., Any]
LOWERINGS: dict[Any, Lowering] = {}


def register(*targets: Any) -> Callable[[Lowering], Lowering]:
    """Register a lowering for aten overloads; an overload packet registers all its overloads."""
    def deco(fn: Lowering) -> Lowering:
        for t in targets:
            if isinstance(t, torch._ops.OpOverloadPacket):
                for name in t.overloads():
                    LOWERINGS[getattr(t, name)] = fn
            else:
                LOWERINGS[t] = fn
        return fn
    return deco


# Ops whose result is smaller than what they read: each runs as a kernel of its own loop, apart
# from the elementwise readers of the same value (passes/unfuse_bias.py reads this too).
REDUCTIONS = frozenset({
    torch.ops.aten.sum.dim_IntList, torch.ops.aten.sum.default, torch.ops.aten.mean.dim,
    torch.ops.aten.mean.default, torch.ops.aten.prod.default, torch.ops.aten.prod.dim_int,
    torch.ops.aten.amax.default, torch.ops.aten.amin.default, torch.ops.aten.max.default,
    torch.ops.aten.min.default, torch.ops.aten.max.dim, torch.ops.aten.min.dim, torch.ops.aten.argmax.default,
    torch.ops.aten.argmin.default, torch.ops.aten.var.correction, torch.ops.aten.var_mean.correction,
    torch.ops.aten.std.correction, torch.ops.prims.sum.default, torch.ops.prims.var.default,
    torch.ops.aten._softmax.default, torch.ops.aten._log_softmax.default})


# Scatters (lowering/scatter.py): each runs as a kernel of its own over its source domain and
# evaluates there every argument but the tensor it starts from, so a value that several of them
# read is computed once in each (lowering/realize.py `scatter_recomputes`).  Per op: (the position
# of the tensor it starts from, None for a fill; the position of the tensor whose shape is its
# loop domain, None where the domain is a broadcast of several).
SCATTERS: dict[Any, tuple[int | None, int | None]] = {
    aten.scatter_add.default: (0, 2), aten.scatter.src: (0, 2), aten.scatter.reduce: (0, 2),
    aten.scatter_reduce.two: (0, 2), aten.index_put.default: (0, None), aten._unsafe_index_put.default: (0, None),
    aten.index_add.default: (0, 3), aten.index_copy.default: (0, 3), aten.embedding_dense_backward.default: (None, 0)}


def is_view(node: fx.Node) -> bool:
    return node.op == "call_function" and node.target in LOWERINGS and \
        (getattr(node.target, "is_view", False) or node.target is aten._unsafe_view.default)
