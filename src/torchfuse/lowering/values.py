"""What the lowering reads off an aten graph's tensors: symbolic sizes as index nodes, shapes,
layouts, the graph's device, the layout rules of convolutions and attention kernels."""
from __future__ import annotations

from typing import Any, Iterable, Sequence

import torch
import torch.fx as fx

from ..ir.buffers import Layout, Unsupported
from ..ir.nodes import INDEX, Node, const, floordiv, mod, sym

aten = torch.ops.aten
prims = torch.ops.prims

# --------------------------------------------------------------------------------------------
# symbolic sizes: sympy expressions from Dynamo become our own index nodes
# --------------------------------------------------------------------------------------------

def sym_to_node(x: Any) -> Node:
    """An int or SymInt (or its sympy expression) as an index Node."""
    if isinstance(x, Node):
        return x
    if isinstance(x, bool):
        return const(int(x))
    if isinstance(x, int):
        return const(x)
    if isinstance(x, torch.SymInt):
        if x.node.is_nested_int():
            raise Unsupported("nested int sizes")
        hint = x.node.maybe_as_int()
        if hint is not None:
            return const(hint)
        return sympy_to_node(x.node.expr)
    return sympy_to_node(x)


def sympy_to_node(e: Any) -> Node:
    import sympy
    if isinstance(e, sympy.Integer):
        return const(int(e))
    if isinstance(e, sympy.Symbol):
        return sym(e.name)
    if isinstance(e, sympy.Add):
        out = const(0)
        for a in e.args:
            out = out + sympy_to_node(a)
        return out
    if isinstance(e, sympy.Mul):
        out = const(1)
        for a in e.args:
            out = out * sympy_to_node(a)
        return out
    if isinstance(e, sympy.Pow) and isinstance(e.exp, sympy.Integer) and int(e.exp) >= 0:
        out = const(1)
        base = sympy_to_node(e.base)
        for _ in range(int(e.exp)):
            out = out * base
        return out
    name = type(e).__name__
    if name == "Max":
        # Max(1, s0*s1) -- a stride of a dim that may be empty -- for backed sizes, which are
        # >= 2 (0 and 1 are specialized): the product itself.
        consts = [a for a in e.args if isinstance(a, sympy.Integer)]
        rest = [a for a in e.args if not isinstance(a, sympy.Integer)]
        if len(rest) == 1 and all(int(c) <= 1 for c in consts) and _positive_size(rest[0]):
            return sympy_to_node(rest[0])
        out = sympy_to_node(e.args[0])
        for a in e.args[1:]:
            out = Node("maximum", (out, sympy_to_node(a)), None, INDEX)
        return out
    if name == "FloorDiv":
        return floordiv(sympy_to_node(e.args[0]), sympy_to_node(e.args[1]))
    if name in ("Mod", "PythonMod"):
        return mod(sympy_to_node(e.args[0]), sympy_to_node(e.args[1]))
    if name in ("CeilToInt", "FloorToInt") and type(e.args[0]).__name__ == "IntTrueDiv":
        # math.ceil(s / 32) of ints (memory-efficient attention pads its log-sum-exp rows to a
        # multiple of 32): ceil(a / b) = (a + b - 1) // b for b > 0
        num, den = e.args[0].args
        if den.is_positive:
            n, d = sympy_to_node(num), sympy_to_node(den)
            return floordiv(n + d - const(1), d) if name == "CeilToInt" else floordiv(n, d)
    raise Unsupported(f"symbolic size expression {e} ({name})")


def _positive_size(e: Any) -> bool:
    """A sum/product with positive coefficients of backed size symbols (s0, s1, ...: >= 2)."""
    import sympy
    if isinstance(e, sympy.Symbol):
        return e.name.startswith("s")
    if isinstance(e, sympy.Integer):
        return int(e) >= 1
    if isinstance(e, (sympy.Add, sympy.Mul)):
        return all(_positive_size(a) for a in e.args)
    if isinstance(e, sympy.Pow):
        return isinstance(e.exp, sympy.Integer) and int(e.exp) >= 1 and _positive_size(e.base)
    return False


def meta_val(node: fx.Node) -> Any:
    return node.meta.get("val", node.meta.get("example_value"))


def shape_of(t: torch.Tensor) -> tuple[Node, ...]:
    return tuple(sym_to_node(s) for s in t.shape)


def size_hint(x: Any) -> int:
    """A concrete value for ordering only; reading it installs no Dynamo guard."""
    if isinstance(x, torch.SymInt):
        h = x.node.hint
        return int(h) if h is not None else 0
    return int(x)


def is_dense(t: torch.Tensor) -> bool:
    """Non-overlapping and dense: every element has its own slot and no slot is unused.

    Decided structurally on our own index nodes (dims ordered by stride hints), so symbolic
    sizes are never specialized (no Dynamo guard is installed) by the check.
    """
    try:
        layout = layout_of(t)
    except Unsupported:
        return False
    order = sorted(range(t.ndim), key=lambda d: (size_hint(t.stride()[d]), size_hint(t.shape[d])))
    expected: Node = const(1)
    for d in order:
        size = layout.sizes[d]
        if size.op == "const" and size.arg == 1:
            continue
        if layout.strides[d] != expected:
            return False
        expected = expected * size
    return True


