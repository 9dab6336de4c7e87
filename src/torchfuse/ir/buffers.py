"""Loop-IR containers: tensor values, buffers and the lowered program of one graph.

A `TensorValue` is something a kernel can read at an n-d index: either a strided view of a
buffer in memory (`StridedValue`) or an unrealized computation (`ComputedValue`, a closure that
builds the expression for any index).  Lowering composes ComputedValues, which is what fuses
pointwise chains; `realize` turns a value into a `ComputedBuffer`, a loop nest that stores it.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch

from .nodes import Node, const, load, to_text, var, where


class Unsupported(Exception):
    """Raised by a lowering that cannot handle its inputs; the op then runs through ATen."""


@dataclass(frozen=True)
class Layout:
    sizes: tuple[Node, ...]
    strides: tuple[Node, ...]
    offset: Node = const(0)

    def index(self, idx: Sequence[Node]) -> Node:
        out = self.offset
        for i, st, sz in zip(idx, self.strides, self.sizes):
            if not (sz.op == "const" and sz.arg == 1):
                out = out + i * st
        return out

    def __str__(self) -> str:
        return f"size=({', '.join(map(to_text, self.sizes))}) stride=({', '.join(map(to_text, self.strides))})" + \
            ("" if self.offset == const(0) else f" offset={to_text(self.offset)}")


def contiguous_strides(sizes: Sequence[Node]) -> tuple[Node, ...]:
    strides: list[Node] = []
    acc: Node = const(1)
    for s in reversed(sizes):
        strides.append(acc)
        acc = acc * s
    return tuple(reversed(strides))


def is_row_major(sizes: Sequence[Node], strides: Sequence[Node]) -> bool:
    """Whether `strides` are the row-major strides of `sizes` (size-1 dims aside), compared
    structurally: no guard on symbolic sizes."""
    return all(size == const(1) or got == want
               for size, got, want in zip(sizes, strides, contiguous_strides(sizes)))


class TensorValue:
    shape: tuple[Node, ...]
    dtype: torch.dtype

    def load(self, idx: Sequence[Node]) -> Node:
        raise NotImplementedError

    @property
    def ndim(self) -> int:
        return len(self.shape)


class StridedValue(TensorValue):
    """`buffer` viewed with `layout` (sizes, strides, offset in elements from the buffer's start)."""

    def __init__(self, buffer: str, layout: Layout, dtype: torch.dtype):
        self.buffer, self.layout, self.dtype = buffer, layout, dtype
        self.shape = layout.sizes

    def load(self, idx: Sequence[Node]) -> Node:
        return load(self.buffer, self.layout.index(idx), self.dtype)

    def __repr__(self) -> str:
        return f"{self.buffer}<{self.layout}>"


class ComputedValue(TensorValue):
    """An unrealized tensor: `fn(idx)` returns the scalar expression of the element at `idx`."""

    def __init__(self, shape: Sequence[Node], dtype: torch.dtype, fn: Callable[[Sequence[Node]], Node]):
        self.shape, self.dtype, self.fn = tuple(shape), dtype, fn
        self.meta: torch.Tensor | None = None    # the fx node's fake tensor, when it stands for one
        self.origins: list[str] = []             # the fx nodes fused into this value
        self.window = False                      # reads a window of its input per element (pooling)
        self.slot: tuple[Any, int, int | None] | None = None   # stored into that slice of a cat (cat_slots.py)

    def load(self, idx: Sequence[Node]) -> Node:
        return self.fn(idx)


@dataclass
class ComputedBuffer:
    """A loop nest that computes one buffer.

    Pointwise: for i0..in over `ranges`: out[layout(i)] = body.
    Reduction: for i over `ranges`: out[layout(i)] = reduce_{r over reduction_ranges}(body).
    `body` uses vars named i0, i1, ... and (for reductions) r0, r1, ....
    """
    name: str
    dtype: torch.dtype
    layout: Layout
    ranges: tuple[Node, ...]
    body: Node
    reduction_op: str | None = None
    reduction_ranges: tuple[Node, ...] = ()
    origins: list[str] = field(default_factory=list)
    is_output: bool = False
    # A scatter (lowering/scatter.py): `ranges` is the source/index domain, and each point stores
    # (`scatter` "store") or accumulates ("sum", "prod", "amax", "amin") `body` into buffer
    # `into` (already holding its initial value) at `scatter_index`, an offset computed from
    # loaded indices that is negative where nothing may be written (out of range, skipped):
    # `guarded_offset(ok, offset)`, which `split_guarded` takes apart again.
    # This buffer is then `into` itself, after the scatter.
    scatter: str | None = None
    into: str | None = None
    scatter_index: Node | None = None
    # the scatter's adds must come in an order that does not change from run to run
    # (torch.use_deterministic_algorithms; Features.deterministic_scatters)
    deterministic: bool = False
    # why the lowering stored this value where it would otherwise be inlined into its readers,
    # if a rule there says (explain() lists it with the refused fusions)
    stored_because: str = ""

    @property
    def is_reduction(self) -> bool:
        return self.reduction_op is not None

    def store_index(self) -> Node:
        if self.scatter_index is not None:
            return self.scatter_index
        return self.layout.index([var(f"i{k}") for k in range(len(self.ranges))])

    def var_ranges(self) -> dict[str, Node]:
        out = {f"i{k}": s for k, s in enumerate(self.ranges)}
        out.update({f"r{k}": s for k, s in enumerate(self.reduction_ranges)})
        return out

    def __str__(self) -> str:
        loops = ", ".join(f"i{k} < {to_text(s)}" for k, s in enumerate(self.ranges))
        head = f"{self.name}: {str(self.dtype).replace('torch.', '')}[{loops}] {self.layout}"
        if self.is_reduction:
            red = ", ".join(f"r{k} < {to_text(s)}" for k, s in enumerate(self.reduction_ranges))
            return f"{head}\n    = {self.reduction_op}_[{red}]( {to_text(self.body)} )   # from {', '.join(self.origins)}"
        if self.scatter is not None:
            return (f"{head}\n    {self.into}[{to_text(self.store_index())}] {self.scatter}= {to_text(self.body)}"
                    f"   # from {', '.join(self.origins)}")
        return f"{head}\n    = {to_text(self.body)}   # from {', '.join(self.origins)}"


def guarded_offset(ok: Node | None, offset: Node) -> Node:
    """A scatter's store index: `offset` where `ok` holds, -1 (nothing written) elsewhere; a bare
    `offset` (ok None) is in range wherever the scatter's domain is."""
    return offset if ok is None else where(ok, offset, const(-1))


def split_guarded(index: Node) -> tuple[Node, Node | None]:
    """(offset, ok) of a store index made by `guarded_offset` (ok None: every point writes).  A
    backend that masks lanes keeps the two apart: Triton vectorizes an atomic or a store only
    when its address is contiguous and its mask constant along the fast dim, which
    `tl.where(ok, offset, -1)` and a mask `offset >= 0` both hide (a GNN's scatter_add of 256-wide
    rows: scalar `red.add.f32` for it, `red.add.v4.f32` for the offset and `ok` apart)."""
    if index.op == "where" and index.args[2] == const(-1):
        return index.args[1], index.args[0]
    return index, None


@dataclass
class FallbackCall:
    """An aten op run through ATen at run time.  `args`/`kwargs` hold `BufferRef`s for tensors."""
    node_name: str
    target: Any
    args: tuple
    kwargs: dict
    outputs: list[str | None]     # buffer name per output (None for non-tensor outputs)
    reason: str
    binds: list[tuple[str, str, int]] = field(default_factory=list)   # (symbol, buffer, dim) known after the call
    multi: bool = False           # the op returns a tuple/list (even of one element)

    def __str__(self) -> str:
        return f"{', '.join(o or '_' for o in self.outputs)} = {self.target}(...)  # ATen: {self.reason}"


@dataclass(frozen=True)
class BufferRef:
    """A reference to a runtime tensor in a fallback's arguments, possibly a strided view of it."""
    buffer: str
    layout: Layout | None = None   # None: the buffer itself


@dataclass
class AliasView:
    """A graph value that is a view of a realized buffer, made at run time with as_strided.
    `after`: buffers that live in `base`'s storage (a concatenation's parts, written into their
    slices) and must all be written before the view is made."""
    name: str
    base: str
    layout: Layout
    after: tuple[str, ...] = ()


@dataclass
class LoweredGraph:
    """The output of lowering: the program a backend turns into kernels plus a wrapper."""
    inputs: list[tuple[str, Any]]                      # (placeholder name, meta val)
    symbols: dict[str, tuple[int, str, int]]           # sym -> (input position, "size"|"stride"|"value", dim)
    steps: list[ComputedBuffer | FallbackCall | AliasView]
    outputs: list[Any]                                 # buffer name, ("sym", Node), ("const", v) or None
    buffer_meta: dict[str, tuple[tuple[Node, ...], tuple[Node, ...], torch.dtype, torch.device]]
    mutations: list[tuple[str, str]] = field(default_factory=list)   # (input buffer, new value buffer)
    # buffers allocated as a slice of another: {part: (concatenation buffer, offset in elements)}
    slices: dict[str, tuple[str, Node]] = field(default_factory=dict)

    def __str__(self) -> str:
        lines = ["inputs: " + ", ".join(name for name, _ in self.inputs)]
        for step in self.steps:
            lines.append(str(step))
        lines.append("outputs: " + ", ".join(map(str, self.outputs)))
        return "\n".join(lines)
