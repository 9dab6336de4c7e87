"""Functional collectives scheduled around compute: starts early, waits late.

Under torch.compile, DTensor tensor parallelism and FSDP2 put torch.distributed's functional
collectives into the aten graphs (`_c10d_functional.all_gather_into_tensor`,
`reduce_scatter_tensor`, `all_reduce`, ...), each followed by a `wait_tensor` of its result.
Both run through ATen.  The start issues the communication and returns a tensor that is not
ready; the wait blocks until it is (on GPU: makes the compute stream wait for NCCL's; on CPU:
joins gloo's thread).  Whatever runs between the two, and does not read the result, overlaps
with the communication; Dynamo traces each wait right after its start, which overlaps nothing.
So, as Inductor does (torch/_inductor/comms.py: raise_comms, sink_waits,
reorder_compute_and_comm_for_overlap):

- fusion.schedule holds each wait back until a step reads its result and emits it right
  before the kernel holding that reader (collectives.PendingWaits): a wait never splits a fusion group,
  and kernels that do not read its result run before it.
- `overlap_collectives` (on the wrapper's steps) moves each start, with the steps computing
  its inputs, ahead of the steps between the previous start and it that it does not need (a
  backward's weight gradients then run while the input gradient is reduced); then the work
  after each wait that does not depend on its result, up to the next start, before it; then
  each wait to just before the first step that reads its result.
- Starts keep their order among themselves: every rank must issue a group's collectives in
  the same order.  Nothing moves across a step with side effects (a random op, an in-place
  update, a call that binds sizes), except waits, which only block.
- The wrapper keeps a start's inputs alive, and their storage out of in-place reuse, until its
  wait (`inputs_until_wait`): the communication reads them until then.
"""
from __future__ import annotations

import logging
from typing import Any, Iterable

from ..ir.buffers import AliasView, FallbackCall
from .collectives import collective_name, in_place, is_start, is_wait, op_name
from .fusion import Kernel
from .memory_order import _pure, step_refs

log = logging.getLogger("torchfuse")


def _writes(item: Any, slices: dict[str, tuple[str, Any]]) -> set[str]:
    if isinstance(item, Kernel):
        out = {m.buffer.name for m in item.members}
        out |= {m.buffer.into for m in item.members if m.buffer.into is not None}
        out |= {slices[m.buffer.name][0] for m in item.members if m.buffer.name in slices}
        return out
    if isinstance(item, AliasView):
        return {item.name}
    if isinstance(item, FallbackCall):
        return {o for o in item.outputs if o is not None}
    return set()


def _barrier(item: Any) -> bool:
    """A step nothing may move across (besides waits): one with side effects, or one that
    writes storage others read (an in-place kernel), or binds sizes."""
    if is_wait(item) or is_start(item):
        return False
    if isinstance(item, Kernel) and any(m.buffer.into is not None for m in item.members):
        return True
    return not _pure(item)


