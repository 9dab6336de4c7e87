"""Common subexpression elimination: two nodes with the same target and the same (canonical)
arguments compute the same value, so the later one can read the earlier one's result.

Exactness notes, i.e. why the key is not simply `(target, args, kwargs)`:
  * Python says 0.0 == -0.0 and 1 == 1.0 == True and gives them equal hashes, but
    `x + 0.0` and `x + -0.0` differ (for x = -0.0) and `x * 1` and `x * 1.0` have different
    dtypes for integer x.  Literals are keyed by their type and, for floats, `float.hex`.
  * Random ops are never merged (two `rand` calls give different numbers), nor are mutating
    ops, nor `empty` (two allocations are two buffers, which later in-place ops may fill
    differently).
  * A mutating op ends every earlier value's reuse: a read after the write may differ.
  * Merging two nodes that both reach the graph's outputs would hand the caller one tensor
    twice where eager gave two; `_util.can_forward` refuses that.
"""
from __future__ import annotations

from typing import Any, Hashable

import torch
import torch.fx as fx

from ._util import EMPTY_OPS, alias_root, can_forward, is_impure, is_mutating, op_name, written_args
from .context import PassContext


class _Unhashable(Exception):
    pass


def _key(a: Any) -> Hashable:
    """A hashable key equal for two argument values exactly when they mean the same thing."""
    if isinstance(a, fx.Node):
        return ("node", a)  # nodes hash by identity; merged nodes were already replaced
    if isinstance(a, bool):
        return ("bool", a)
    if isinstance(a, int):
        return ("int", a)
    if isinstance(a, float):
        return ("float", a.hex())  # distinguishes -0.0 from 0.0; nan keys equal to nan
    if isinstance(a, complex):
        return ("complex", a.real.hex(), a.imag.hex())
    if isinstance(a, (list, tuple)):
        return (type(a).__name__, tuple(_key(x) for x in a))
    if isinstance(a, dict):
        return ("dict", tuple(sorted((k, _key(v)) for k, v in a.items())))
    if isinstance(a, slice):
        return ("slice", _key(a.start), _key(a.stop), _key(a.step))
    if a is None or isinstance(a, (str, torch.dtype, torch.device, torch.layout, torch.memory_format)):
        return (type(a).__name__, a)
    # SymInts, tensors and anything else whose equality is not plain value equality
    raise _Unhashable(type(a).__name__)


def cse(gm: fx.GraphModule, ctx: PassContext) -> int:
    """Merge duplicate pure nodes into their first occurrence; return how many were merged."""
    graph = gm.graph
    # Storage some op writes into: a node living there is not a pure value.
    written = {alias_root(w) for n in graph.nodes for w in written_args(n)}
    table: dict[Hashable, fx.Node] = {}
    merged = 0
    for node in list(graph.nodes):
        if node.op != "call_function":
            continue
        if is_mutating(node):
            table.clear()  # values computed before a write are not reusable after it
            continue
        if is_impure(node) or op_name(node.target) in EMPTY_OPS or alias_root(node) in written:
            continue
        try:
            key = (node.target, _key(node.args), _key(node.kwargs))
        except _Unhashable:
            continue
        first = table.setdefault(key, node)
        if first is node or not can_forward(node, first):
            continue
        node.replace_all_uses_with(first)
        graph.erase_node(node)
        merged += 1
    return merged