def is_non_overlapping(t: torch.Tensor) -> bool:
    """No two elements share a slot; gaps are allowed.  Concrete sizes only (else False)."""
    if any(isinstance(v, torch.SymInt) and v.node.maybe_as_int() is None for v in (*t.shape, *t.stride())):
        return False
    dims = sorted((int(st), int(sz)) for sz, st in zip(t.shape, t.stride()) if int(sz) > 1)
    span = 1
    for st, sz in dims:
        if st < span:
            return False
        span = st * sz
    return True


def layout_of(t: torch.Tensor, *, with_offset: bool = False) -> Layout:
    off = sym_to_node(t.storage_offset()) if with_offset else const(0)
    return Layout(shape_of(t), tuple(sym_to_node(s) for s in t.stride()), off)


CONVOLUTIONS = (torch.ops.aten.convolution.default, torch.ops.aten.convolution_backward.default)

# CUDA attention kernels that read an additive bias, and the bias's argument position. They need
# every stride of it but the last to be a multiple of 8 elements ("attn_bias is not correctly
# aligned"); eager's scaled_dot_product_attention pads a mask for them, so a bias a kernel here
# computes is written into a buffer padded the same way (as Inductor's sdpa_constraint does).
ATTENTION_BIAS_ARG = {getattr(aten, name).default: (pos, arg) for name, pos, arg in (
    ("_scaled_dot_product_efficient_attention", 3, "attn_bias"),
    ("_scaled_dot_product_efficient_attention_backward", 4, "attn_bias"),
    ("_scaled_dot_product_cudnn_attention", 3, "attn_bias"),
    ("_scaled_dot_product_cudnn_attention_backward", 8, "attn_bias"),
    ("_efficient_attention_forward", 3, "bias"), ("_efficient_attention_backward", 4, "bias"))
    if hasattr(aten, name)}
ATTENTION_BIAS_ALIGNMENT = 8


def aligned_bias_layout(sizes: Sequence[Node], alignment: int = ATTENTION_BIAS_ALIGNMENT) -> Layout:
    """Row-major strides for an attention bias, every stride but the last rounded up to a
    multiple of `alignment` elements (the buffer is padded at the end of each row)."""
    strides: list[Node] = [const(1)] * len(sizes)
    acc: Node = const(1)
    for i in range(len(sizes) - 2, -1, -1):
        acc = acc * sizes[i + 1]
        if not (acc.op == "const" and acc.arg % alignment == 0):
            acc = (acc + (alignment - 1)) // alignment * alignment
        strides[i] = acc
    return Layout(tuple(sizes), tuple(strides))


def graph_device(values: Iterable[Any]) -> torch.device | None:
    """The device a graph computes on: its first tensor input's, passing over 0-d CPU tensors
    while a later input lives elsewhere (Dynamo passes an unspecialized float as one, see
    passes/host_scalars.py; a GPU graph taking it first is still a GPU graph)."""
    first = None
    for v in values:
        if isinstance(v, torch.Tensor):
            if first is None:
                first = v.device
            if not (v.device.type == "cpu" and v.ndim == 0):
                return v.device
    return first


def misaligned(layout: Layout, want: Layout, alignment: int = ATTENTION_BIAS_ALIGNMENT) -> bool:
    """Whether `layout` may break the attention kernels' rule: the last stride 1, every other
    stride and the offset multiples of `alignment` (a size-1 dim's stride does not matter).  A
    symbolic stride passes only when it is the aligned layout's own (`want`'s): a dense
    [B, 1, S, S] mask's S*S is aligned only for some S, and the kernels fail at run time on
    the others ("attn_bias is not correctly aligned"); a symbolic offset never passes."""
    *rows, (last_size, last_stride) = zip(layout.sizes, layout.strides)
    if last_stride != const(1) and last_size != const(1):
        return True
    if not (layout.offset.op == "const" and layout.offset.arg % alignment == 0):
        return True
    for (size, stride), wanted in zip(rows, want.strides):
        if size == const(1):
            continue
        if stride.op == "const" and stride.arg % alignment != 0 or stride.op != "const" and stride != wanted:
            return True
    return False


def channels_last_layout(shape: Sequence[Node]) -> Layout:
    """NHWC strides for an [N, C, H, W] value."""
    n, c, h, w = shape
    return Layout(tuple(shape), (h * w * c, const(1), w * c, c))


def channels_last_conv(node: fx.Node) -> bool:
    """A convolution whose output (and so whose input, for cuDNN and oneDNN) is channels-last."""
    if node.target not in CONVOLUTIONS:
        return False
    out = meta_val(node)
    out = out[0] if isinstance(out, (list, tuple)) else out
    return isinstance(out, torch.Tensor) and out.ndim == 4 and not out.is_contiguous() \
        and out.is_contiguous(memory_format=torch.channels_last)


