"""Lowerings of pointwise aten ops, casts and tensor constructors.

Every pointwise op loads its inputs with broadcasting, casts them to the computation dtype
(type promotion as in eager; fp16/bf16 computed in fp32), applies IR ops, and casts the result to
the output dtype that the fx node's fake tensor reports.
"""
from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Callable, Sequence

import torch
from torch._prims_common import ELEMENTWISE_TYPE_PROMOTION_KIND, elementwise_dtypes

from ..ir.buffers import ComputedValue, StridedValue, TensorValue, Unsupported
from .registry import register as _register
from ..ir.nodes import INDEX, Node, cast, const, op, where

if TYPE_CHECKING:
    from .graph import GraphLowering

aten = torch.ops.aten
prims = torch.ops.prims


def _complex(x: Any) -> bool:
    if isinstance(x, (TensorValue, torch.Tensor)):
        return x.dtype.is_complex
    if isinstance(x, (list, tuple)):
        return any(_complex(y) for y in x)
    return isinstance(x, complex)


def register(*targets: Any) -> Callable:
    """`lowering.register` for the op lowerings (pointwise, views, reductions): an op with a complex
    input or output runs through ATen instead, since the code generators have no complex types."""
    def deco(fn: Callable) -> Callable:
        def lower(lw: GraphLowering, *args: Any, **kwargs: Any) -> Any:
            if _complex(lw.out_meta()) or _complex(args) or _complex(list(kwargs.values())):
                raise Unsupported("complex dtypes")
            return fn(lw, *args, **kwargs)
        lower.__name__ = lower.__qualname__ = getattr(fn, "__name__", "lower")
        _register(*targets)(lower)
        return fn
    return deco

LOW_PRECISION = (torch.float16, torch.bfloat16)


def upcast(dtype: torch.dtype) -> torch.dtype:
    return torch.float32 if dtype in LOW_PRECISION else dtype


def bcast_load(x: Any, out_shape: Sequence[Node], idx: Sequence[Node], dtype: torch.dtype) -> Node:
    """Load `x` at `idx` of a tensor of `out_shape`, broadcasting size-1 and missing dims."""
    if isinstance(x, TensorValue):
        off = len(out_shape) - x.ndim
        sub = [const(0) if (s.op == "const" and s.arg == 1) else idx[off + k] for k, s in enumerate(x.shape)]
        return cast(x.load(sub), dtype)
    if isinstance(x, Node):
        return cast(x, dtype)
    if isinstance(x, complex):
        raise Unsupported("complex scalars")
    return const(x, dtype)


_META: dict[tuple[int, torch.dtype], torch.Tensor] = {}


def _dummy(x: Any) -> Any:
    if isinstance(x, TensorValue):
        # type promotion only sees dtype and whether it is 0-d; making a meta tensor costs ~0.2 ms
        key = (min(x.ndim, 1), x.dtype)
        if key not in _META:
            _META[key] = torch.empty([1] * key[0], dtype=x.dtype, device="meta")
        return _META[key]
    if isinstance(x, Node):
        return 1 if x.dtype == INDEX or not x.dtype.is_floating_point else 1.0
    return x


def promoted_dtype(args: Sequence[Any], kind: ELEMENTWISE_TYPE_PROMOTION_KIND = ELEMENTWISE_TYPE_PROMOTION_KIND.DEFAULT
                   ) -> torch.dtype:
    dummies = [_dummy(a) for a in args if a is not None]
    return elementwise_dtypes(*dummies, type_promotion_kind=kind)[1]


def pointwise(lw: GraphLowering, args: Sequence[Any], fn: Callable[..., Node], *,
              compute: torch.dtype | None = None) -> ComputedValue:
    """The lowering of any elementwise op: `fn` receives one scalar Node per argument."""
    out_shape, out_dtype = lw.out_shape(), lw.out_dtype()
    if out_dtype.is_complex or any(isinstance(a, TensorValue) and a.dtype.is_complex for a in args):
        raise Unsupported("complex dtypes")
    if compute is None:
        compute = promoted_dtype(args)
        if out_dtype.is_floating_point and not compute.is_floating_point:
            compute = out_dtype
        compute = upcast(compute)

    def body(idx: Sequence[Node]) -> Node:
        return cast(fn(*[bcast_load(a, out_shape, idx, compute) for a in args]), out_dtype)

    return ComputedValue(out_shape, out_dtype, body)


