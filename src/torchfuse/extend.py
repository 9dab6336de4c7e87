"""Extending torchfuse: your own graph passes, and custom operators that fuse.

    torchfuse.register_pass("fold_my_pattern", fn)      # fn(gm, ctx) -> number of changes
    torch.compile(model, backend="torchfuse", options={"passes": ["fold_my_pattern", *DEFAULT_PIPELINE]})
    options={"passes": [my_callable, MyPassBase(), "dce"]}   # callables and PassBase work unnamed

    torchfuse.register_decomposition(torch.ops.mylib.fast_gelu.default, fn)  # fn(*args) in aten ops
    torchfuse.register_lowering(torch.ops.mylib.fast_gelu.default, fn)       # fn(lw, *args) -> loop IR

A pass sees the aten graph after AOTAutograd (`ctx.inference` says whether it is an inference
graph) and must keep `node.meta["val"]` right on the nodes it creates.  One that raises, or leaves
a graph that does not lint, is reported by name in a warning and undone: compilation continues
from the graph as it was before it.

A custom operator (`torch.library.custom_op`) runs through ATen until torchfuse is told how to
fuse it.  A decomposition (aten ops, applied while AOTAutograd traces, so gradients follow) is
the simple way; a lowering writes the loop IR directly, with the helpers the built-in lowerings
use (`torchfuse.lowering.pointwise.pointwise`, `torchfuse.ir.nodes.op`): see the README.
Registrations are process-wide; register before compiling.
"""
from __future__ import annotations

from typing import Any, Callable

import torch

__all__ = ["register_pass", "register_decomposition", "register_lowering"]

_decompositions: dict[Any, Callable] = {}
_listeners: list[Callable[[Any], None]] = []


def register_pass(name: str, fn: Callable[[Any, Any], int]) -> None:
    """Make `fn(gm, ctx) -> changes` a graph pass usable by name in options={"passes": [...]}
    (the default pipeline is torchfuse.passes.DEFAULT_PIPELINE; ctx is a passes.PassContext)."""
    # (imported here, so that `import torchfuse` stays light)
    from .passes import _OWN, REGISTRY
    if not isinstance(name, str) or not name:
        raise ValueError(f"torchfuse: a pass name must be a non-empty string, not {name!r}")
    if REGISTRY.get(name) in _OWN:
        raise ValueError(f"torchfuse: {name!r} is a built-in pass; register yours under another name")
    if not callable(fn):
        raise TypeError(f"torchfuse: pass {name!r} must be callable as fn(gm, ctx) -> changes")
    REGISTRY[name] = fn


def register_decomposition(op: Any, fn: Callable) -> None:
    """Decompose `op` (an OpOverload, e.g. torch.ops.mylib.my_op.default) into aten ops with
    `fn(*args, **kwargs)` while torchfuse traces, so it fuses with its neighbours."""
    if not isinstance(op, torch._ops.OpOverload):
        raise TypeError(f"torchfuse: register_decomposition needs an OpOverload (e.g. torch.ops.ns.op.default), "
                        f"not {op!r}")
    _decompositions[op] = fn
    _forget(op)


def on_registration(listener: Callable[[Any], None]) -> None:
    """Call `listener(overload)` for every op overload a decomposition or lowering is registered
    for from now on (the lazy mode drops what it decided about the op before: not fusible)."""
    _listeners.append(listener)


def _forget(op: Any) -> None:
    for overload in ([getattr(op, n) for n in op.overloads()] if isinstance(op, torch._ops.OpOverloadPacket)
                     else [op]):
        for listener in _listeners:
            listener(overload)


def decompositions() -> dict[Any, Callable]:
    """The user's decompositions (frontend/decompositions.py merges them into its table)."""
    return dict(_decompositions)


def register_lowering(op: Any, fn: Callable) -> None:
    """Lower `op` straight to loop IR: `fn(lw, *args, **kwargs)` returns a value the way the
    built-in lowerings in torchfuse/lowering/ do (e.g. `pointwise(lw, [x], lambda a: ...)`)."""
    if not isinstance(op, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
        raise TypeError(f"torchfuse: register_lowering needs an OpOverload, not {op!r}")
    from .lowering.registry import register
    register(op)(fn)
    _forget(op)
