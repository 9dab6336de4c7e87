"""How dtypes, ops and constants are written in Triton: the compute and storage types, the
libdevice and core math functions, the infix operators, and typed literals (shared by the
emitters of codegen.py)."""
from __future__ import annotations

import math

import torch

TL = {
    torch.float32: "tl.float32", torch.float64: "tl.float64", torch.float16: "tl.float32",
    torch.bfloat16: "tl.float32", torch.int64: "tl.int64", torch.int32: "tl.int32", torch.int16: "tl.int16",
    torch.int8: "tl.int8", torch.uint8: "tl.uint8", torch.bool: "tl.int1",
}
STORE_TL = {**TL, torch.float16: "tl.float16", torch.bfloat16: "tl.bfloat16"}


def to_storage(value: str, dtype: torch.dtype) -> str:
    """`value` (computed in TL[dtype]) converted to the dtype a buffer stores.  bfloat16 goes
    through `_to_bf16`: the GPU's conversion rounds to nearest even, the interpreter's truncates
    (a bf16 model's error doubles), so the interpreter's header rounds first
    (module.HEADER_INTERPRETER)."""
    if dtype == torch.bfloat16:
        return f"_to_bf16({value})"
    return f"{value}.to({STORE_TL[dtype]})"


INTERPRETER_LIBDEVICE = {"tanh", "expm1", "log1p", "trunc", "nearbyint", "fmod", "pow"}


_LIBDEVICE = {
    "expm1": "libdevice.expm1",
    "log1p": "libdevice.log1p", "tan": "libdevice.tan", "asin": "libdevice.asin", "acos": "libdevice.acos",
    "atan": "libdevice.atan", "sinh": "libdevice.sinh", "cosh": "libdevice.cosh", "tanh": "libdevice.tanh",
    "asinh": "libdevice.asinh", "acosh": "libdevice.acosh", "atanh": "libdevice.atanh",
    "lgamma": "libdevice.lgamma", "round": "libdevice.nearbyint", "trunc": "libdevice.trunc",
    "signbit": "libdevice.signbit", "atan2": "libdevice.atan2", "copysign": "libdevice.copysign",
    "hypot": "libdevice.hypot", "nextafter": "libdevice.nextafter",
    "fmod": "libdevice.fmod",
}
_CORE = {"exp": "tl.exp", "exp2": "tl.exp2", "log2": "tl.log2", "log": "tl.log", "sqrt": "tl.sqrt", "sin": "tl.sin", "cos": "tl.cos", "erf": "tl.erf",
         "floor": "tl.floor", "ceil": "tl.ceil", "sigmoid": "tl.sigmoid", "rsqrt": "tl.rsqrt"}
_INFIX = {"add": "+", "sub": "-", "mul": "*", "truediv": "/", "eq": "==", "ne": "!=", "lt": "<", "le": "<=",
          "gt": ">", "ge": ">=", "and": "&", "or": "|", "xor": "^", "bitand": "&", "bitor": "|", "bitxor": "^",
          "lshift": "<<", "rshift": ">>"}


# A NaN constexpr global breaks Triton's "global changed since compile" check (nan != nan), so
# NaN is made at run time from the inf literal 1e999.
NAN_EXPR = "(tl.full([1], 1e999, tl.float32) - tl.full([1], 1e999, tl.float32))"


def literal(value, dtype: torch.dtype) -> str:
    """`value` as a one-element tensor of `dtype`'s compute type: it has `.to()`, broadcasts
    against any block and gives a select, a min/max or a comparison its dtype.  Python ints
    beyond int32 are fine (`tl.full` converts to the given dtype).  Not a 0-d tensor
    (`tl.full([], ...)`): Triton's interpreter fails `|` of a 0-d comparison with a block."""
    if dtype == torch.bool:
        return f"tl.full([1], {1 if value else 0}, tl.int1)"
    if dtype.is_floating_point:
        if math.isnan(value):
            return NAN_EXPR
        if math.isinf(value):
            v = "1e999" if value > 0 else "-1e999"
        else:
            v = repr(float(value))
        return f"tl.full([1], {v}, {TL[dtype]})"
    info = torch.iinfo(dtype)
    # wrapped into the dtype's range, as ATen casts a Python int (int32 x > 2**40 compares
    # with 0), where tl.full raises on an int out of range
    v = (int(value) - info.min) % (1 << info.bits) + info.min
    return f"tl.full([1], {v}, {TL[dtype]})"
