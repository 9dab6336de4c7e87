"""Upsampling in training graphs: a gather forward, and ATen's upsample backward, not a scatter.

PyTorch decomposes bilinear and nearest upsampling at the Autograd key (torch/_decomp registers
Python kernels there), so AOTAutograd differentiates the decomposition: every `_unsafe_index`
gather of the forward becomes an `_unsafe_index_put(accumulate=True)` in the backward, four per
bilinear upsample.  ATen runs an accumulating index_put serially on the CPU (0.6 ms for a
4x8x64x64 map on 2 cores: 23% of the zoo's U-Net training step) and by sorting on CUDA, where
ATen's own upsample backward (the op the decomposition replaced) is one pass.

So Dynamo's graph calls `torchfuse::upsample2d` instead of `F.interpolate` for 2-d bilinear
and nearest modes: an op whose forward decomposes (decompositions.py) to F.interpolate's gathers,
fused by torchfuse like any other, and whose autograd formula is `upsample_*2d_backward`
(through `torchfuse::upsample2d_backward`, which takes symbolic sizes), run by ATen.  Gradients are the same sums (ATen's backward kernel is what eager runs).
"""
from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx
import torch.nn.functional as F

from ..counters import counters

aten = torch.ops.aten

MODES = ("bilinear", "nearest")


def _scale_factors(size: Any, scale_factor: Any, recompute_scale_factor: bool | None) -> list[float] | None:
    """The scales F.interpolate hands the upsample op (and so the backward needs)."""
    if size is not None or recompute_scale_factor or scale_factor is None:
        return None
    return [float(s) for s in scale_factor]


@torch.library.custom_op("torchfuse::upsample2d", mutates_args=())
def upsample2d(x: torch.Tensor, mode: str, size: list[int] | None, scale_factor: list[float] | None,
               align_corners: bool | None, recompute_scale_factor: bool | None) -> torch.Tensor:
    """F.interpolate of a 4-d tensor in bilinear or nearest mode, differentiated by ATen's
    upsample backward.  An op (not a Python function) in Dynamo's graph keeps the graph
    cacheable; the decomposition table turns it back into F.interpolate's gathers."""
    return F.interpolate(x, size, scale_factor, mode, align_corners, recompute_scale_factor)


@upsample2d.register_fake
def _(x: torch.Tensor, mode: str, size: list[int] | None, scale_factor: list[float] | None,
      align_corners: bool | None, recompute_scale_factor: bool | None) -> torch.Tensor:
    return F.interpolate(x, size, scale_factor, mode, align_corners, recompute_scale_factor)


@torch.library.custom_op("torchfuse::upsample2d_backward", mutates_args=())
def upsample2d_backward(grad: torch.Tensor, mode: str, input_size: list[int], align_corners: bool,
                        scale_h: float | None, scale_w: float | None) -> torch.Tensor:
    """ATen's upsample backward.  An op of our own because ATen's takes `int[]` sizes, which a
    graph with a dynamic batch cannot trace; this one takes SymInts and runs ATen's with ints."""
    output_size = list(grad.shape[2:])
    if mode == "bilinear":
        return aten.upsample_bilinear2d_backward.default(grad, output_size, input_size, align_corners,
                                                         scale_h, scale_w)
    return aten.upsample_nearest2d_backward.default(grad, output_size, input_size, scale_h, scale_w)


@upsample2d_backward.register_fake
def _(grad: torch.Tensor, mode: str, input_size: list[int], align_corners: bool, scale_h: float | None,
      scale_w: float | None) -> torch.Tensor:
    channels_last = grad.is_contiguous(memory_format=torch.channels_last) and not grad.is_contiguous()
    return torch.empty(input_size, dtype=grad.dtype, device=grad.device,
                       memory_format=torch.channels_last if channels_last else torch.contiguous_format)


def _setup_context(ctx: Any, inputs: tuple, output: torch.Tensor) -> None:
    x, mode, size, scale_factor, align_corners, recompute_scale_factor = inputs
    ctx.saved = (mode, list(x.shape), bool(align_corners),
                 _scale_factors(size, scale_factor, recompute_scale_factor) or [None, None])


def _backward(ctx: Any, grad: torch.Tensor) -> tuple:
    mode, input_size, align_corners, (scale_h, scale_w) = ctx.saved
    return upsample2d_backward(grad, mode, input_size, align_corners, scale_h, scale_w), None, None, None, None, None


upsample2d.register_autograd(_backward, setup_context=_setup_context)


def decompose_upsample2d(x: torch.Tensor, mode: str, size: list[int] | None, scale_factor: list[float] | None,
                         align_corners: bool | None, recompute_scale_factor: bool | None) -> torch.Tensor:
    """For the decomposition table: the forward as F.interpolate's gathers, fused like any other."""
    return F.interpolate(x, size, scale_factor, mode, align_corners, recompute_scale_factor)


def _pair(value: Any, cast: type) -> list | None:
    if value is None:
        return None
    if isinstance(value, (list, tuple)):
        return list(value) if len(value) == 2 else None
    return [cast(value), cast(value)] if isinstance(value, (int, float)) else None


def _rewritten_args(node: fx.Node) -> tuple | None:
    """F.interpolate's arguments as upsample2d's, or None where this is not a 2-d bilinear or
    nearest upsample of a tensor that requires grad."""
    if node.op != "call_function" or node.target is not F.interpolate:
        return None
    names = ("input", "size", "scale_factor", "mode", "align_corners", "recompute_scale_factor", "antialias")
    args = dict(zip(names, node.args))
    args.update(node.kwargs)
    x = args.get("input")
    example = x.meta.get("example_value") if isinstance(x, fx.Node) else None
    mode = args.get("mode", "nearest")
    if mode not in MODES or args.get("antialias") or not isinstance(example, torch.Tensor) \
            or example.ndim != 4 or not example.requires_grad:
        return None
    size, scale = args.get("size"), args.get("scale_factor")
    pair_size, pair_scale = _pair(size, int), _pair(scale, float)
    if (size is not None and pair_size is None) or (scale is not None and pair_scale is None) \
            or (size is None) == (scale is None):
        return None
    return (x, mode, pair_size, pair_scale, args.get("align_corners"), args.get("recompute_scale_factor"))


def use_aten_backward(gm: fx.GraphModule, example_inputs: list) -> list[tuple]:
    """Point a training graph's 2-d bilinear and nearest F.interpolate calls at `upsample2d`
    (returns what `undo` needs)."""
    if not torch.is_grad_enabled() or not any(isinstance(x, torch.Tensor) and x.requires_grad
                                              for x in example_inputs):
        return []
    changed = []
    for node in gm.graph.nodes:
        args = _rewritten_args(node)
        if args is not None:
            changed.append((node, node.target, node.args, node.kwargs))
            node.target, node.args, node.kwargs = torch.ops.torchfuse.upsample2d.default, args, {}
    if changed:
        gm.recompile()
        counters.bump("upsample_aten_backward", len(changed))
    return changed


def undo(gm: fx.GraphModule, changed: list[tuple]) -> None:
    for node, target, args, kwargs in changed:
        node.target, node.args, node.kwargs = target, args, kwargs
    if changed:
        counters.bump("upsample_aten_backward", -len(changed))
        gm.recompile()
