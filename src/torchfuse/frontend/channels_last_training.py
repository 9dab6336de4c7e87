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

Weights stay as they are (ATen hands oneDNN a channels-last view of each in every call; a
parameter changes every step, so no copy could be hoisted): graphs whose convolutions read
fewer activation elements than MIN_ACTIVATIONS_PER_WEIGHT per weight element are left alone,
as are graphs with fewer than `channels_last.MIN_CONVS` such convolutions and devices outside
`Config.channels_last_devices`.  If AOTAutograd cannot trace the rewritten graph (a `view` that
needs NCHW strides), the caller undoes the rewrite and compiles the graph as it was.
"""
from __future__ import annotations

import logging
from typing import Any

import torch
import torch.fx as fx

from ..config import Config
from ..counters import counters
from ..passes.channels_last import MIN_CONVS

log = logging.getLogger("torchfuse")

_CONVS = {torch.conv2d, torch.nn.functional.conv2d}

# Each step copies every weight to channels-last for oneDNN and its gradient back: a net whose
# weights outweigh the activations they convolve loses more there than its convolutions gain.
# Measured on the zoo's CPU training steps (2 cores; conv input elements per weight element:
# step time NCHW -> channels-last): resnet18 (0.14: 14.7 -> 19.0 ms), resnet50 (0.40: 14.7 ->
# 14.1), resnext50 (0.62: 13.5 -> 11.9), mobilenet_v3 (1.0: 22.0 -> 18.5), inception (1.3:
# 18.0 -> 15.0), efficientnet_b0 (1.3: 19.7 -> 16.7), densenet (3.3: 12.0 -> 10.0).
MIN_ACTIVATIONS_PER_WEIGHT = 0.3


def _plain_nchw(t: Any) -> bool:
    return (isinstance(t, torch.Tensor) and t.ndim == 4 and t.is_contiguous() and t.shape[1] > 1
            and not t.is_contiguous(memory_format=torch.channels_last))


def _example(node: Any) -> Any:
    return node.meta.get("example_value") if isinstance(node, fx.Node) else None


def wants_channels_last(gm: fx.GraphModule, example_inputs: list, config: Config) -> bool:
    """A training graph (some input requires grad) with enough NCHW convolutions on a device of
    `Config.channels_last_devices`, the pass enabled."""
    if "channels_last_convs" not in config.passes or not torch.is_grad_enabled():
        return False
    if not any(isinstance(x, torch.Tensor) and x.requires_grad for x in example_inputs):
        return False
    convs = [n for n in gm.graph.nodes if n.op == "call_function" and n.target in _CONVS
             and _plain_nchw(_example(n.args[0]))
             and _example(n.args[0]).device.type in config.channels_last_devices]
    if len(convs) < MIN_CONVS:
        return False
    weights = sum(_example(n.args[1]).numel() for n in convs if isinstance(_example(n.args[1]), torch.Tensor))
    activations = sum(_example(n.args[0]).numel() for n in convs)
    return activations >= MIN_ACTIVATIONS_PER_WEIGHT * weights


def to_channels_last(gm: fx.GraphModule) -> list[fx.Node]:
    """Insert the copies (returns them, for `undo`)."""
    graph = gm.graph
    copies: dict[fx.Node, fx.Node] = {}
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target not in _CONVS:
            continue
        x = node.args[0]
        if not _plain_nchw(_example(x)):
            continue
        if x not in copies:
            with graph.inserting_before(node):
                copies[x] = graph.call_method("contiguous", (x,), {"memory_format": torch.channels_last})
        node.replace_input_with(x, copies[x])
    inserted = list(copies.values())
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
