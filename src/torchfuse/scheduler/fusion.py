"""The fusion scheduler: groups computed buffers into kernels, and says why when it refuses.

Vertical fusion of pointwise chains already happened in lowering (unrealized values compose).
Here, realized buffers that share a loop structure join one kernel:

  pointwise kernel  one loop nest over `outer`; every member is computed at each point.
  reduction kernel  a loop over `outer` (kept dims); inside it, stages in program order:
                    "reduce" members loop over `inner` (reduced dims) and accumulate,
                    "inner" members are pointwise over outer+inner (a softmax's output),
                    "outer" members are pointwise over outer alone (a layer norm's rstd).

A member may read another member of its kernel only at the same outer point (and, inside one
loop, the same inner point), so every kernel is a correct parallel loop over `outer`.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field

from ..config import Config
from ..ir.buffers import AliasView, BufferRef, ComputedBuffer, FallbackCall, LoweredGraph
from ..ir.nodes import Node, const, loads, substitute, to_text, var

log = logging.getLogger("torchfuse.fusion")


@dataclass
class Member:
    buffer: ComputedBuffer
    role: str                 # "pointwise" | "reduce" | "inner" | "outer"
    body: Node                # body with kernel vars x0.. (outer) and y0.. (inner)
    store: Node               # store index in kernel vars


@dataclass
class Kernel:
    name: str
    outer: tuple[Node, ...]
    inner: tuple[Node, ...]
    members: list[Member] = field(default_factory=list)
    # (symbol, Python expression) the wrapper evaluates before this kernel (a split factor that
    # depends on run-time sizes)
    bindings: list[tuple[str, str]] = field(default_factory=list)

    @property
    def kind(self) -> str:
        return "reduction" if any(m.role == "reduce" for m in self.members) else "pointwise"

    @property
    def origins(self) -> list[str]:
        return [o for m in self.members for o in m.buffer.origins]

    def __str__(self) -> str:
        outer = ", ".join(map(to_text, self.outer))
        inner = ", ".join(map(to_text, self.inner))
        lines = [f"{self.name} ({self.kind}): outer=[{outer}] inner=[{inner}]"]
        for m in self.members:
            lines.append(f"  {m.role:9s} {m.buffer.name}[{to_text(m.store)}] = "
                         f"{(m.buffer.reduction_op + ' ') if m.buffer.reduction_op else ''}{to_text(m.body)}")
        return "\n".join(lines)


@dataclass
class Schedule:
    items: list[Kernel | FallbackCall | AliasView]
    refused: list[str]

    @property
    def kernels(self) -> list[Kernel]:
        return [k for k in self.items if isinstance(k, Kernel)]

    def __str__(self) -> str:
        out = [str(i) if isinstance(i, Kernel) else f"ATen: {i}" for i in self.items]
        if self.refused:
            out.append("refused fusions:")
            out += [f"  {r}" for r in self.refused]
        return "\n".join(out)


def squeeze(sizes: tuple[Node, ...]) -> tuple[Node, ...]:
    """Loop sizes without the size-1 dims, which never change an index."""
    return tuple(s for s in sizes if not (s.op == "const" and s.arg == 1))


def _rename(buf: ComputedBuffer, outer_len: int, role: str) -> tuple[Node, Node]:
    """Rewrite a buffer's vars (i*, r*) into kernel vars (x* outer, y* inner); size-1 dims -> 0."""
    mapping: dict[Node, Node] = {}
    pos = 0
    for k, size in enumerate(buf.ranges):
        if size.op == "const" and size.arg == 1:
            mapping[var(f"i{k}")] = const(0)
            continue
        mapping[var(f"i{k}")] = var(f"x{pos}") if pos < outer_len else var(f"y{pos - outer_len}")
        pos += 1
    pos = 0
    for k, size in enumerate(buf.reduction_ranges):
        if size.op == "const" and size.arg == 1:
            mapping[var(f"r{k}")] = const(0)
            continue
        mapping[var(f"r{k}")] = var(f"y{pos}")
        pos += 1
    return substitute(buf.body, mapping), substitute(buf.store_index(), mapping)


