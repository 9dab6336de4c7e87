"""Training graphs of CNNs on channels-last activations, decided on Dynamo's graph.

oneDNN's convolutions, forward and backward, are 10-40% faster on channels-last activations,
and users pass NCHW.  For inference graphs `passes/channels_last.py` re-lays the aten graph;
a training graph cannot be changed that way after AOTAutograd, since the forward's saved
activations and the backward's gradients would change layout across the two graphs.  So for
training the change is made *before* AOTAutograd: Dynamo's graph reads a channels-last copy of
the input of each convolution whose input is plain NCHW (one copy per value), and AOTAutograd
then traces forward and backward with the strides that follow (batch-norm statistics become
column reductions, which the C++ backend's column plan runs at bandwidth).  A 4-d graph output
that eager gives contiguous is made contiguous again, so callers see eager's strides.

Each k x k weight (and a graph input that requires grad) is copied to channels-last once in the graph too (else ATen copies it in every
convolution call, forward and backward), through a reshape to 1-d and back, so that autograd's
gradient of the copy, which has the copy's layout, passes through a reshape that gives it the
parameter's (contiguous) layout again: the weight gradient leaves the graph in the parameter's
layout, as eager's does.  Whether a graph is re-laid is `passes/layout_rule.decide_layout`'s
choice (training rules: on the CPU, not where the weights outweigh the activations they
convolve; `Config.channels_last_convs` forces it either way).  If AOTAutograd cannot trace the
rewritten graph (a `view` that needs NCHW strides), the caller undoes the rewrite and compiles
the graph as it was.
"""
from __future__ import annotations

import logging
from typing import Any

import torch
import torch.fx as fx

from ..config import Config
from ..counters import counters
from ..passes.layout_rule import MIN_ACTIVATIONS_PER_WEIGHT, MIN_CONVS, LayoutDecision, conv_info, decide_layout

__all__ = ["wants_channels_last", "training_layout", "to_channels_last", "undo", "MIN_ACTIVATIONS_PER_WEIGHT",
           "MIN_CONVS"]

log = logging.getLogger("torchfuse.layout")

_CONVS = {torch.conv2d, torch.nn.functional.conv2d}
_TRANSPOSED = {torch.conv_transpose2d, torch.nn.functional.conv_transpose2d}


def _plain_nchw(t: Any) -> bool:
    return (isinstance(t, torch.Tensor) and t.ndim == 4 and t.is_contiguous() and t.shape[1] > 1
            and not t.is_contiguous(memory_format=torch.channels_last))


def _example(node: Any) -> Any:
    return node.meta.get("example_value") if isinstance(node, fx.Node) else None


def _convs(gm: fx.GraphModule) -> list[fx.Node]:
    """The 2-d convolutions (transposed ones too) on NCHW activations."""
    return [n for n in gm.graph.nodes if n.op == "call_function" and n.target in _CONVS | _TRANSPOSED
            and _plain_nchw(_example(n.args[0]))]


def _groups(node: fx.Node) -> int:
    groups = node.kwargs.get("groups", node.args[6] if len(node.args) > 6 else 1)
    return groups if isinstance(groups, int) else 1


def training_layout(gm: fx.GraphModule, example_inputs: list, config: Config) -> LayoutDecision | None:
    """The layout decision for a training graph (some input requires grad, grad mode on, the
    pass enabled); None for other graphs."""
    if "channels_last_convs" not in config.passes or not torch.is_grad_enabled():
        return None
    if not any(isinstance(x, torch.Tensor) and x.requires_grad for x in example_inputs):
        return None
    convs = _convs(gm)
    infos = [conv_info(_example(n.args[0]), _example(n.args[1]), _example(n), _groups(n), n.target in _TRANSPOSED)
             for n in convs if isinstance(_example(n.args[1]), torch.Tensor) and isinstance(_example(n), torch.Tensor)]
    x = _example(convs[0].args[0]) if convs else None
    return decide_layout(infos, device=x.device.type if x is not None else "cpu",
                         dtype=x.dtype if x is not None else torch.float32, inference=False,
                         override=config.channels_last_convs, devices=config.channels_last_devices,
                         graph_nodes=len(gm.graph.nodes))


def wants_channels_last(gm: fx.GraphModule, example_inputs: list, config: Config, report: Any = None) -> bool:
    """Whether to re-lay this training graph channels-last (`training_layout`); the decision is
    logged, and listed in `report` (an Explanation) when given."""
    decision = training_layout(gm, example_inputs, config)
    if decision is None:
        return False
    if decision.convs:
        log.info("training graph: %s", decision)
        if report is not None:
            report.layouts.append(f"training graph (Dynamo's, before AOTAutograd): {decision}")
    return decision.channels_last


def to_channels_last(gm: fx.GraphModule) -> list[fx.Node]:
    """Insert the copies (returns them, for `undo`)."""
    graph = gm.graph
    copies: dict[fx.Node, fx.Node] = {}
    inserted: list[fx.Node] = []       # in order: `undo` takes them out backwards
    for node in _convs(gm):
        for k, src in enumerate(node.args[:2]):
            val = _example(src)
            if not isinstance(src, fx.Node) or not _plain_nchw(val):
                continue        # (1 x 1 and depthwise weights are channels-last already)
            if src not in copies:
                with graph.inserting_before(node):
                    if k == 1 or (src.op == "placeholder" and val.requires_grad):
                        # a weight, or an input that gets a gradient: the reshapes make autograd
                        # hand its gradient back contiguous (module docstring)
                        flat = graph.call_method("reshape", (src, -1))
                        back = graph.call_method("view_as", (flat, src))
                        inserted += [flat, back]
                    else:
                        back = src
                    copies[src] = graph.call_method("contiguous", (back,), {"memory_format": torch.channels_last})
                inserted.append(copies[src])
            node.replace_input_with(src, copies[src])
    output = graph.output_node()
    for src in list(output.all_input_nodes):
        if _plain_nchw(_example(src)):
            with graph.inserting_before(output):
                back = graph.call_method("contiguous", (src,))
            output.replace_input_with(src, back)
            inserted.append(back)
    gm.recompile()
    counters.bump("channels_last_training")
    log.debug("channels-last training graph: %d copies", len(inserted))
    return inserted


def undo(gm: fx.GraphModule, inserted: list[fx.Node]) -> None:
    if not inserted:
        return
    counters.bump("channels_last_training", -1)
    for node in reversed(inserted):
        node.replace_all_uses_with(node.args[0])
        gm.graph.erase_node(node)
    gm.recompile()