# --------------------------------------------------------------------------------------------
# unary math
# --------------------------------------------------------------------------------------------

FLOAT_UNARY = {
    aten.exp: "exp", aten.exp2: "exp2", aten.expm1: "expm1", aten.log: "log", aten.log2: "log2",
    aten.log10: "log10", aten.log1p: "log1p", aten.sqrt: "sqrt", aten.rsqrt: "rsqrt", aten.sin: "sin",
    aten.cos: "cos", aten.tan: "tan", aten.asin: "asin", aten.acos: "acos", aten.atan: "atan",
    aten.sinh: "sinh", aten.cosh: "cosh", aten.tanh: "tanh", aten.asinh: "asinh", aten.acosh: "acosh",
    aten.atanh: "atanh", aten.sigmoid: "sigmoid", aten.erf: "erf", aten.erfc: "erfc",
    aten.lgamma: "lgamma", aten.reciprocal: "reciprocal",
}
ROUNDING = {aten.ceil: "ceil", aten.floor: "floor", aten.round.default: "round", aten.trunc: "trunc",
            aten.frac: "frac"}


def _float_unary(name: str) -> Callable:
    def lower(lw: GraphLowering, x: Any) -> ComputedValue:
        return pointwise(lw, [x], lambda a: op(name, a, dtype=a.dtype), compute=upcast(lw.out_dtype()))
    return lower


for _target, _name in FLOAT_UNARY.items():
    register(_target.default)(_float_unary(_name))


def _rounding(name: str) -> Callable:
    def lower(lw: GraphLowering, x: Any) -> ComputedValue:
        if not x.dtype.is_floating_point:
            return pointwise(lw, [x], lambda a: a)       # integers are already whole
        return pointwise(lw, [x], lambda a: op(name, a, dtype=a.dtype))
    return lower


for _target, _name in ROUNDING.items():
    register(_target if isinstance(_target, torch._ops.OpOverload) else _target.default)(_rounding(_name))


@register(aten.neg.default)
def _neg(lw, x):
    return pointwise(lw, [x], lambda a: op("neg", a, dtype=a.dtype))


@register(aten.abs.default)
def _abs(lw, x):
    return pointwise(lw, [x], lambda a: op("abs", a, dtype=a.dtype))


@register(aten.sign.default, aten.sgn.default)
def _sign(lw, x):
    if x.dtype == torch.bool:
        return pointwise(lw, [x], lambda a: a)
    return pointwise(lw, [x], lambda a: op("sign", a, dtype=a.dtype))


@register(aten.signbit.default)
def _signbit(lw, x):
    return pointwise(lw, [x], lambda a: op("signbit", a, dtype=torch.bool), compute=upcast(x.dtype))


@register(aten.relu.default)
def _relu(lw, x):
    return pointwise(lw, [x], lambda a: op("relu", a, dtype=a.dtype))


@register(aten.square.default)
def _square(lw, x):
    return pointwise(lw, [x], lambda a: op("mul", a, a, dtype=a.dtype))


for _target, _name in ((aten.isnan, "isnan"), (aten.isinf, "isinf"), (aten.isfinite, "isfinite")):
    def _make(name: str) -> Callable:
        def lower(lw, x):
            if not x.dtype.is_floating_point:
                value = name == "isfinite"
                return pointwise(lw, [x], lambda a: const(value, torch.bool), compute=x.dtype)
            return pointwise(lw, [x], lambda a: op(name, a, dtype=torch.bool), compute=upcast(x.dtype))
        return lower
    register(_target.default)(_make(_name))


@register(aten.logical_not.default)
def _logical_not(lw, x):
    return pointwise(lw, [x], lambda a: op("not", a, dtype=torch.bool), compute=torch.bool)


@register(aten.bitwise_not.default)
def _bitwise_not(lw, x):
    if x.dtype == torch.bool:
        return pointwise(lw, [x], lambda a: op("not", a, dtype=torch.bool))
    return pointwise(lw, [x], lambda a: op("bitnot", a, dtype=a.dtype))


# --------------------------------------------------------------------------------------------
# binary math
# --------------------------------------------------------------------------------------------

# Ops for which eager first converts every operand (Python scalars and 0-d tensors included) to a
# fp16/bf16 common dtype, so a scalar like 0.1 is rounded before use: computing with the fp32 scalar
# instead flips comparisons (h == 0.1) and shifts remainders by up to the divisor.
ROUND_OPERANDS = {"eq", "ne", "lt", "le", "gt", "ge", "remainder", "fmod", "atan2"}


