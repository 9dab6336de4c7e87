"""What the C++ kernel emitters (codegen.py, scatter.py) share: the C types that compute and
store each dtype, the conversion of a value to its buffer's storage type, and the loop nest."""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ...ir.nodes import Node

if TYPE_CHECKING:
    from .codegen import Emitter

CTYPE = {
    torch.float32: "float", torch.float64: "double", torch.float16: "float", torch.bfloat16: "float",
    torch.int64: "int64_t", torch.int32: "int32_t", torch.int16: "int16_t", torch.int8: "int8_t",
    torch.uint8: "uint8_t", torch.bool: "bool",
}
# bool tensors are stored through uint8_t pointers: g++ 12 does not vectorize a loop that loads
# or stores through a bool* next to wider types (a ReLU's saved mask stored with its output,
# threshold_backward's mask loaded with the gradient: "no vectype for stmt", 7x slower); the
# values are PyTorch's 0 / 1 bytes either way, and a load converts them back to bool
STORAGE = {**CTYPE, torch.float16: "uint16_t", torch.bfloat16: "uint16_t", torch.bool: "uint8_t"}


def _store_expr(buf_dtype: torch.dtype, value: str) -> str:
    if buf_dtype == torch.float16:
        return f"tf_float_to_half(static_cast<float>({value}))"
    if buf_dtype == torch.bfloat16:
        return f"tf_float_to_bf16(static_cast<float>({value}))"
    if buf_dtype == torch.bool:   # (normalized to 0 / 1 first: a uint8_t cast would keep 2, or drop 0.5)
        return f"static_cast<uint8_t>(static_cast<bool>({value}))"
    return f"static_cast<{STORAGE[buf_dtype]}>({value})"


def _emit_loops(em: Emitter, names: list[str], sizes: tuple[Node, ...], para: str | None, body, *,
                simd_last: bool = True, reduction_clause: str = "", short_inner: bool = False,
                pragma: str = "omp parallel for") -> None:
    """Nested loops; the outermost gets `omp parallel for` (collapsed), the innermost `omp simd`
    (with `short_inner`, the one around it: codegen.SHORT_INNER_LOOP)."""
    if not sizes:
        em.push()
        em.line("{")
        body()
        em.line("}")
        em.pop()
        return
    depth = len(sizes)
    simd_at = None
    if simd_last:
        simd_at = depth - 2 if short_inner and depth > 1 else depth - 1
    for j, (name, size) in enumerate(zip(names, sizes)):
        if j == 0 and para is not None:
            collapse = depth if simd_at is None else max(simd_at, 1)     # the loops outside the simd one
            clause = f" collapse({collapse})" if collapse > 1 else ""
            simd = " simd" if simd_at == 0 else ""
            em.line(f"#pragma {pragma}{simd}{clause}{reduction_clause}{em.check_clause} {para}")
        elif j == simd_at:
            em.hoist_checks()
            em.line(f"#pragma omp simd{reduction_clause}{em.check_clause}")
        em.line(f"for (int64_t {name} = 0; {name} < {em.index(size)}; ++{name}) {{")
        em.push()
        em.open_vars.append(name)
    body()
    for _ in sizes:
        em.pop()
        em.open_vars.pop()
        em.line("}")
