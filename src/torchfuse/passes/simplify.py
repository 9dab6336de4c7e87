"""Algebraic simplification as a list of small rewrite rules run by one driver to a fixpoint.

A rule is a function `(node) -> replacement | None`.  A replacement is either an existing node
whose value equals `node`'s, or a `New(target, args, kwargs)` node to build in its place.  Rules
only match; the driver enforces, for every rule alike, what makes a rewrite exact:

  * the replacement has exactly `node`'s shape, strides, storage offset, dtype and device
    (`same_meta`), so type promotion (int x * 1.0 is float), broadcasting (x * ones(4, 1) is
    bigger than x) and layout (x * 1 is contiguous when x is expanded) all veto a rewrite;
  * no new aliasing becomes visible: an output never becomes an input, a constant, (a view of)
    either, or another output (`can_forward`).

Rules are exact only where IEEE arithmetic makes them so; see the comment on each.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.fx as fx

from ._meta import const_value, create_node, is_neg_zero, same_meta, same_seq, val_of
from ._util import can_forward, is_impure
from .context import PassContext

aten, prims = torch.ops.aten, torch.ops.prims


@dataclass
class New:
    target: Any
    args: tuple
    kwargs: dict = field(default_factory=dict)


Rule = Callable[[fx.Node], "fx.Node | New | None"]


def _tensor(a: Any) -> torch.Tensor | None:
    v = val_of(a)
    return v if isinstance(v, torch.Tensor) else None


def _operands(node: fx.Node) -> list[tuple[Any, Any]]:
    """(x, c) for both orders of a commutative binary op."""
    if len(node.args) != 2:
        return []
    a, b = node.args
    return [(a, b), (b, a)]


def _alpha_is_one(node: fx.Node) -> bool:
    alpha = node.kwargs.get("alpha", 1)
    return type(alpha) in (int, bool, float) and alpha == 1


# ---- arithmetic identities --------------------------------------------------------------------
def mul_one(node: fx.Node) -> fx.Node | None:
    # x * 1 == x exactly for every real x, NaN, inf and -0.0 included.  Not for complex: the
    # 1 becomes 1+0j and inf * 0 = nan in the cross terms.
    if node.target not in (aten.mul.Tensor, aten.mul.Scalar):
        return None
    for x, c in _operands(node):
        t = _tensor(x)
        if t is not None and not t.is_complex() and const_value(c) == 1:
            return x
    return None


def add_zero(node: fx.Node) -> fx.Node | None:
    # x + 0 is NOT x for floats: -0.0 + 0.0 = +0.0.  It is exact for integers and bools, and
    # x + (-0.0) == x for every float x.  alpha must be 1 (alpha * 0 may be nan or -0.0).
    if node.target not in (aten.add.Tensor, aten.add.Scalar) or not _alpha_is_one(node):
        return None
    for x, c in _operands(node):
        t, v = _tensor(x), const_value(c)
        if t is None or t.is_complex() or v is None or v != 0:
            continue
        if not t.is_floating_point() or is_neg_zero(v):
            return x
    return None


def sub_zero(node: fx.Node) -> fx.Node | None:
    # x - (+0.0) == x + (-0.0) == x exactly, -0.0 included; x - (-0.0) is x + 0.0, which is not.
    if node.target not in (aten.sub.Tensor, aten.sub.Scalar) or len(node.args) != 2 or not _alpha_is_one(node):
        return None
    x, c = node.args[0], node.args[1]
    t, v = _tensor(x), const_value(c)
    if t is not None and not t.is_complex() and v is not None and v == 0 and not is_neg_zero(v):
        return x
    return None


def div_one(node: fx.Node) -> fx.Node | None:
    # IEEE division by 1 is exact.  Integer x / 1 is a float (true division): same_meta refuses.
    if node.target not in (aten.div.Tensor, aten.div.Scalar) or len(node.args) != 2:
        return None
    t = _tensor(node.args[0])
    if t is not None and not t.is_complex() and const_value(node.args[1]) == 1:
        return node.args[0]
    return None


def pow_one(node: fx.Node) -> fx.Node | None:
    # pow(x, 1) == x in C's pow for every x (nan included).
    if node.target not in (aten.pow.Tensor_Scalar, aten.pow.Tensor_Tensor) or len(node.args) != 2:
        return None
    t = _tensor(node.args[0])
    if t is not None and not t.is_complex() and const_value(node.args[1]) == 1:
        return node.args[0]
    return None


def neg_neg(node: fx.Node) -> fx.Node | None:
    # Negation flips a sign bit (floats) or wraps modulo 2**n (ints): applied twice it is exact.
    inner = node.args[0] if node.target is aten.neg.default else None
    if isinstance(inner, fx.Node) and inner.target is aten.neg.default:
        return inner.args[0]
    return None


# ---- casts -------------------------------------------------------------------------------------
def _cast_input(node: fx.Node) -> tuple[Any, torch.dtype] | None:
    """(input, dtype) if `node` only changes dtype (same device/layout/format), else None."""
    if node.op != "call_function":
        return None
    if node.target is prims.convert_element_type.default and len(node.args) == 2:
        return node.args[0], node.args[1]
    if node.target is not aten._to_copy.default or len(node.args) != 1:
        return None
    t, kw = _tensor(node.args[0]), node.kwargs
    if t is None or set(kw) - {"dtype", "layout", "device", "pin_memory", "non_blocking", "memory_format"}:
        return None
    if kw.get("layout") not in (None, torch.strided) or kw.get("pin_memory") not in (None, False):
        return None
    if kw.get("device") is not None and torch.device(kw["device"]) != t.device:
        return None
    if kw.get("memory_format") not in (None, torch.preserve_format):
        return None
    return node.args[0], kw.get("dtype") or t.dtype


def same_dtype_cast(node: fx.Node) -> fx.Node | None:
    # A cast to the dtype the value already has is a copy; same_meta checks the layout matches.
    c = _cast_input(node)
    t = _tensor(c[0]) if c else None
    return c[0] if t is not None and t.dtype == c[1] else None


_FLOAT_WIDENINGS = {(torch.float16, torch.float32), (torch.float16, torch.float64),
                    (torch.bfloat16, torch.float32), (torch.bfloat16, torch.float64),
                    (torch.float32, torch.float64)}
_MANTISSA_DIGITS = {torch.float16: 11, torch.bfloat16: 8, torch.float32: 24, torch.float64: 53}
_INT_TYPES = {torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64}


def widens_exactly(src: torch.dtype, mid: torch.dtype) -> bool:
    """Does src -> mid -> src give back every src value?  (Then the round trip is a no-op.)"""
    if src == torch.bool:
        return mid != torch.bool and not mid.is_complex  # 0/1 survive any real type and back
    if src.is_floating_point:
        return (src, mid) in _FLOAT_WIDENINGS  # f32->f16->f32 rounds: never in this set
    if src.is_complex or mid.is_complex or not (mid.is_floating_point or mid in _INT_TYPES):
        return False
    if src not in _INT_TYPES:
        return False
    lo, hi = torch.iinfo(src).min, torch.iinfo(src).max
    if mid.is_floating_point:  # every integer of src must be representable in mid
        digits = _MANTISSA_DIGITS.get(mid)
        return digits is not None and max(hi, -lo) <= 2 ** digits
    return torch.iinfo(mid).min <= lo and hi <= torch.iinfo(mid).max


def cast_round_trip(node: fx.Node) -> fx.Node | None:
    # x.to(wide).to(x.dtype) == x when `wide` holds every value of x's dtype exactly
    # (f16 -> f32 -> f16); NOT when it narrows (f32 -> f16 -> f32 rounds x to half precision).
    outer = _cast_input(node)
    inner = _cast_input(outer[0]) if outer and isinstance(outer[0], fx.Node) else None
    t = _tensor(inner[0]) if inner else None
    if t is None or outer[1] != t.dtype or not widens_exactly(t.dtype, inner[1]):
        return None
    return inner[0]


# ---- views -------------------------------------------------------------------------------------
# View ops that merely re-describe their input.  When the result has the input's exact sizes,
# strides and storage offset (same_meta), it addresses the same elements in the same order, so
# it IS the input: view/reshape/_unsafe_view to the same shape, identity permute/transpose,
# t() of a vector, expand to the same shape, a full slice, alias.  (Ops such as _conj or
# _neg_view keep the metadata but change the values, which is why this is an explicit list.)
_NOOP_VIEWS = {aten.view.default, aten.reshape.default, aten._unsafe_view.default,
               aten.expand.default, aten.permute.default, aten.transpose.int, aten.t.default,
               aten.alias.default, aten.slice.Tensor, aten.squeeze.dim, aten.squeeze.dims,
               aten.squeeze.default, aten.narrow.default}


def noop_view(node: fx.Node) -> fx.Node | None:
    x = node.args[0] if node.target in _NOOP_VIEWS else None
    return x if _tensor(x) is not None else None  # same_meta in the driver does the real check


_RESHAPES = {aten.view.default, aten.reshape.default, aten._unsafe_view.default}


def view_of_view(node: fx.Node) -> New | None:
    # view(view(x, s1), s2) -> view(x, s2).  Whether x itself can be viewed as s2 is decided by
    # building the node: fake execution raises, or same_meta refuses different strides.
    inner = node.args[0] if node.target in _RESHAPES else None
    if isinstance(inner, fx.Node) and inner.target in _RESHAPES:
        return New(node.target, (inner.args[0], *node.args[1:]), dict(node.kwargs))
    return None


def _contiguous(t: torch.Tensor) -> bool:
    """Row-major contiguity decided structurally (t.is_contiguous() may guard on symbols)."""
    expected: Any = 1
    for size, stride in reversed(list(zip(t.shape, t.stride()))):
        if not same_seq([size], [1]) and not same_seq([stride], [expected]):
            return False
        expected = expected * size
    return True


def clone_single_use(node: fx.Node) -> fx.Node | None:
    # clone(x) where x is an intermediate read by nothing else: the copy protects nobody.
    # Conservative: no memory_format request, x contiguous, x computed here (not an input).
    if node.target is not aten.clone.default or node.kwargs.get("memory_format") is not None:
        return None
    x = node.args[0]
    t = _tensor(x)
    if t is None or x.op != "call_function" or len(x.users) != 1 or not _contiguous(t):
        return None
    return x


RULES: list[Rule] = [mul_one, add_zero, sub_zero, div_one, pow_one, neg_neg, same_dtype_cast,
                     cast_round_trip, noop_view, view_of_view, clone_single_use]

_MAX_SWEEPS = 50  # every rule shrinks the graph or a view chain, so this is only a safety net


def _apply(graph: fx.Graph, node: fx.Node, rw: fx.Node | New) -> bool:
    if isinstance(rw, New):
        try:
            with graph.inserting_before(node):
                rw = create_node(graph, rw.target, rw.args, rw.kwargs, meta_from=node)
        except Exception:  # the op refused these inputs (e.g. a view that needs a copy)
            return False
        created = True
    else:
        created = False
    if rw is not node and same_meta(val_of(rw), val_of(node)) and can_forward(node, rw):
        node.replace_all_uses_with(rw)
        graph.erase_node(node)
        return True
    if created:
        graph.erase_node(rw)
    return False


def simplify(gm: fx.GraphModule, ctx: PassContext) -> int:
    """Apply RULES until none fires; return the number of rewrites."""
    graph, changes = gm.graph, 0
    for _ in range(_MAX_SWEEPS):
        before = changes
        # Nodes are visited producers first, so a rewrite usually enables the next one within
        # the same sweep; a rewrite erases only the node being visited, never a later one.
        for node in list(graph.nodes):
            if node.op != "call_function" or node.target is operator.getitem or is_impure(node):
                continue
            for rule in RULES:
                rw = rule(node)
                if rw is not None and _apply(graph, node, rw):
                    changes += 1
                    break
        if changes == before:
            break
    return changes
