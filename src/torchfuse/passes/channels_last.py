"""Run the convolutions of an inference graph on channels-last activations.

oneDNN's convolutions are 10-35% faster on channels-last (NHWC) activations than on NCHW ones,
most of all the depthwise and grouped ones, and a model's user rarely converts their input.  So,
as Inductor's layout optimization does: each convolution whose input is not channels-last
reads a channels-last copy of it, and of its weight (a parameter's copy is made once, by
`hoist_static`, and held between calls: one more copy of the k x k weights in memory).  The
convolution's output is then channels-last, and so is everything computed from it elementwise
(ATen's layout propagation), which this pass re-derives node by node on the fake values; the
next convolutions then need no copy.  The copy of a
computed input costs nothing: the lowering writes the producing kernel's output in that layout.

Where a node cannot take the new layout (a `view` that needs contiguous strides: a flatten),
its input is made contiguous again first; a graph output keeps the strides eager gives it.
Inference graphs only (a training graph's saved activations and gradients would change layout
across the forward/backward boundary: `frontend/channels_last_training.py` re-lays those before
AOTAutograd), and only where `layout_rule.decide_layout` chooses channels-last for the graph
(its convolutions' number, kinds, dtype, device and cuDNN's TF32 setting; or the
`channels_last_convs` option's True / False).  The decision and its reason are logged on the
"torchfuse.layout" logger and kept in `gm.meta["torchfuse_layout"]` for `explain()`.
"""
from __future__ import annotations

import logging
import operator
from typing import Any

import torch
import torch.fx as fx

from ._meta import fake_mode_of, val_of
from ._util import alias_input
from .context import PassContext
from .layout_rule import MIN_CONVS, LayoutDecision, conv_info, decide_layout

__all__ = ["channels_last_convs", "graph_layout", "MIN_CONVS"]

aten = torch.ops.aten
log = logging.getLogger("torchfuse.layout")

# ops whose result keeps fixed strides that a layout change would make impossible
_NEEDS_CONTIGUOUS = {aten.view.default, aten._unsafe_view.default}
# ops that address their input by explicit strides: on another layout they would read other
# elements without failing, so the pass gives up on such a graph
_EXPLICIT_STRIDES = {aten.as_strided.default, aten.as_strided_scatter.default, aten.as_strided_.default}


def _is_plain_nchw(t: Any) -> bool:
    return (isinstance(t, torch.Tensor) and t.ndim == 4 and t.is_contiguous()
            and not t.is_contiguous(memory_format=torch.channels_last))