def overlap_collectives(items: list, kernel_args: dict[str, tuple[list[str], list[str]]],
                        slices: dict[str, tuple[str, Any]], graph_name: str = "") -> list:
    """`items` (the wrapper's steps) with each collective's start as early as its inputs allow
    and each wait as late as its readers allow (see the module's docstring)."""
    if not any(is_start(it) for it in items) or any(in_place(it) for it in items):
        return list(items)
    reads = {id(it): set(step_refs(it, kernel_args)) for it in items}
    writes = {id(it): _writes(it, slices) for it in items}
    order = list(items)
    lo = 0              # the segment a start may move within begins here
    raised = 0
    for i in range(len(order)):
        item = order[i]
        if _barrier(item):
            lo = i + 1
            continue
        if not is_start(item):
            continue
        need = set(reads[id(item)])
        ancestors: list = []
        others: list = []
        for other in reversed(order[lo:i]):
            if writes[id(other)] & need:
                ancestors.append(other)
                need |= reads[id(other)]
            else:
                others.append(other)
        if others and any(order[k] is not it for k, it in enumerate(reversed(ancestors), start=lo)):
            raised += 1
        order[lo:i + 1] = ancestors[::-1] + [item] + others[::-1]
        # The next start moves within the steps after these (starts keep their order, and the
        # steps this one overlaps stay with it: pushed past every later start too, all of them
        # would pile up after the last collective, each earlier one overlapping nothing, and
        # the activations they read would live to the end)
        lo = i + 1
    # Work after a wait that does not depend on its result runs before it: up to the next start
    # (which it would delay) or barrier.  (Lowering realizes a value where it is first read, so
    # independent work often comes after the collective's reader in the steps.)
    hoisted = 0
    for wait in [it for it in order if is_wait(it)]:
        p = next(k for k, it in enumerate(order) if it is wait)
        end = next((k for k in range(p + 1, len(order)) if is_start(order[k]) or _barrier(order[k])), len(order))
        deps = writes[id(wait)] | reads[id(wait)]
        before, after = [], []
        for other in order[p + 1:end]:
            if reads[id(other)] & deps:
                after.append(other)
                deps |= writes[id(other)]
            else:
                before.append(other)
        if before and after:
            hoisted += 1
        order[p:end] = before + [wait] + after
    sunk = 0
    for wait in [it for it in order if is_wait(it)][::-1]:
        p = next(k for k, it in enumerate(order) if it is wait)
        result = writes[id(wait)] | reads[id(wait)]       # (the start's result is the same tensor)
        q = next((k for k in range(p + 1, len(order)) if reads[id(order[k])] & result), len(order))
        if q - 1 > p:
            order.insert(q - 1, order.pop(p))
            sunk += 1
    if raised or hoisted or sunk:
        log.debug("%s: %d collective start(s) raised, %d wait(s) after independent work, %d wait(s) sunk",
                  graph_name, raised, hoisted, sunk)
    return order


def inputs_until_wait(items: list) -> dict[int, list[str]]:
    """{position of a wait: the buffers its collective's start read}: they must stay alive and
    unwritten until the wait (the communication may read them until then)."""
    started: dict[str, list[str]] = {}
    out: dict[int, list[str]] = {}
    for pos, item in enumerate(items):
        if is_start(item):
            ins = step_refs(item, {})
            for o in item.outputs:
                if o is not None:
                    started[o] = ins
        elif is_wait(item):
            for b in step_refs(item, {}):
                if b in started:
                    out.setdefault(pos, []).extend(started[b])
    return out


def describe(graph_name: str, items: list) -> list[str]:
    """One line per collective for explain(): where it starts and waits in the wrapper, and what
    runs in between (what overlaps with the communication)."""
    def label(item: Any) -> str:
        if isinstance(item, Kernel):
            return item.name
        if isinstance(item, FallbackCall):
            return op_name(item.target)[1] or str(item.target)
        return "view"

    steps = [it for it in items if not isinstance(it, AliasView)]
    lines: list[str] = []
    for p, item in enumerate(steps):
        if not is_start(item):
            continue
        results = {o for o in item.outputs if o is not None}
        w = next((k for k in range(p + 1, len(steps)) if is_wait(steps[k])
                  and set(step_refs(steps[k], {})) & results), None)
        after = f"after {label(steps[p - 1])}" if p > 0 else "first"
        if w is None:
            lines.append(f"{graph_name}: {collective_name(item)} -> {', '.join(sorted(results))} starts at step {p} "
                         f"({after}); its wait is not in this graph")
            continue
        before = f"before {label(steps[w + 1])}" if w + 1 < len(steps) else "at the end"
        between = steps[p + 1:w]
        kernels = sum(isinstance(s, Kernel) for s in between)
        aten = [label(s) for s in between if isinstance(s, FallbackCall) and not is_wait(s) and not is_start(s)]
        comms = sum(is_start(s) for s in between)
        meanwhile = f"{kernels} kernel(s), {len(aten)} ATen call(s)" + (f" ({', '.join(_counted(aten))})" if aten else "")
        if comms:
            meanwhile += f", {comms} other collective start(s)"
        lines.append(f"{graph_name}: {collective_name(item)} -> {', '.join(sorted(results))} starts at step {p} "
                     f"({after}), waits at step {w} ({before}); meanwhile {meanwhile}")
    return lines


def _counted(names: Iterable[str]) -> list[str]:
    counts: dict[str, int] = {}
    for n in names:
        counts[n] = counts.get(n, 0) + 1
    return [f"{n} x{c}" if c > 1 else n for n, c in counts.items()]