def _round_operand(x: Any, dtype: torch.dtype) -> Any:
    """`x` as eager sees it after conversion to the low-precision common `dtype`."""
    if isinstance(x, bool) or x is None:
        return x
    if isinstance(x, (int, float)):
        return float(torch.tensor(x, dtype=dtype))
    if isinstance(x, TensorValue) and x.dtype != dtype:
        return ComputedValue(x.shape, dtype, lambda idx: cast(x.load(idx), dtype))
    if isinstance(x, Node) and x.dtype != dtype:
        return cast(x, dtype)
    return x


def _binary(name: str, kind: ELEMENTWISE_TYPE_PROMOTION_KIND = ELEMENTWISE_TYPE_PROMOTION_KIND.DEFAULT) -> Callable:
    def lower(lw: GraphLowering, a: Any, b: Any) -> ComputedValue:
        promoted = promoted_dtype([a, b], kind)
        if promoted in LOW_PRECISION and name in ROUND_OPERANDS:
            a, b = _round_operand(a, promoted), _round_operand(b, promoted)
        compute = upcast(promoted)
        if name in ("add", "mul") and compute == torch.bool:
            bool_name = "or" if name == "add" else "and"
            return pointwise(lw, [a, b], lambda x, y: op(bool_name, x, y, dtype=torch.bool), compute=compute)
        out = lw.out_dtype()
        rtype = torch.bool if name in COMPARISONS else compute
        if out.is_floating_point and not compute.is_floating_point:
            compute = rtype = upcast(out)
        return pointwise(lw, [a, b], lambda x, y: op(name, x, y, dtype=rtype), compute=compute)
    return lower


COMPARISONS = {"eq", "ne", "lt", "le", "gt", "ge"}
BINARY = {
    aten.mul: "mul", aten.maximum: "maximum", aten.minimum: "minimum", aten.fmax: "fmax", aten.fmin: "fmin",
    aten.eq: "eq", aten.ne: "ne", aten.lt: "lt", aten.le: "le", aten.gt: "gt", aten.ge: "ge",
    aten.remainder: "remainder", aten.fmod: "fmod", aten.atan2: "atan2", aten.copysign: "copysign",
    aten.hypot: "hypot", aten.bitwise_and: "bitand", aten.bitwise_or: "bitor", aten.bitwise_xor: "bitxor",
    aten.bitwise_left_shift: "lshift", aten.bitwise_right_shift: "rshift", aten.floor_divide: "pyfloordiv",
    aten.nextafter: "nextafter",
}
for _target, _name in BINARY.items():
    register(_target)(_binary(_name))
for _target, _name in ((aten.logical_and, "and"), (aten.logical_or, "or"), (aten.logical_xor, "xor")):
    def _make_logical(name: str) -> Callable:
        def lower(lw, a, b):
            return pointwise(lw, [a, b], lambda x, y: op(name, op("ne", x, const(0, x.dtype), dtype=torch.bool),
                                                          op("ne", y, const(0, y.dtype), dtype=torch.bool),
                                                          dtype=torch.bool),
                             compute=upcast(promoted_dtype([a, b])))
        return lower
    register(_target.default)(_make_logical(_name))


@register(aten.__and__.Tensor, aten.__or__.Tensor, aten.__xor__.Tensor, aten.__lshift__, aten.__rshift__)
def _dunder_bitwise(lw, a, b):
    name = {"__and__": "bitand", "__or__": "bitor", "__xor__": "bitxor", "__lshift__": "lshift",
            "__rshift__": "rshift"}[lw.current.target._opname]
    return _binary(name)(lw, a, b)


def _scaled(b: Any, alpha: Any) -> Callable[[Node], Node]:
    return lambda y: y if alpha in (None, 1) else op("mul", y, const(alpha, y.dtype), dtype=y.dtype)


@register(aten.add.Tensor, aten.add.Scalar)
def _add(lw, a, b, *, alpha=None):
    compute = upcast(promoted_dtype([a, b]))
    if compute == torch.bool:
        return pointwise(lw, [a, b], lambda x, y: op("or", x, y, dtype=torch.bool), compute=compute)
    return pointwise(lw, [a, b], lambda x, y: op("add", x, _scaled(b, alpha)(y), dtype=x.dtype))


