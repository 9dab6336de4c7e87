"""Move a matrix product's or a convolution's bias add into the kernel that consumes it.

    addmm(bias, a, b)          ->  mm(a, b) + bias                   (pass `unfuse_addmm`)
    convolution(x, w, bias)    ->  convolution(x, w, None) + bias    (pass `unfuse_conv_bias`)

each only when every use of the result is pointwise, a reduction or a concatenation.  Matmul and convolution stay in
cuBLAS/cuDNN, and the scheduler fuses the pointwise consumers of their output (GELU, the
residual add before a layer norm, a batch norm + ReLU) into one kernel; the bias add then costs
nothing there, since that kernel reads the product anyway.
- Kept as addmm, the bias pins cuBLAS to its bias-epilogue kernels: on an H100 in fp32 these are
  `align1` SIMT kernels, ~1.4x slower than the plain GEMM for GPT-2's MLP (0.32 vs 0.23 ms per
  4096x768x3072 product).
- ATen runs a cuDNN convolution's bias as a separate in-place `add_` over the whole output (one
  more read and write of the activation, one more launch), which the consumer kernel gets free.

Only on the devices in `ctx.cublas_devices` (CPU BLAS and oneDNN fuse their bias themselves),
only for floating dtypes, and only when all uses, looking through views, are pointwise ops or
reductions (a layer norm's statistics): an addmm feeding another matmul, attention, or a graph
output keeps its bias epilogue.
"""
from __future__ import annotations

import operator

import torch
import torch.fx as fx

from ..lowering.registry import REDUCTIONS
from ._meta import create_node, val_of
from .context import PassContext

aten = torch.ops.aten
# ops that only select or rearrange elements: a bias add moves through them (a GRU's gates are
# the chunks of one product: split, then getitem)
_VIEWS = {aten.view.default, aten._unsafe_view.default, aten.reshape.default, aten.unsqueeze.default,
          aten.squeeze.dim, aten.expand.default, aten.split.Tensor, aten.split_with_sizes.default,
          aten.slice.Tensor, aten.select.int, aten.permute.default, aten.transpose.int, aten.t.default,
          aten.unbind.int, operator.getitem}


# reductions the lowering computes in a kernel of its own, which reads its input through any
# pointwise producer: a layer norm's statistics over a convolution's output (ConvNeXt's depthwise
# convolution, permuted, then normalized) take the bias add into the same loads
_REDUCTIONS = REDUCTIONS | {aten.native_layer_norm.default}


def _pointwise_uses_only(node: fx.Node) -> bool:
    """Whether every use of `node`, looking through views, is a pointwise op or a reduction, so
    a bias add on it fuses into each reading kernel."""
    if not node.users:
        return False
    for use in node.users:
        if use.op != "call_function":
            return False
        if use.target in _VIEWS:
            if not _pointwise_uses_only(use):
                return False
        elif use.target is aten.cat.default:
            # U-Net's up-convolution concatenated with its skip: the fused cat kernel reads the
            # part through the bias add (a cat of more parts runs in ATen, which would add it in
            # a kernel of its own, as ATen's convolution does)
            from ..lowering.views import CAT_MAX_FUSED_PARTS
            if len(use.args[0]) > CAT_MAX_FUSED_PARTS:
                return False
        elif use.target is aten._to_copy.default:
            # a dtype conversion (bf16 upcast before a layer norm's statistics), not a device move
            if "device" in use.kwargs and use.kwargs["device"] != getattr(val_of(node), "device", None):
                return False
        elif use.target not in _REDUCTIONS and \
                not (isinstance(use.target, torch._ops.OpOverload) and torch.Tag.pointwise in use.target.tags):
            return False
    return True


def unfuse_addmm(gm: fx.GraphModule, ctx: PassContext) -> int:
    """Rewrite addmm whose uses are all pointwise into mm + bias (see the module docstring)."""
    changes = 0
    graph = gm.graph
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target is not aten.addmm.default:
            continue
        out = val_of(node)
        if not isinstance(out, torch.Tensor) or out.device.type not in ctx.cublas_devices \
                or not out.dtype.is_floating_point or not _pointwise_uses_only(node):
            continue
        bias, a, b = node.args[:3]
        beta, alpha = node.kwargs.get("beta", 1), node.kwargs.get("alpha", 1)
        with graph.inserting_before(node):
            prod = create_node(graph, aten.mm.default, (a, b), meta_from=node)
            if alpha != 1:
                prod = create_node(graph, aten.mul.Tensor, (prod, alpha), meta_from=node)
            if beta == 0:        # addmm ignores the bias (NaN included) when beta is 0
                result = prod
            else:
                if beta != 1:
                    bias = create_node(graph, aten.mul.Tensor, (bias, beta), meta_from=node)
                result = create_node(graph, aten.add.Tensor, (prod, bias), meta_from=node)
        if val_of(result).dtype != out.dtype or tuple(val_of(result).shape) != tuple(out.shape):
            continue       # (the dead new nodes are removed by the following dce)
        node.replace_all_uses_with(result)
        graph.erase_node(node)
        changes += 1
    return changes


def unfuse_conv_bias(gm: fx.GraphModule, ctx: PassContext) -> int:
    """Rewrite convolutions with a bias whose uses are all pointwise into a bias-free
    convolution + bias add (see the module docstring)."""
    changes = 0
    graph = gm.graph
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target is not aten.convolution.default or len(node.args) != 9:
            continue
        x, w, bias = node.args[:3]
        out = val_of(node)
        if bias is None or not isinstance(out, torch.Tensor) or out.dim() < 3 \
                or out.device.type not in ctx.cublas_devices or not out.dtype.is_floating_point \
                or not _pointwise_uses_only(node):
            continue
        with graph.inserting_before(node):
            conv = create_node(graph, aten.convolution.default, (x, w, None, *node.args[3:]), meta_from=node)
            # the bias is per output channel, dim 1 of the output (transposed convolutions too)
            per_channel = create_node(graph, aten.view.default, (bias, [-1] + [1] * (out.dim() - 2)),
                                      meta_from=node)
            result = create_node(graph, aten.add.Tensor, (conv, per_channel), meta_from=node)
        got = val_of(result)
        if got.dtype != out.dtype or tuple(got.shape) != tuple(out.shape):
            continue       # (the dead new nodes are removed by the following dce)
        node.replace_all_uses_with(result)
        graph.erase_node(node)
        changes += 1
    return changes
