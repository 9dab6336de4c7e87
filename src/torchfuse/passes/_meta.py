"""Helpers shared by the graph passes: fake-tensor metadata and compile-time constant values."""
from __future__ import annotations

import math
from typing import Any, Iterable

import torch
import torch.fx as fx
from torch._guards import detect_fake_mode
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode, unset_fake_temporarily

from ._util import has_symbols, op_name  # noqa: F401  (has_symbols: passes import it from here)

aten = torch.ops.aten


# ---- fake tensors and metadata --------------------------------------------------------------
def fake_mode_of(graph: fx.Graph) -> FakeTensorMode:
    vals = [n.meta.get("val") for n in graph.nodes if n.op == "placeholder"]
    mode = detect_fake_mode(vals) or detect_fake_mode([n.meta.get("val") for n in graph.nodes])
    if mode is None:
        mode = graph.__dict__.setdefault("_torchfuse_fake_mode", FakeTensorMode(allow_non_fake_inputs=True))
    return mode


def _fake_arg(node: fx.Node, mode: FakeTensorMode) -> Any:
    val = node.meta.get("val")
    if val is None and node.op == "get_attr":
        val = getattr(node.graph.owning_module, node.target)
    if isinstance(val, torch.Tensor) and not isinstance(val, FakeTensor):
        with unset_fake_temporarily():
            val = mode.from_tensor(val, static_shapes=True)
    return val


def create_node(graph: fx.Graph, target: Any, args: tuple, kwargs: dict | None = None,
                meta_from: fx.Node | None = None) -> fx.Node:
    """Insert `target(*args, **kwargs)` at the current insertion point with its meta["val"]
    computed by running the op on the inputs' fake values.  Raises if the op raises."""
    kwargs = kwargs or {}
    mode = fake_mode_of(graph)
    fargs, fkwargs = fx.node.map_arg((args, kwargs), lambda n: _fake_arg(n, mode))
    with mode:
        val = target(*fargs, **fkwargs)
    node = graph.call_function(target, args, kwargs)
    if meta_from is not None:  # keep provenance (stack traces, module paths) for debug output
        node.meta.update({k: v for k, v in meta_from.meta.items() if k not in ("val", "tensor_meta")})
    node.meta["val"] = val
    return node


def sym_eq(a: Any, b: Any) -> bool:
    """Structural equality of ints/SymInts that never installs a guard."""
    ea = a.node.expr if isinstance(a, torch.SymInt) else a
    eb = b.node.expr if isinstance(b, torch.SymInt) else b
    try:
        return bool(ea == eb)  # sympy `==` is structural, not a guard
    except Exception:
        return False


def same_seq(a: Iterable[Any], b: Iterable[Any]) -> bool:
    a, b = list(a), list(b)
    return len(a) == len(b) and all(sym_eq(x, y) for x, y in zip(a, b))


def same_meta(a: Any, b: Any) -> bool:
    """Same shape, strides, storage offset, dtype and device: one can stand in for the other
    without invalidating the metadata recorded on any downstream node."""
    if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
        return False
    return (a.dtype == b.dtype and a.device == b.device and a.layout == b.layout == torch.strided
            and same_seq(a.shape, b.shape) and same_seq(a.stride(), b.stride())
            and sym_eq(a.storage_offset(), b.storage_offset()))


def val_of(node: Any) -> Any:
    return node.meta.get("val") if isinstance(node, fx.Node) else None


def size_hint(x: Any) -> int:
    """A size's value for a heuristic, without installing a guard on it (int() on a SymInt
    would, and so recompile the graph for every new size)."""
    if isinstance(x, torch.SymInt):
        return x.node.hint if x.node.hint is not None else 1
    return int(x)


# ---- constants ------------------------------------------------------------------------------
_FILL_ARG = {  # constructor -> index of its fill value (None: the value is implied)
    aten.full.default: 1, aten.full_like.default: 1, aten.new_full.default: 2,
    aten.scalar_tensor.default: 0, aten.ones.default: None, aten.ones_like.default: None,
    aten.new_ones.default: None, aten.zeros.default: None, aten.zeros_like.default: None,
    aten.new_zeros.default: None,
}


def const_value(a: Any) -> bool | int | float | None:
    """The single value of a Python scalar or of a tensor all of whose elements are equal and known
    at compile time, as stored in its dtype (so full(..., 0.7, dtype=int64) reads 0 and a
    -0.0 keeps its sign).  None when unknown or complex."""
    if isinstance(a, (bool, int, float)):
        return a
    if not isinstance(a, fx.Node):
        return None
    val = val_of(a)
    if not isinstance(val, torch.Tensor) or val.is_complex():
        return None
    with unset_fake_temporarily():
        if a.op == "call_function" and a.target in _FILL_ARG:
            i = _FILL_ARG[a.target]
            name = op_name(a.target)
            v = (1 if "ones" in name else 0) if i is None else (a.args[i] if i < len(a.args) else None)
            if not isinstance(v, (bool, int, float)):
                return None
            try:
                return torch.tensor(v, dtype=val.dtype).item()
            except (RuntimeError, OverflowError, TypeError):  # e.g. -1 as uint8
                return None
        if a.op == "get_attr":
            t = getattr(a.graph.owning_module, a.target, None)
            if not isinstance(t, torch.Tensor) or isinstance(t, FakeTensor) or not 0 < t.numel() <= 1024:
                return None
            t = t.detach().cpu().reshape(-1)
            first = t[0]
            if not bool((t == first).all()):
                return None
            if t.is_floating_point() and not bool((t.signbit() == first.signbit()).all()):
                return None
            return first.item()
    return None


def is_neg_zero(v: Any) -> bool:
    return isinstance(v, float) and v == 0.0 and math.copysign(1.0, v) < 0
