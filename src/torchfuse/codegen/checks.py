"""Run-time checks that generated kernels make on values eager PyTorch rejects.

Two kinds of site, shared by the C++ and Triton generators:
- `check_index(i, size, negative)` nodes (ir/lower_views.py: gather, index_select, embedding,
  advanced indexing): the index, wrapped once if negative (advanced indexing only: `negative`),
  must lie in [0, size); a kernel never loads past a tensor
  (an out-of-range index is replaced by 0) and the wrapper raises eager's error after the kernel.
- integer `//`, `%`, `fmod` and truncating division by a divisor that may be 0: eager raises
  ZeroDivisionError.

A check is dropped where the value is known in range: an index computed from loop positions
(arange), clamped, or constant; a constant non-zero divisor.
"""
from __future__ import annotations

from typing import Iterable, Mapping

import torch

from ..ir.nodes import INDEX, Node, _int_interval, _nonneg, _provably_below, const, op, where

INT_DIVISIONS = frozenset({"pyfloordiv", "remainder", "fmod", "truncdiv"})


def _interval(n: Node, ranges: Mapping[str, Node]) -> tuple[int, int] | None:
    """Bounds of an integer expression over the loop ranges, or None when unknown."""
    if n.op == "cast" and not n.args[0].dtype.is_floating_point and n.args[0].dtype != torch.bool:
        return _interval(n.args[0], ranges)
    if n.op == "where":
        a, b = _interval(n.args[1], ranges), _interval(n.args[2], ranges)
        return (min(a[0], b[0]), max(a[1], b[1])) if a and b else None
    if n.op in ("maximum", "clamp_min", "minimum", "clamp_max"):
        a, b = _interval(n.args[0], ranges), _interval(n.args[1], ranges)
        if not a or not b:
            return None
        pick = max if n.op in ("maximum", "clamp_min") else min
        return pick(a[0], b[0]), pick(a[1], b[1])
    if n.op in ("const", "var", "mod", "floordiv", "add", "mul") and n.dtype == INDEX:
        return _int_interval(n, ranges)
    return None


def unchecked_index(n: Node, ranges: Mapping[str, Node] | None = None) -> Node:
    """A check_index node's index, wrapped, without the check (for an index known in range);
    with `ranges`, no wrap where the index is known non-negative (or negative)."""
    i, size, _ = n.args
    iv = _interval(i, ranges) if ranges is not None else None
    if iv is not None and iv[0] >= 0:
        return i
    if iv is not None and iv[1] < 0:
        return op("add", i, size, dtype=INDEX)
    return where(op("lt", i, const(0), dtype=torch.bool), op("add", i, size, dtype=INDEX), i)


def _index_in_range(n: Node, ranges: Mapping[str, Node]) -> bool:
    i, size, negative = n.args
    if i.dtype == INDEX and i.op in ("var", "add", "mul", "mod", "floordiv", "const") and _nonneg(i, ranges) \
            and _provably_below(i, size, ranges):
        return True
    iv = _interval(i, ranges)
    if iv is None or size.op != "const":
        return False
    return (-size.arg if negative.arg else 0) <= iv[0] and iv[1] < size.arg


def _divisor_safe(n: Node, ranges: Mapping[str, Node]) -> bool:
    iv = _interval(n.args[1], ranges)
    return iv is not None and (iv[0] > 0 or iv[1] < 0)


def check_sites(nodes: Iterable[Node], ranges: Mapping[str, Node],
                enabled: bool = True) -> list[tuple[Node, tuple[str, str]]]:
    """The checks a kernel makes at run time, in a fixed order: (node, (kind, what)) with kind
    "index" (what: the op and dim) or "div" (what: the op).  None unless `enabled`
    (Config.runtime_checks)."""
    out: list[tuple[Node, tuple[str, str]]] = []
    if not enabled:
        return out
    seen: set[Node] = set()
    for n in nodes:
        if n in seen:
            continue
        seen.add(n)
        if n.op == "check_index" and not _index_in_range(n, ranges):
            out.append((n, ("index", n.arg)))
        elif n.op in INT_DIVISIONS and not n.dtype.is_floating_point and n.dtype != torch.bool \
                and not n.dtype.is_complex and not _divisor_safe(n, ranges):
            out.append((n, ("div", n.op)))
    return out
