"""Upsampling in training graphs: a gather forward, and ATen's upsample backward, not a scatter.

PyTorch decomposes nearest, nearest-exact and (bi/tri)linear upsampling at the Autograd key
(torch/_decomp registers Python kernels there), so AOTAutograd differentiates the
decomposition: every `_unsafe_index` gather of the forward becomes an
`_unsafe_index_put(accumulate=True)` in the backward, four per bilinear upsample.  ATen runs an
accumulating index_put serially on the CPU (0.6 ms for a 4x8x64x64 map on 2 cores: 23% of the
zoo's U-Net training step) and by sorting on CUDA (the U-Net's GPU step took 2x eager's time),
where ATen's own upsample backward (the op the decomposition replaced) is one pass.

So Dynamo's graph calls `torchfuse::upsample` instead of `F.interpolate` for those modes: an op
whose forward decomposes (decompositions.py) to F.interpolate's gathers, fused by torchfuse like
any other, and whose autograd formula is ATen's `upsample_*_backward` (through
`torchfuse::upsample_backward`, which takes symbolic sizes).  Gradients are eager's sums (ATen's
backward kernel is what eager runs).
"""
from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx
import torch.nn.functional as F

from ..counters import counters

aten = torch.ops.aten

# (mode, spatial dims) -> ATen's backward, for the modes PyTorch decomposes at the Autograd key
_BACKWARDS = {
    ("nearest", 1): aten.upsample_nearest1d_backward.default,
    ("nearest", 2): aten.upsample_nearest2d_backward.default,
    ("nearest", 3): aten.upsample_nearest3d_backward.default,
    ("nearest-exact", 1): aten._upsample_nearest_exact1d_backward.default,
    ("nearest-exact", 2): aten._upsample_nearest_exact2d_backward.default,
    ("nearest-exact", 3): aten._upsample_nearest_exact3d_backward.default,
    ("linear", 1): aten.upsample_linear1d_backward.default,
    ("bilinear", 2): aten.upsample_bilinear2d_backward.default,
    ("trilinear", 3): aten.upsample_trilinear3d_backward.default,
}
_ALIGNED = ("linear", "bilinear", "trilinear")   # their backwards take align_corners


def _scale_factors(size: Any, scale_factor: Any, recompute_scale_factor: bool | None) -> list[float] | None:
    """The scales F.interpolate hands the upsample op (and so the backward needs)."""
    if size is not None or recompute_scale_factor or scale_factor is None:
        return None
    return [float(s) for s in scale_factor]


def interpolate(x: torch.Tensor, mode: str, size: list[int] | None, scale_factor: list[float] | None,
                align_corners: bool | None, recompute_scale_factor: bool | None) -> torch.Tensor:
    """F.interpolate in one of _BACKWARDS's modes: `upsample`'s kernel, its fake kernel, and its
    entry in the decomposition table (which turns it back into F.interpolate's gathers, fused
    like any other)."""
    return F.interpolate(x, size, scale_factor, mode, align_corners, recompute_scale_factor)


# An op (not a Python function) in Dynamo's graph keeps the graph cacheable; its autograd
# formula (below) is ATen's upsample backward.
upsample = torch.library.custom_op("torchfuse::upsample", interpolate, mutates_args=())
upsample.register_fake(interpolate)


@torch.library.custom_op("torchfuse::upsample_backward", mutates_args=())
def upsample_backward(grad: torch.Tensor, mode: str, input_size: list[int], align_corners: bool,
                      scales: list[float] | None) -> torch.Tensor:
    """ATen's upsample backward.  An op of our own because ATen's take `int[]` sizes, which a
    graph with a dynamic batch cannot trace; this one takes SymInts and runs ATen's with ints."""
    op = _BACKWARDS[(mode, grad.ndim - 2)]
    output_size = list(grad.shape[2:])
    scales = scales or [None] * (grad.ndim - 2)
    if mode in _ALIGNED:
        return op(grad, output_size, input_size, align_corners, *scales)
    return op(grad, output_size, input_size, *scales)


@upsample_backward.register_fake
def _(grad: torch.Tensor, mode: str, input_size: list[int], align_corners: bool,
      scales: list[float] | None) -> torch.Tensor:
    channels_last = grad.ndim == 4 and grad.is_contiguous(memory_format=torch.channels_last) \
        and not grad.is_contiguous()
    return torch.empty(input_size, dtype=grad.dtype, device=grad.device,
                       memory_format=torch.channels_last if channels_last else torch.contiguous_format)


def _setup_context(ctx: Any, inputs: tuple, output: torch.Tensor) -> None:
    x, mode, size, scale_factor, align_corners, recompute_scale_factor = inputs
    ctx.saved = (mode, list(x.shape), bool(align_corners), _scale_factors(size, scale_factor, recompute_scale_factor))


def _backward(ctx: Any, grad: torch.Tensor) -> tuple:
    mode, input_size, align_corners, scales = ctx.saved
    return upsample_backward(grad, mode, input_size, align_corners, scales), None, None, None, None, None


upsample.register_autograd(_backward, setup_context=_setup_context)


def _per_dim(value: Any, cast: type, dims: int) -> list | None:
    if value is None:
        return None
    if isinstance(value, (list, tuple)):
        return list(value) if len(value) == dims else None
    return [cast(value)] * dims if isinstance(value, (int, float)) else None


def _rewritten_args(node: fx.Node) -> tuple | None:
    """F.interpolate's arguments as upsample's, or None where this is not an upsample in one of
    _BACKWARDS's modes of a tensor that requires grad."""
    if node.op != "call_function" or node.target is not F.interpolate:
        return None
    names = ("input", "size", "scale_factor", "mode", "align_corners", "recompute_scale_factor", "antialias")
    args = dict(zip(names, node.args))
    args.update(node.kwargs)
    x = args.get("input")
    example = x.meta.get("example_value") if isinstance(x, fx.Node) else None
    mode = args.get("mode", "nearest")
    if args.get("antialias") or not isinstance(example, torch.Tensor) or not example.requires_grad \
            or (mode, example.ndim - 2) not in _BACKWARDS:
        return None
    size, scale = args.get("size"), args.get("scale_factor")
    dim_size, dim_scale = _per_dim(size, int, example.ndim - 2), _per_dim(scale, float, example.ndim - 2)
    if (size is not None and dim_size is None) or (scale is not None and dim_scale is None) \
            or (size is None) == (scale is None):
        return None
    return (x, mode, dim_size, dim_scale, args.get("align_corners"), args.get("recompute_scale_factor"))


def use_aten_backward(gm: fx.GraphModule, example_inputs: list) -> list[tuple]:
    """Point a training graph's F.interpolate calls in _BACKWARDS's modes at `upsample`
    (returns what `undo` needs)."""
    if not torch.is_grad_enabled() or not any(isinstance(x, torch.Tensor) and x.requires_grad
                                              for x in example_inputs):
        return []
    changed = []
    for node in gm.graph.nodes:
        args = _rewritten_args(node)
        if args is not None:
            changed.append((node, node.target, node.args, node.kwargs))
            node.target, node.args, node.kwargs = torch.ops.torchfuse.upsample.default, args, {}
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
