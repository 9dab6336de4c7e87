"""Compute a strided 1x1 convolution's weight gradient as a unit-stride one, on the CPU.

    convolution_backward(g, x, w, stride=s, padding=0, mask=[i, True, b])
      ->  convolution_backward(g, x, w, stride=s, padding=0, mask=[i, False, b])     (if i or b)
          convolution_backward(g, x[..., ::s, ::s], w, stride=1, padding=0, mask=[False, True, False])

Why: oneDNN's x64 1x1 convolution computes a strided weight gradient by first gathering the
strided input into a unit-stride workspace ("rtus"), and for channels-last inputs with fewer input
channels per group than its channel block (8 or 16) it writes past that workspace
(uxlfoundation/oneDNN#6035).  Depending on the batch, the thread count and the machine, the result
is a segmentation fault, heap corruption ("double free or corruption"), a hang, or a silently wrong
weight gradient.  PyTorch 2.11-2.13 on the CPU all reach it: a ResNet's stride-2 1x1 downsample
with 8 input channels, channels-last, batch 3 crashes eagerly too.  torchfuse lays CPU training
steps out channels-last itself (`channels_last_devices`), so without this rewrite a user's NCHW
model that trains fine eagerly would crash under torchfuse.

The rewrite is exact: a 1x1 convolution with stride s and no padding reads only the input
positions 0, s, 2s, ..., which `x[..., ::s, ::s]` selects (a view; oneDNN copies it into its own
layout, which is what its workspace did), and a unit-stride 1x1 convolution needs no workspace.
Applied only where the bug can be reached (1x1 kernel, a stride above 1, no padding, fewer than 16
input channels per group, a CPU tensor), so large convolutions keep oneDNN's own path.
"""
from __future__ import annotations

import logging
import operator

import torch
import torch.fx as fx

from ._meta import create_node, val_of
from .context import PassContext

aten = torch.ops.aten
log = logging.getLogger(__name__)

# the largest oneDNN x64 input-channel block (AVX-512: 16; AVX2: 8); the bug needs fewer channels
_CHANNEL_BLOCK = 16


def _reaches_bug(node: fx.Node) -> bool:
    if len(node.args) != 11:
        return False
    go, x, w, _bias_sizes, stride, padding, _dilation, transposed, _out_pad, _groups, mask = node.args
    xv, wv = val_of(x), val_of(w)
    if not isinstance(xv, torch.Tensor) or not isinstance(wv, torch.Tensor) or xv.device.type != "cpu":
        return False
    return (not transposed and bool(mask[1]) and all(k == 1 for k in wv.shape[2:])
            and any(s != 1 for s in stride) and all(p == 0 for p in padding)
            and isinstance(wv.shape[1], int) and wv.shape[1] < _CHANNEL_BLOCK)


def strided_1x1_grads(gm: fx.GraphModule, ctx: PassContext) -> int:
    """Split each CPU strided 1x1 convolution_backward that can reach oneDNN#6035 (module
    docstring) into the input/bias gradients as before and a unit-stride weight gradient."""
    changes = 0
    graph = gm.graph
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target is not aten.convolution_backward.default \
                or not _reaches_bug(node):
            continue
        go, x, w, bias_sizes, stride, _padding, dilation, _transposed, _out_pad, groups, mask = node.args
        if any(u.target is not operator.getitem for u in node.users):
            continue
        spatial = len(stride)
        with graph.inserting_before(node):
            rest = None
            if mask[0] or mask[2]:
                rest = create_node(graph, aten.convolution_backward.default,
                                   (*node.args[:10], [mask[0], False, mask[2]]), meta_from=node)
            picked = x
            for dim, step in enumerate(stride):
                if step != 1:
                    picked = create_node(graph, aten.slice.Tensor, (picked, 2 + dim, 0, None, step),
                                         meta_from=node)
            weight = create_node(graph, aten.convolution_backward.default,
                                 (go, picked, w, bias_sizes, [1] * spatial, [0] * spatial, dilation, False,
                                  [0] * spatial, groups, [False, True, False]), meta_from=node)
        for use in list(node.users):
            # an output the mask leaves out is None from either call
            source = rest if use.args[1] != 1 and mask[use.args[1]] else weight
            use.replace_input_with(node, source)
        graph.erase_node(node)
        log.debug("strided_1x1_grads: %s's weight gradient at unit stride (oneDNN#6035)", node.name)
        changes += 1
    return changes