@register(aten.sub.Tensor, aten.sub.Scalar)
def _sub(lw, a, b, *, alpha=None):
    return pointwise(lw, [a, b], lambda x, y: op("sub", x, _scaled(b, alpha)(y), dtype=x.dtype))


@register(aten.rsub.Tensor, aten.rsub.Scalar)
def _rsub(lw, a, b, *, alpha=None):
    return pointwise(lw, [a, b], lambda x, y: op("sub", _scaled(a, alpha)(y), x, dtype=x.dtype))


@register(aten.div.Tensor, aten.div.Scalar, aten.true_divide.Tensor)
def _div(lw, a, b):
    return pointwise(lw, [a, b], lambda x, y: op("truediv", x, y, dtype=x.dtype))


@register(aten.div.Tensor_mode, aten.div.Scalar_mode)
def _div_mode(lw, a, b, *, rounding_mode=None):
    if rounding_mode is None:
        return _div(lw, a, b)
    compute = upcast(promoted_dtype([a, b]))
    out = lw.out_dtype()
    if rounding_mode == "trunc" and out in LOW_PRECISION:
        # eager rounds the fp16/bf16 quotient to its dtype before truncating it
        return pointwise(lw, [a, b], lambda x, y: op("trunc", cast(cast(op("truediv", x, y, dtype=x.dtype), out),
                                                                    x.dtype), dtype=x.dtype), compute=compute)
    name = "pyfloordiv" if rounding_mode == "floor" else "truncdiv"
    return pointwise(lw, [a, b], lambda x, y: op(name, x, y, dtype=x.dtype), compute=compute)


@register(aten.pow.Tensor_Tensor, aten.pow.Tensor_Scalar, aten.pow.Scalar)
def _pow(lw, a, b):
    if isinstance(b, (int, float)) and not isinstance(b, bool) and isinstance(a, TensorValue):
        if b == 2:
            return pointwise(lw, [a], lambda x: op("mul", x, x, dtype=x.dtype))
        if b == 1:
            return pointwise(lw, [a], lambda x: x)
        # the exponents eager's pow kernels special-case (pow_tensor_scalar_optimized_kernel), so
        # x**3 in GELU-tanh is two multiplies, not a libdevice pow (~50 instructions per element)
        if b == 3:
            return pointwise(lw, [a], lambda x: op("mul", op("mul", x, x, dtype=x.dtype), x, dtype=x.dtype))
        if lw.out_dtype().is_floating_point and b in (0.5, -0.5, -1, -2):
            name = {0.5: "sqrt", -0.5: "rsqrt", -1: "reciprocal"}.get(b)
            if name:
                return pointwise(lw, [a], lambda x: op(name, x, dtype=x.dtype), compute=upcast(lw.out_dtype()))
            return pointwise(lw, [a], lambda x: op("reciprocal", op("mul", x, x, dtype=x.dtype), dtype=x.dtype),
                             compute=upcast(lw.out_dtype()))
    compute = upcast(lw.out_dtype())
    return pointwise(lw, [a, b], lambda x, y: op("pow", x, y, dtype=x.dtype), compute=compute)


# --------------------------------------------------------------------------------------------
# selection and clamping
# --------------------------------------------------------------------------------------------

@register(aten.where.self, aten.where.ScalarSelf, aten.where.ScalarOther, aten.where.Scalar)
def _where(lw, cond, a, b):
    compute = upcast(lw.out_dtype())
    out_shape, out_dtype = lw.out_shape(), lw.out_dtype()

    def body(idx):
        c = bcast_load(cond, out_shape, idx, torch.bool)
        return cast(where(c, bcast_load(a, out_shape, idx, compute), bcast_load(b, out_shape, idx, compute)), out_dtype)
    return ComputedValue(out_shape, out_dtype, body)


@register(aten.masked_fill.Scalar, aten.masked_fill.Tensor)
def _masked_fill(lw, x, mask, value):
    return _where(lw, mask, value, x)


def _clamp_fn(lo: Any, hi: Any) -> Callable:
    def fn(x: Node, *bounds: Node) -> Node:
        it = iter(bounds)
        if lo is not None:
            x = op("clamp_min", x, next(it), dtype=x.dtype)
        if hi is not None:
            x = op("clamp_max", x, next(it), dtype=x.dtype)
        return x
    return fn


