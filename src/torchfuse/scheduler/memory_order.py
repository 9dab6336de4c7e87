"""Wrapper steps moved later where that lowers peak memory and lengthens no other lifetime.

A step computed long before anything reads it holds its outputs across everything in between:
a bottleneck block whose forward computes the downsample branch first keeps that result alive
through the three convolutions of the main branch (and their cuDNN workspaces).  `sink_steps`
moves such a step to just after the last other reader of its inputs: they are alive there
anyway, so no lifetime grows (an input's last reader moves by one step at most), while its own
outputs now start later.  In the buffer-size model the peak can only fall.

Only steps without side effects move (kernels, ATen calls that return fresh tensors and draw no
random numbers), never across a step that has them (input mutations, in-place ATen ops, random
ops: their order is observable), never past the first reader of an output.
"""
from __future__ import annotations

import functools
import logging
from typing import Any, Callable

import torch

from ..ir.buffers import AliasView, BufferRef, FallbackCall
from .fusion import Kernel

log = logging.getLogger("torchfuse")


def _pure(item: Any) -> bool:
    """May this step run at another time without anyone noticing (besides memory)?"""
    if isinstance(item, AliasView):
        return True
    if isinstance(item, Kernel):
        # (a scatter into a graph input writes the caller's tensor: ordered like a mutation)
        scatter = item.scatter
        return not item.bindings and not (scatter is not None and scatter.into.startswith("in"))
    if isinstance(item, FallbackCall):
        if item.binds or item.target == "get_attr" or not returns_fresh(item.target):
            return False
        # ATen's own ops only: a custom or collective op may be ordered for reasons its schema
        # does not say (communication overlap, a side channel)
        if getattr(item.target, "namespace", None) not in ("aten", "prims"):
            return False
        return torch.Tag.nondeterministic_seeded not in getattr(item.target, "tags", ())
    return False


def _defines(item: Any) -> set[str]:
    if isinstance(item, Kernel):
        return {m.buffer.name for m in item.members}
    if isinstance(item, AliasView):
        return {item.name}
    if isinstance(item, FallbackCall):
        return {o for o in item.outputs if o is not None}
    return set()


def sink_steps(items: list, kernel_args: dict[str, tuple[list[str], list[str]]],
               nbytes: Callable[[str], int | None], graph_name: str = "", horizon: int = 256) -> list:
    """`items` in an order that starts each movable step as late as its inputs allow.
    `nbytes(buffer)`: its size, None when symbolic.  An input a quarter of the step's outputs'
    size or less (a convolution's weight) may have its lifetime lengthened: that costs less
    than the outputs' later start saves."""
    order = list(items)
    refs = {id(it): set(step_refs(it, kernel_args)) for it in order}
    defs = {id(it): _defines(it) for it in order}
    pure = {id(it): _pure(it) for it in order}    # asked up to `horizon` times per step
    moved = 0
    # Steps are visited last to first and only move later, so a step's position when visited
    # is its original one.  The scan looks `horizon` steps ahead (compile time stays linear).
    for p in range(len(items) - 1, -1, -1):
        item = items[p]
        if not (isinstance(item, (Kernel, FallbackCall)) and pure[id(item)]):     # an alias view stays
            continue
        outs, ins = defs[id(item)], refs[id(item)] - defs[id(item)]
        out_bytes = [nbytes(o) for o in outs]
        if not outs or None in out_bytes:
            continue
        small = sum(out_bytes) // 4
        ins = {b for b in ins if (nbytes(b) is None or nbytes(b) > small)}
        # the latest position it may take: before the first reader of an output and before the
        # next step with side effects, and no later than the last other reader of each input
        limit = min(len(order) - 1, p + horizon)
        last_reader = {b: p for b in ins}
        for q in range(p + 1, limit + 1):
            other = order[q]
            if refs[id(other)] & outs or not pure[id(other)]:
                limit = q - 1
                break
            for b in refs[id(other)] & ins:
                last_reader[b] = q
        target = min([limit] + list(last_reader.values()))
        if target > p:
            order.insert(target, order.pop(p))
            moved += 1
    if moved:
        log.debug("%s: %d step(s) moved later to start their outputs' lifetimes later", graph_name, moved)
    return order


def step_refs(item: Any, kernel_args: dict[str, tuple[list[str], list[str]]]) -> list[str]:
    """The buffers a wrapper step names: a kernel's arguments, a view's base, the tensors an ATen
    call is given."""
    if isinstance(item, Kernel):
        return kernel_args[item.name][0]
    if isinstance(item, AliasView):
        return [item.base, *item.after]
    refs: list[str] = []
    if isinstance(item, FallbackCall):
        _buffer_refs((item.args, list(item.kwargs.values())), refs)
    return refs


def _buffer_refs(a: Any, out: list[str]) -> None:
    if isinstance(a, BufferRef):
        out.append(a.buffer)
    elif isinstance(a, (list, tuple)):
        for x in a:
            _buffer_refs(x, out)


@functools.lru_cache(maxsize=None)
def returns_fresh(op: Any) -> bool:
    """Does an ATen op return new tensors (no result may share an argument's storage)?"""
    schema = getattr(op, "_schema", None)
    return schema is not None and not schema.is_mutable and all(r.alias_info is None for r in schema.returns)
