"""Functional collectives in lowered graphs: which steps start one and which wait for one, and
the waits fusion holds back (see overlap.py for why and what is done with them).

A leaf module: fusion.py uses it, overlap.py builds on both."""
from __future__ import annotations

from typing import Any

from ..ir.buffers import AliasView, BufferRef, ComputedBuffer, FallbackCall
from ..ir.nodes import loads

_NAMESPACES = ("_c10d_functional", "_c10d_functional_autograd")


def op_name(target: Any) -> tuple[str | None, str]:
    schema = getattr(target, "_schema", None)
    if schema is None:
        return None, ""
    namespace, _, name = schema.name.partition("::")
    return namespace, name


def is_collective_op(target: Any) -> bool:
    """An op of torch.distributed's functional collectives (a start or a wait)."""
    return op_name(target)[0] in _NAMESPACES


def is_wait(item: Any) -> bool:
    """A `wait_tensor` step (of a functional collective's result)."""
    if not isinstance(item, FallbackCall):
        return False
    namespace, name = op_name(item.target)
    return namespace in _NAMESPACES and name == "wait_tensor"


def is_start(item: Any) -> bool:
    """A functional collective's start: a `_c10d_functional` op other than `wait_tensor`."""
    if not isinstance(item, FallbackCall):
        return False
    namespace, name = op_name(item.target)
    return namespace in _NAMESPACES and name != "wait_tensor"


def in_place(item: Any) -> bool:
    """A collective that writes its input (`all_reduce_`, `broadcast_`): functionalized graphs
    have none, and where one is, collectives keep their traced places (its input's readers
    before and after it could not be told apart)."""
    return is_start(item) and bool(getattr(getattr(item.target, "_schema", None), "is_mutable", False))


def collective_name(item: FallbackCall) -> str:
    return op_name(item.target)[1]


def step_reads(step: Any) -> set[str]:
    """The buffers a lowered step reads (before fusion: loads of a computed buffer, the tensors
    an ATen call is given, a view's base)."""
    if isinstance(step, ComputedBuffer):
        out = {ld.arg for ld in loads(step.body)}
        if step.scatter_index is not None:
            out |= {ld.arg for ld in loads(step.scatter_index)}
        if step.into is not None:
            out.add(step.into)
        return out
    if isinstance(step, AliasView):
        return {step.base, *step.after}
    return set(fallback_refs(step)) if isinstance(step, FallbackCall) else set()


class PendingWaits:
    """The waits fusion.schedule has not emitted yet, in program order."""

    def __init__(self) -> None:
        self.waits: list[FallbackCall] = []
        self.off = False

    def hold(self, step: Any) -> bool:
        """Keep `step` back if it is a wait (True)."""
        self.off = self.off or in_place(step)
        if is_wait(step) and not self.off:
            self.waits.append(step)
            return True
        return False

    def needed_by(self, step: Any) -> list[FallbackCall]:
        """The held waits whose results `step` reads (removed from those held)."""
        if not self.waits:
            return []
        reads = step_reads(step)
        needed = [w for w in self.waits if reads & {o for o in w.outputs if o}]
        if needed:
            self.waits = [w for w in self.waits if w not in needed]
        return needed

    def rest(self) -> list[FallbackCall]:
        out, self.waits = self.waits, []
        return out




def fallback_refs(item: FallbackCall) -> list[str]:
    """The buffers an ATen call is given."""
    out: list[str] = []

    def visit(a: Any) -> None:
        if isinstance(a, BufferRef):
            out.append(a.buffer)
        elif isinstance(a, (list, tuple)):
            for x in a:
                visit(x)
    visit((item.args, list(item.kwargs.values())))
    return out