def _role(kernel: Kernel, buf: ComputedBuffer) -> tuple[str | None, str]:
    """How `buf` would sit in `kernel`'s loops, or None and the reason it cannot."""
    if buf.is_reduction:
        if kernel.inner == () and kernel.kind == "pointwise":
            if kernel.outer == squeeze(buf.ranges + buf.reduction_ranges):
                return "reduce", ""     # the pointwise kernel becomes this reduction's prologue
            return None, f"reduction over [{_fmt(buf.reduction_ranges)}] of [{_fmt(buf.ranges)}] " \
                         f"does not tile pointwise loops [{_fmt(kernel.outer)}]"
        if squeeze(buf.ranges) == kernel.outer and squeeze(buf.reduction_ranges) == kernel.inner:
            return "reduce", ""
        return None, f"reduction loops [{_fmt(buf.ranges)}]x[{_fmt(buf.reduction_ranges)}] differ from " \
                     f"[{_fmt(kernel.outer)}]x[{_fmt(kernel.inner)}]"
    if kernel.inner == ():
        if squeeze(buf.ranges) == kernel.outer:
            return "pointwise", ""
        return None, f"iteration space [{_fmt(buf.ranges)}] differs from [{_fmt(kernel.outer)}]"
    if squeeze(buf.ranges) == kernel.outer + kernel.inner:
        return "inner", ""
    if squeeze(buf.ranges) == kernel.outer:
        return "outer", ""
    return None, f"iteration space [{_fmt(buf.ranges)}] matches neither rows [{_fmt(kernel.outer)}] nor " \
                 f"rows x reduced [{_fmt(kernel.outer + kernel.inner)}]"


def _fmt(sizes: tuple[Node, ...]) -> str:
    return ", ".join(map(to_text, sizes))


def _as_reduction_kernel(kernel: Kernel, buf: ComputedBuffer) -> Kernel:
    """Re-tile a pointwise kernel over outer+inner so a reduction over `inner` can join it."""
    new = Kernel(kernel.name, squeeze(buf.ranges), squeeze(buf.reduction_ranges))
    for m in kernel.members:
        body, store = _rename(m.buffer, len(new.outer), "inner")
        new.members.append(Member(m.buffer, "inner", body, store))
    return new


def _reads_ok(kernel: Kernel, member: Member) -> str:
    """Empty if every read of a kernel member by `member` is at the point that member wrote."""
    written = {m.buffer.name: m for m in kernel.members}
    for ld in loads(member.body):
        producer = written.get(ld.arg)
        if producer is None:
            continue
        if ld.args[0] != producer.store:
            return f"reads {ld.arg} at [{to_text(ld.args[0])}] but it is written at [{to_text(producer.store)}]"
        if member.role == "outer" and producer.role in ("inner", "pointwise"):
            return f"a per-row value cannot read the per-element {ld.arg}"
        if member.role == "reduce" and producer.role == "reduce" and producer.buffer is member.buffer:
            return "self reference"
    return ""


def schedule(program: LoweredGraph, config: Config) -> Schedule:
    items: list[Kernel | FallbackCall | AliasView] = []
    refused: list[str] = []
    current: Kernel | None = None
    count = 0

    def close() -> None:
        nonlocal current
        if current is not None:
            items.append(current)
            current = None

    for step in program.steps:
        if not isinstance(step, ComputedBuffer):
            close()
            items.append(step)
            continue
        if current is not None and config.fuse and len(current.members) < config.max_fusion_size:
            role, reason = _role(current, step)
            candidate = current
            if role == "reduce" and current.inner == () and not squeeze(step.ranges) == current.outer:
                candidate = _as_reduction_kernel(current, step)
            if role is not None:
                body, store = _rename(step, len(candidate.outer), role)
                member = Member(step, role, body, store)
                reason = _reads_ok(candidate, member)
                if not reason:
                    candidate.members.append(member)
                    current = candidate
                    continue
            refused.append(f"{step.name} ({', '.join(step.origins)}) not fused into {current.name} "
                           f"({', '.join(current.origins)}): {reason}")
            log.debug(refused[-1])
        elif current is not None:
            refused.append(f"{step.name} not fused into {current.name}: "
                           + ("fusion disabled" if not config.fuse else "kernel size limit"))
        close()
        current = Kernel(f"kernel{count}", squeeze(step.ranges), squeeze(step.reduction_ranges))
        count += 1
        role = "reduce" if step.is_reduction else "pointwise"
        body, store = _rename(step, len(step.ranges), role)
        current.members.append(Member(step, role, body, store))
    close()
    return Schedule(items, refused)


def buffer_readers(sched: Schedule, program: LoweredGraph) -> dict[str, set[str]]:
    """For each buffer, who reads it: kernel names, "aten" for fallbacks/views, "output"."""
    readers: dict[str, set[str]] = {}
    for item in sched.items:
        if isinstance(item, Kernel):
            for m in item.members:
                for ld in loads(m.body):
                    readers.setdefault(ld.arg, set()).add(item.name)
        elif isinstance(item, FallbackCall):
            def visit(a):
                if isinstance(a, BufferRef):
                    readers.setdefault(a.buffer, set()).add("aten")
                elif isinstance(a, (list, tuple)):
                    for x in a:
                        visit(x)
            visit(item.args)
            visit(list(item.kwargs.values()))
        elif isinstance(item, AliasView):
            readers.setdefault(item.base, set()).add("aten")
    for o in program.outputs:
        if isinstance(o, str):
            readers.setdefault(o, set()).add("output")
    return readers
