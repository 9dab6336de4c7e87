"""Concatenations written in place: each part stored straight into its slice of the result.

A part that must be in memory anyway (an RNN's hidden state, read by the next step's matmul
and stacked for the next layer) used to be stored in a buffer of its own and then copied into
the concatenation.  Here the concatenation's buffer is
allocated when its first part is stored, every part is stored into its slice (with the result's
strides), and the concatenation itself is a view of that buffer made once all parts are written
(an `AliasView` whose `after` lists them): no copy, and one buffer instead of two.  Inductor does
the same (its ConcatKernel's NonOwningLayout).

Only a concatenation that must be in memory anyway is planned so: one that an ATen call reads
(through views) or the graph returns.  Parts that are not stored when it is lowered (a graph input, an ATen result, a
value nobody else needed in memory) are then computed or copied into their slices.  A
concatenation none of whose parts got stored keeps the fused lowering (lower_views._cat).

Only parts the graph does not return are placed: the result's other slices are written by other
kernels, so a returned part would alias storage the caller does not know is shared.  And only
parts whose other readers take a slice with gaps as they take a dense buffer (kernels, BLAS):
a convolution or CPU pooling would copy it or run slower.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Sequence

import torch
import torch.fx as fx

from ..ir.buffers import AliasView, ComputedValue, Layout, StridedValue, TensorValue, Unsupported
from ..ir.nodes import Node, cast, const

if TYPE_CHECKING:
    from .graph import GraphLowering

log = logging.getLogger("torchfuse.lowering")
aten = torch.ops.aten


@dataclass
class CatPlan:
    """Where each part of one concatenation goes: the result's layout, each part's offset in
    elements (None: the part writes nothing, an empty legacy 1-d tensor or zero elements)."""
    layout: Layout
    dtype: torch.dtype
    offsets: list[Node | None]
    part_sizes: list[tuple[Node, ...] | None]
    buffer: str | None = None          # the result's buffer, once a part is stored into it


def plan_cat_slots(lw: "GraphLowering") -> dict[fx.Node, tuple[fx.Node, int, int | None]]:
    """{part node: (concatenation node, position, dim)} for every part that may be stored into
    its slice when it is realized (dim: the part is that node unsqueezed there, as torch.stack
    along the last dim makes it); fills `lw.cat_plans`."""
    from .values import (channels_last_conv, channels_last_layout, is_dense, layout_of, meta_val, shape_of, size_hint, sym_to_node)
    slot_of: dict[fx.Node, tuple[fx.Node, int, int | None]] = {}
    for cat in lw.gm.graph.find_nodes(op="call_function", target=aten.cat.default):
        out = meta_val(cat)
        parts = cat.args[0] if cat.args else ()
        if not isinstance(out, torch.Tensor) or not is_dense(out) or out.ndim == 0 or len(parts) < 2 \
                or not _read_from_memory(cat):
            continue
        dim = (cat.args[1] if len(cat.args) > 1 else cat.kwargs.get("dim", 0)) % out.ndim
        try:
            layout = layout_of(out)
            if out.ndim == 4 and cat.users and all(channels_last_conv(u) for u in cat.users):
                # only channels-last convolutions read it: stored so (as lowering's
                # _realize_channels_last would store a fused cat), not copied there afterwards
                layout = channels_last_layout(layout.sizes)
        except Unsupported:    # a size the loop IR cannot express
            continue
        stride = layout.strides[dim]
        offsets: list[Node | None] = []
        sizes: list[tuple[Node, ...] | None] = []
        acc: Node = const(0)
        counts: dict[Any, int] = {}
        for a in parts:
            counts[a] = counts.get(a, 0) + 1
        for pos, a in enumerate(parts):
            m = meta_val(a) if isinstance(a, fx.Node) else None
            if not isinstance(m, torch.Tensor) or m.ndim != out.ndim or size_hint(m.numel()) == 0:
                offsets.append(None)
                sizes.append(None)
                if isinstance(m, torch.Tensor) and m.ndim == out.ndim:
                    acc = acc + sym_to_node(m.shape[dim])
                continue
            offsets.append(acc * stride)
            sizes.append(shape_of(m))
            acc = acc + sym_to_node(m.shape[dim])
            # torch.stack along the last dim concatenates unsqueezed parts: the slot is the base's
            squeezed = None
            if a.target is aten.unsqueeze.default and isinstance(a.args[0], fx.Node) and len(a.users) == 1:
                a, squeezed = a.args[0], a.args[1] % out.ndim
            if (a.op == "call_function" and a not in lw.output_nodes and a not in slot_of
                    and counts.get(a, 1) == 1 and m.dtype == out.dtype and m.device == out.device
                    and _readers_take_strides(a, cat)):
                slot_of[a] = (cat, pos, squeezed)
        lw.cat_plans[cat] = CatPlan(layout, out.dtype, offsets, sizes)
    return slot_of


def _read_from_memory(node: fx.Node) -> bool:
    """Is `node`'s value needed in memory whatever torchfuse does: does a reader (through views)
    run through ATen (a matmul, a convolution) or is it returned?  A concatenation only lowered
    ops read stays lazy: its loads fuse into their kernels (a clone to channels-last, a batch
    norm), which beats writing it anywhere."""
    from .registry import LOWERINGS, is_view
    for u in node.users:
        if u.op == "output" or (u.op == "call_function" and u.target not in LOWERINGS):
            return True
        if is_view(u) and _read_from_memory(u):
            return True
    return False


# ATen readers that take a slice as it is: BLAS reads rows a leading dimension apart.  Others
# (a convolution, CPU pooling) copy a tensor with gaps to a dense one first, or run slower on it:
# a U-Net's skip connection, read by max-pool and concatenated, ran 5% slower in place.
_STRIDED_ATEN_READERS = frozenset({aten.mm.default, aten.addmm.default, aten.bmm.default, aten.baddbmm.default})
# lowered, but through ATen on some backends (pooling on the C++ one)
_MAYBE_ATEN = frozenset({aten.max_pool2d_with_indices.default, aten.max_pool2d_with_indices_backward.default,
                         aten.avg_pool2d.default, aten.avg_pool2d_backward.default})


def _readers_take_strides(node: fx.Node, cat: fx.Node) -> bool:
    """Do all of `node`'s readers besides `cat` (through views) read a slice with gaps between
    its rows as fast as a dense buffer: generated kernels (any strides) and BLAS calls?"""
    from .registry import LOWERINGS, is_view
    for u in node.users:
        if u is cat or u.target in _STRIDED_ATEN_READERS:
            continue
        if is_view(u):
            if not _readers_take_strides(u, cat):
                return False
        elif u.op != "call_function" or u.target not in LOWERINGS or u.target in _MAYBE_ATEN:
            return False
    return True


def _dim_order(layout: Layout) -> list[int] | None:
    """Its dims outermost first (size-1 dims left out); None where a stride is symbolic."""
    if any(st.op != "const" for st in layout.strides):
        return None
    return sorted((d for d, s in enumerate(layout.sizes) if not (s.op == "const" and s.arg == 1)),
                  key=lambda d: (-layout.strides[d].arg, d))


def slot_layout(lw: "GraphLowering", value: TensorValue, wanted: Layout | None) -> tuple[Layout, str, Node] | None:
    """(layout, concatenation buffer, offset) for storing `value` into the slice it was planned
    for (`value.slot`), or None: no plan, a shape that differs from the part's, or a layout
    asked for in another dim order (a channels-last convolution's input of an NCHW cat)."""
    slot = getattr(value, "slot", None)     # (set only where plan_cat_slots planned a cat)
    if slot is None:
        return None
    cat, pos, squeezed = slot
    plan = lw.cat_plans.get(cat)
    if plan is None or plan.offsets[pos] is None or value.dtype != plan.dtype:
        return None
    sizes, strides = list(plan.part_sizes[pos]), list(plan.layout.strides)
    if squeezed is not None:       # the part is this value unsqueezed at `squeezed`
        del sizes[squeezed], strides[squeezed]
    if tuple(sizes) != tuple(value.shape):
        return None
    layout = Layout(tuple(sizes), tuple(strides))
    if wanted is not None and wanted.strides != layout.strides and \
            (_dim_order(wanted) is None or _dim_order(wanted) != _dim_order(layout)):
        return None
    if plan.buffer is None:
        plan.buffer = lw.new_name("buf")
        lw.buffer_meta[plan.buffer] = (plan.layout.sizes, plan.layout.strides, plan.dtype, lw.device)
    value.slot = None        # one slice, one writer
    return layout, plan.buffer, plan.offsets[pos]


def cat_in_place(lw: "GraphLowering", tensors: Sequence[Any]) -> StridedValue | None:
    """The concatenation being lowered as a view of its buffer, when some part was stored into
    its slice: the other parts are computed or copied into theirs.  None: no part was."""
    plan = lw.cat_plans.get(lw.current)
    if plan is None or plan.buffer is None or len(tensors) != len(plan.offsets):
        return None
    after: list[str] = []
    copied = 0
    for pos, t in enumerate(tensors):
        if plan.offsets[pos] is None:
            continue
        if isinstance(t, StridedValue) and lw.slices.get(t.buffer) == (plan.buffer, plan.offsets[pos]):
            after.append(t.buffer)
            continue
        part = ComputedValue(t.shape, plan.dtype,
                             (lambda idx, t=t: cast(t.load(idx), plan.dtype)) if t.dtype != plan.dtype else t.load)
        part.slot = (lw.current, pos, None)
        stored = lw.realize(part, origins=list(getattr(t, "origins", ())) or [lw.current.name])
        assert stored.buffer in lw.slices, "a part planned for its slice was stored elsewhere"
        after.append(stored.buffer)
        copied += 1
    name = lw.new_name("cat")
    lw.steps.append(AliasView(name, plan.buffer, plan.layout, tuple(after)))
    lw.buffer_meta[name] = (plan.layout.sizes, plan.layout.strides, plan.dtype, lw.device)
    log.debug("%s: %d part(s) stored into their slices of %s, %d computed or copied there",
              lw.current.name, len(after) - copied, plan.buffer, copied)
    return StridedValue(name, plan.layout, plan.dtype)
