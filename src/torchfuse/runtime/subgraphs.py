"""Regional compilation: a block marked `torch.compiler.nested_compile_region` is compiled once.

Dynamo traces such a block once and calls it through `invoke_subgraph` at each use (every layer
of a model); AOTAutograd keeps those calls, with the block's own forward and backward aten
graphs as submodules.  Run as ATen ops, each call would execute the block's graph op by op,
unfused.  Before an aten graph is lowered, each subgraph it calls is compiled by torchfuse once
(its own graph, with its own kernels) and put in place of the submodule: `invoke_subgraph` then
calls the compiled graph at every use, and the compile time is one block's, whatever the
number of layers.  Kernels do not fuse across a block's boundary.
"""
from __future__ import annotations

from typing import Any, Callable

import torch
import torch.fx as fx


class CompiledSubgraph(torch.nn.Module):
    """A compiled subgraph where `invoke_subgraph` expects the submodule: it calls boxed
    callables with the list of operands."""
    _boxed_call = True

    def __init__(self, call: Callable[[list], Any], name: str):
        super().__init__()
        self.call, self.name = call, name

    def forward(self, args: list) -> Any:
        return self.call(args)

    def extra_repr(self) -> str:
        return self.name


def compile_subgraphs(gm: fx.GraphModule, compile_one: Callable[[fx.GraphModule, str], Callable]) -> int:
    """Compile every subgraph that `invoke_subgraph` calls in `gm` with `compile_one(subgraph,
    name)` and put the result in its place; returns how many were compiled."""
    hop = getattr(torch.ops.higher_order, "invoke_subgraph", None)
    if hop is None:
        return 0
    names = []
    for node in gm.graph.find_nodes(op="call_function", target=hop):
        sub = node.args[0]
        if isinstance(sub, fx.Node) and sub.op == "get_attr" and sub.target not in names:
            names.append(sub.target)
    compiled = 0
    for name in names:
        sub_gm = getattr(gm, name)
        if isinstance(sub_gm, fx.GraphModule):
            setattr(gm, name, CompiledSubgraph(compile_one(sub_gm, name), name))
            compiled += 1
    return compiled