@register(aten.clamp.default, aten.clamp.Tensor)
def _clamp(lw, x, min=None, max=None):
    args = [x] + [b for b in (min, max) if b is not None]
    return pointwise(lw, args, _clamp_fn(min, max))


@register(aten.clamp_min.default, aten.clamp_min.Tensor)
def _clamp_min(lw, x, min):
    return _clamp(lw, x, min, None)


@register(aten.clamp_max.default, aten.clamp_max.Tensor)
def _clamp_max(lw, x, max):
    return _clamp(lw, x, None, max)


@register(aten.hardtanh.default)
def _hardtanh(lw, x, min_val=-1.0, max_val=1.0):
    return _clamp(lw, x, min_val, max_val)


@register(aten.threshold_backward.default)
def _threshold_backward(lw, grad, x, threshold):
    return pointwise(lw, [grad, x], lambda g, v: where(op("le", v, const(threshold, v.dtype), dtype=torch.bool),
                                                        const(0, g.dtype), g))


@register(aten.sigmoid_backward.default)
def _sigmoid_backward(lw, grad, y):
    return pointwise(lw, [grad, y], lambda g, s: op("mul", g, op("mul", s, op("sub", const(1.0, s.dtype), s, dtype=s.dtype),
                                                                   dtype=s.dtype), dtype=g.dtype))


@register(aten.tanh_backward.default)
def _tanh_backward(lw, grad, y):
    return pointwise(lw, [grad, y], lambda g, t: op("mul", g, op("sub", const(1.0, t.dtype), op("mul", t, t, dtype=t.dtype),
                                                                   dtype=t.dtype), dtype=g.dtype))


@register(aten.lerp.Scalar, aten.lerp.Tensor)
def _lerp(lw, a, b, w):
    return pointwise(lw, [a, b, w], lambda x, y, t: op("add", x, op("mul", t, op("sub", y, x, dtype=x.dtype),
                                                                      dtype=x.dtype), dtype=x.dtype))


# --------------------------------------------------------------------------------------------
# casts and copies
# --------------------------------------------------------------------------------------------

def _check_device(lw: GraphLowering, kwargs: dict, x: Any = None) -> None:
    device = kwargs.get("device")
    if device is None:
        return
    device = torch.device(device)
    if lw.device is not None and device != lw.device:
        raise Unsupported("copy to another device")
    # a graph input on another device (a host scalar moved to the GPU, passes/host_scalars.py):
    # a kernel cannot read it there, ATen copies it
    meta = lw.buffer_meta.get(x.buffer) if isinstance(x, StridedValue) else None
    if meta is not None and meta[3] is not None and torch.device(meta[3]) != device:
        raise Unsupported("copy from another device")


@register(aten._to_copy.default)
def _to_copy(lw, x, **kwargs):
    _check_device(lw, kwargs, x)
    if isinstance(x, TensorValue) and (x.dtype.is_complex or lw.out_dtype().is_complex):
        raise Unsupported("complex dtypes")
    return pointwise(lw, [x], lambda a: a, compute=x.dtype)


@register(prims.convert_element_type.default)
def _convert(lw, x, dtype):
    return pointwise(lw, [x], lambda a: a, compute=x.dtype)


@register(aten.clone.default, aten.lift_fresh_copy.default, aten.alias.default, aten.detach.default,
          aten.contiguous.default)
def _clone(lw, x, **kwargs):
    return pointwise(lw, [x], lambda a: a, compute=x.dtype)


@register(aten.copy.default)
def _copy(lw, dst, src, non_blocking=False):
    return pointwise(lw, [src], lambda a: a, compute=src.dtype if isinstance(src, TensorValue) else lw.out_dtype())


# --------------------------------------------------------------------------------------------
# constructors
# --------------------------------------------------------------------------------------------

def _fill(lw: GraphLowering, value: Any) -> ComputedValue:
    dtype = lw.out_dtype()
    if dtype.is_complex:
        raise Unsupported("complex dtypes")
    node = cast(value, dtype) if isinstance(value, Node) else const(value, dtype)
    return ComputedValue(lw.out_shape(), dtype, lambda idx: node)


@register(aten.full.default)
def _full(lw, size, fill_value, **kwargs):
    _check_device(lw, kwargs)
    return _fill(lw, fill_value)


@register(aten.full_like.default)
def _full_like(lw, x, fill_value, **kwargs):
    return _fill(lw, fill_value)