def _not_channels_last(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and t.ndim == 4 and not t.is_contiguous(memory_format=torch.channels_last)


def _wants_channels_last(node: fx.Node) -> bool:
    """A 2-d convolution on an activation that is not channels-last: an NCHW one, or a slice
    or channel shuffle of one (ShuffleNet's branches), which ATen would copy to NCHW first."""
    if node.target is not aten.convolution.default:
        return False
    x, out = val_of(node.args[0]), val_of(node)
    return isinstance(out, torch.Tensor) and out.ndim == 4 and _not_channels_last(x)


def graph_layout(gm: fx.GraphModule, ctx: PassContext) -> LayoutDecision:
    """The layout decision for the convolutions of `gm` (an aten graph)."""
    convs = [n for n in gm.graph.nodes if _wants_channels_last(n)]
    infos = [conv_info(val_of(n.args[0]), val_of(n.args[1]), val_of(n), n.args[8], bool(n.args[6]))
             for n in convs if isinstance(val_of(n.args[1]), torch.Tensor)]
    x = val_of(convs[0].args[0]) if convs else None
    return decide_layout(infos, device=x.device.type if x is not None else "cpu",
                         dtype=x.dtype if x is not None else torch.float32, inference=ctx.inference,
                         override=ctx.channels_last, devices=ctx.channels_last_devices, tf32=ctx.cudnn_tf32,
                         graph_nodes=len(gm.graph.nodes))


def _relaid(src: Any, vals: dict[fx.Node, Any]) -> bool:
    """Whether `src` may sit in its storage otherwise than in the graph as traced: its strides
    or offset changed, or it views another value (as_strided may read beyond the view).  A
    value computed downstream of a re-laid activation often keeps its strides: group norm's
    decomposition takes `as_strided` of its [N, 1, C, 1] scale, computed from per-sample
    statistics (MobileViT-v2's norms), which reads the same elements in either layout."""
    if not isinstance(src, fx.Node) or src not in vals:
        return False
    new, old = vals[src], val_of(src)
    if not isinstance(new, torch.Tensor) or not isinstance(old, torch.Tensor):
        return True
    return (alias_input(src) is not None or new.stride() != old.stride()
            or new.storage_offset() != old.storage_offset())


def _fake(a: Any, vals: dict[fx.Node, Any]) -> Any:
    return fx.node.map_arg(a, lambda n: vals.get(n, n.meta.get("val")))


def channels_last_convs(gm: fx.GraphModule, ctx: PassContext) -> int:
    graph = gm.graph
    if not ctx.inference:
        return 0
    decision = graph_layout(gm, ctx)
    if decision.convs:
        log.info("inference graph: %s", decision)
        gm.meta["torchfuse_layout"] = str(decision)
    if not decision.channels_last:
        return 0
    mode = fake_mode_of(graph)
    new_vals: dict[fx.Node, Any] = {}      # re-derived fake values of the nodes downstream
    inserted: list[fx.Node] = []           # the copies, in insertion order

    copies: dict[tuple[fx.Node, torch.memory_format], fx.Node] = {}

    def copy_before(user: fx.Node, src: fx.Node, fmt: torch.memory_format) -> fx.Node:
        # one copy per value and layout: the branches of an inception block share it (it is
        # made before the first user, which comes before the others)
        node = copies.get((src, fmt))
        if node is None:
            with graph.inserting_before(user):
                node = graph.call_function(aten.clone.default, (src,), {"memory_format": fmt})
            node.meta.update({k: v for k, v in src.meta.items() if k not in ("val", "tensor_meta")})
            with mode:
                new_vals[node] = aten.clone.default(_fake(src, new_vals), memory_format=fmt)
            copies[(src, fmt)] = node
            inserted.append(node)
        user.replace_input_with(src, node)
        return node

    def derive(node: fx.Node) -> Any:
        if node.target is operator.getitem:
            return _fake(node.args[0], new_vals)[node.args[1]]
        args, kwargs = _fake(node.args, new_vals), _fake(node.kwargs, new_vals)
        with mode:
            return node.target(*args, **kwargs)

    try:
        for node in list(graph.nodes):
            if node.op != "call_function":
                continue
            if _wants_channels_last(node):
                x, w = node.args[0], node.args[1]
                if not _fake(x, new_vals).is_contiguous(memory_format=torch.channels_last):
                    copy_before(node, x, torch.channels_last)
                if isinstance(w, fx.Node) and _is_plain_nchw(_fake(w, new_vals)):
                    # else ATen copies the weight to the input's layout in every call (twice the
                    # time of a resnet18 call on 2 cores); a parameter's copy is hoisted out of the call
                    copy_before(node, w, torch.channels_last)
            changed = any(isinstance(a, fx.Node) and a in new_vals for a in node.all_input_nodes)
            if not changed:
                continue
            if node.target in _EXPLICIT_STRIDES and _relaid(node.args[0], new_vals):
                raise ValueError(f"{node.name} addresses a re-laid-out value by explicit strides")
            if node.target in _NEEDS_CONTIGUOUS:
                # a view that the new strides allow stays a view (splitting the channels of a
                # channels-last activation, a channel shuffle's first step; merging H and W);
                # only one they do not (a flatten) reads a contiguous copy
                try:
                    new_vals[node] = derive(node)
                    continue
                except (RuntimeError, ValueError):
                    copy_before(node, node.args[0], torch.contiguous_format)
            new_vals[node] = derive(node)
        _restore_output_strides(graph, new_vals, copy_before, derive)
    except Exception as e:     # an op whose layout rules we cannot follow: leave the graph as it was
        log.info("inference graph stays NCHW: %s", e)
        for node in reversed(inserted):
            node.replace_all_uses_with(node.args[0])
            graph.erase_node(node)
        gm.meta["torchfuse_layout"] = f"NCHW: chose channels-last ({decision.reason}), but an op's layout rules " \
                                      "could not be followed"
        return 0
    if not inserted:
        return 0
    for node, val in new_vals.items():
        node.meta["val"] = val
        node.meta.pop("tensor_meta", None)
    return sum(1 for n in inserted if n.kwargs.get("memory_format") is torch.channels_last)


def _restore_output_strides(graph: fx.Graph, new_vals: dict[fx.Node, Any], copy_before: Any, derive: Any) -> None:
    """Graph outputs keep eager's strides: a contiguous output that became channels-last is
    copied back (a CNN's outputs are mostly [N, classes] logits, where nothing changes); an
    output that is a view (a slice of an activation) is taken from a contiguous copy of the
    activation it views, so that it is the same view as eager's."""
    output = graph.output_node()
    for src in list(output.all_input_nodes):
        new, old = new_vals.get(src), val_of(src)
        if new is None or not isinstance(old, torch.Tensor) or new.stride() == old.stride():
            continue
        chain, base = [], src
        while (up := alias_input(base)) is not None:
            chain.append(base)
            base = up
        if not isinstance(val_of(base), torch.Tensor) or not val_of(base).is_contiguous():
            raise ValueError(f"output {src.name} views {base.name}, whose eager layout is not contiguous")
        if not chain:
            copy_before(output, src, torch.contiguous_format)
            continue
        copy_before(chain[-1], base, torch.contiguous_format)
        for node in reversed(chain):
            new_vals[node] = derive(node)
        if new_vals[src].stride() != old.stride():
            raise ValueError(f"output {src.name} keeps no eager strides")