@register(aten.zeros.default, aten.zeros_like.default, aten.new_zeros.default, aten.empty.memory_format,
          aten.empty_like.default, aten.new_empty.default, aten.empty_strided.default, aten.new_empty_strided.default)
def _zeros(lw, *args, **kwargs):
    _check_device(lw, kwargs)
    return _fill(lw, 0)   # empty() may hold anything; zeros are a valid "anything" and deterministic


@register(aten.ones.default, aten.ones_like.default, aten.new_ones.default)
def _ones(lw, *args, **kwargs):
    return _fill(lw, 1)


@register(aten.new_full.default)
def _new_full(lw, x, size, fill_value, **kwargs):
    return _fill(lw, fill_value)


@register(aten.fill.Scalar, aten.fill.Tensor)
def _fill_op(lw, x, value):
    if isinstance(value, TensorValue):
        return pointwise(lw, [value], lambda a: a, compute=lw.out_dtype())
    return _fill(lw, value)


@register(aten.scalar_tensor.default)
def _scalar_tensor(lw, value, **kwargs):
    return _fill(lw, value)


@register(aten.arange.start_step, aten.arange.default, aten.arange.start)
def _arange(lw, *args, **kwargs):
    args = list(args)
    start, end, step = (0, args[0], 1) if len(args) == 1 else (args[0], args[1], args[2] if len(args) > 2 else 1)
    dtype = lw.out_dtype()
    compute = torch.float64 if dtype.is_floating_point else torch.int64

    def body(idx):
        i = cast(idx[0], compute)
        v = op("add", const(start, compute) if not isinstance(start, Node) else cast(start, compute),
               op("mul", i, const(step, compute) if not isinstance(step, Node) else cast(step, compute), dtype=compute),
               dtype=compute)
        return cast(v, dtype)
    return ComputedValue(lw.out_shape(), dtype, body)


@register(prims.iota.default)
def _iota(lw, length, *, start, step, dtype, device, requires_grad):
    return ComputedValue(lw.out_shape(), dtype,
                         lambda idx: cast(op("add", const(start), op("mul", idx[0], const(step), dtype=INDEX), dtype=INDEX)
                                          if not isinstance(start, Node) else idx[0] * step + start, dtype))


@register(aten._native_batch_norm_legit_no_training.default)
def _batch_norm_inference(lw, x, weight, bias, running_mean, running_var, momentum, eps):
    """(x - mean) * rsqrt(var + eps) * weight + bias with per-channel (dim 1) parameters."""
    out_shape = lw.out_shape(lw.current)  if False else tuple(x.shape)
    dtype = x.dtype
    compute = upcast(dtype)

    def channel(v: Any, idx: Sequence[Node]) -> Node | None:
        return None if v is None else cast(v.load([idx[1]]), compute)

    def body(idx):
        y = op("sub", cast(x.load(list(idx)), compute), channel(running_mean, idx), dtype=compute)
        inv = op("rsqrt", op("add", channel(running_var, idx), const(eps, compute), dtype=compute), dtype=compute)
        y = op("mul", y, inv, dtype=compute)
        if weight is not None:
            y = op("mul", y, channel(weight, idx), dtype=compute)
        if bias is not None:
            y = op("add", y, channel(bias, idx), dtype=compute)
        return cast(y, dtype)
    empty = ComputedValue((const(0),), dtype, lambda idx: const(0, dtype))
    return (ComputedValue(out_shape, dtype, body), empty, empty)


__all__ = ["pointwise", "bcast_load", "upcast", "promoted_dtype", "math"]


@register(prims.div.default)
def _prims_div(lw, a, b):
    compute = upcast(promoted_dtype([a, b]))
    name = "truediv" if compute.is_floating_point else "truncdiv"
    return pointwise(lw, [a, b], lambda x, y: op(name, x, y, dtype=x.dtype), compute=compute)


for _name in ("add", "sub", "mul", "maximum", "minimum", "eq", "ne", "lt", "le", "gt", "ge", "atan2", "fmod",
              "remainder", "pow"):
    register(getattr(prims, _name).default)(_binary(_name))
register(prims.hypot.default)(_binary("hypot"))
for _name in ("exp", "log", "sqrt", "rsqrt", "tanh", "sin", "cos", "erf", "log1p", "expm1"):
    register(getattr(prims, _name).default)(_float_unary(_name))
register(prims.neg.default)(_neg)
register(prims.abs.default)(_abs)
register(prims.where.default)(_where)
