"""Lowering: an aten FX graph becomes a `LoweredGraph` of loop nests and ATen fallbacks.

Each aten op with an entry in `LOWERINGS` turns into a `TensorValue`.  Pointwise ops and views
return unrealized `ComputedValue`s, so a chain of them composes into one expression (vertical
fusion happens here, by construction).  A value is realized into a `ComputedBuffer` when it is a
reduction, a graph output, an argument of an ATen fallback, or used several times and too
expensive to recompute.  Ops without a lowering (matmul, convolution, random, ...) become
`FallbackCall`s and run through ATen inside the same compiled graph.
"""
from __future__ import annotations

import logging
import operator
from typing import Any, Callable, Sequence

import torch
import torch.fx as fx

from .. import backends
from ..backends.base import Backend
from ..config import Config
from ..ir.buffers import (AliasView, BufferRef, ComputedBuffer, ComputedValue, FallbackCall, Layout, LoweredGraph, StridedValue, TensorValue, Unsupported, contiguous_strides)
from .cat_slots import CatPlan, plan_cat_slots, slot_layout
from .registry import LOWERINGS, REDUCTIONS, is_view
from .values import (ATTENTION_BIAS_ARG, CONVOLUTIONS, channels_last_conv, channels_last_layout, graph_device, is_dense,
                     is_non_overlapping, layout_of, meta_val, shape_of, sym_to_node, sympy_to_node)
from ..ir.nodes import Node, const, op, var
from ..scheduler.collectives import is_collective_op

log = logging.getLogger("torchfuse.lowering")

aten = torch.ops.aten
prims = torch.ops.prims

# --------------------------------------------------------------------------------------------
# the driver
# --------------------------------------------------------------------------------------------

class GraphLowering:
    """Walks an aten graph once, turning nodes into values, buffers and fallbacks."""

    def __init__(self, gm: fx.GraphModule, config: Config):
        self.gm, self.config = gm, config
        self.env: dict[fx.Node, Any] = {}
        self.steps: list[ComputedBuffer | FallbackCall | AliasView] = []
        self.buffer_meta: dict[str, tuple] = {}
        self.symbols: dict[str, tuple[int, str, int]] = {}
        self.inputs: list[tuple[str, Any]] = []
        self.fallback_reasons: list[tuple[str, str, str]] = []
        self._count = 0
        self.current: fx.Node | None = None
        self.output_nodes: set[fx.Node] = set()
        self.device: torch.device | None = None
        self._order: dict[fx.Node, int] | None = None
        self.producers: Any = None        # realize.ProducerIndex, made on first use
        self.forced_fallbacks = set(config.fallback_ops)
        self._reductions: dict[tuple, StridedValue] = {}
        # values that some consumer needed in memory (a fallback's argument, say), by id: later
        # consumers read that buffer instead of recomputing the value, which would keep the
        # value's own inputs alive longer and read more bytes.  The value is kept alongside so
        # its id is not reused.
        self._realized: dict[int, tuple[ComputedValue, StridedValue]] = {}
        self._aligned_copies: dict[tuple, StridedValue] = {}    # (buffer, layout) -> its aligned copy
        self._broadcast_biases: dict[int, tuple] = {}    # id(bias) -> (bias, its stored view)
        # concatenations written in place (cat_slots.py): each one's plan, the part nodes that may
        # be stored into their slices, and the buffers stored so: {part: (cat buffer, offset)}
        self.cat_plans: dict[fx.Node, CatPlan] = {}
        self.cat_slot_of: dict[fx.Node, tuple[fx.Node, int, int | None]] = {}
        self.slices: dict[str, tuple[str, Node]] = {}

    # -- helpers used by the op lowerings ---------------------------------------------------
    @property
    def backend(self) -> Backend | None:
        """The backend that compiles this graph (None until its inputs name a device)."""
        return backends.for_device(self.device, self.config) if self.device is not None else None

    def new_name(self, prefix: str = "buf") -> str:
        self._count += 1
        return f"{prefix}{self._count - 1}"

    def out_meta(self, node: fx.Node | None = None) -> Any:
        return meta_val(node or self.current)

    def out_shape(self, node: fx.Node | None = None) -> tuple[Node, ...]:
        return shape_of(self.out_meta(node))

    def out_dtype(self, node: fx.Node | None = None) -> torch.dtype:
        return self.out_meta(node).dtype

    def realize(self, value: TensorValue, *, layout: Layout | None = None, origins: Sequence[str] = (),
                reduction: tuple[str, tuple[Node, ...], Callable] | None = None) -> StridedValue:
        """Store `value` into a new buffer (contiguous unless `layout` says otherwise)."""
        if reduction is not None:
            red_op, red_ranges, body_fn = reduction
            ranges = tuple(value.shape)
            idx = [var(f"i{k}") for k in range(len(ranges))]
            ridx = [var(f"r{k}") for k in range(len(red_ranges))]
            body = body_fn(idx, ridx)
        else:
            red_op, red_ranges = None, ()
            ranges = tuple(value.shape)
            body = value.load([var(f"i{k}") for k in range(len(ranges))])
        # The same reduction lowered twice (var_mean's sum and the user's own sum of x) is
        # computed once: a row kernel would otherwise carry both accumulators.
        key = (red_op, ranges, tuple(red_ranges), body, value.dtype) if reduction is not None and layout is None \
            else None
        if key in self._reductions:
            return self._reductions[key]
        slot = slot_layout(self, value, layout) if reduction is None else None
        if slot is not None:
            layout = slot[0]
        if layout is None:
            meta = getattr(value, "meta", None)
            if reduction is None and meta is not None and is_dense(meta) and shape_of(meta) == ranges:
                layout = layout_of(meta)     # keep eager's memory format, so later views match meta
            else:
                layout = Layout(ranges, contiguous_strides(ranges))
        name = self.new_name()
        origins = list(origins) or list(getattr(value, "origins", ())) or \
            ([self.current.name] if self.current is not None else [])
        buf = ComputedBuffer(name, value.dtype, layout, ranges, body, red_op, tuple(red_ranges), origins,
                             stored_because=getattr(value, "stored_because", ""))
        self.steps.append(buf)
        self.buffer_meta[name] = (layout.sizes, layout.strides, value.dtype, self.device)
        if slot is not None:
            self.slices[name] = slot[1:]
        result = StridedValue(name, layout, value.dtype)
        if key is not None:
            self._reductions[key] = result
        return result

    def reduce(self, op: str, out_ranges: Sequence[Node], red_ranges: Sequence[Node], dtype: torch.dtype,
               body_fn: Callable[[list[Node], list[Node]], Node]) -> StridedValue:
        """Realize a reduction over `red_ranges` for every point of `out_ranges`."""
        proto = ComputedValue(tuple(out_ranges), dtype, lambda idx: const(0))
        return self.realize(proto, reduction=(op, tuple(red_ranges), body_fn))

    def stored_form(self, value: Any) -> StridedValue | None:
        """The buffer a computed value was stored in since (`stored`), if any."""
        done = self._realized.get(id(value)) if isinstance(value, ComputedValue) else None
        return None if done is None else done[1]

    def stored(self, value: TensorValue, layout: Layout | None = None) -> StridedValue:
        """`value` in a buffer (laid out as `layout` if it is the first to ask): realized once,
        however many consumers ask."""
        if isinstance(value, ComputedValue):
            done = self._realized.get(id(value))
            if done is None:
                done = self._realized[id(value)] = (value, self.realize(value, layout=layout))
            value = done[1]
        assert isinstance(value, StridedValue)
        return value

    def as_buffer_ref(self, value: TensorValue) -> BufferRef:
        value = self.stored(value)
        base = self.buffer_meta.get(value.buffer)
        if base is not None and tuple(base[0]) == value.layout.sizes and tuple(base[1]) == value.layout.strides \
                and value.layout.offset == const(0):
            return BufferRef(value.buffer)
        return BufferRef(value.buffer, value.layout)

    # -- the walk ---------------------------------------------------------------------------------
    def run(self) -> LoweredGraph:
        graph = self.gm.graph
        out_node = next(n for n in graph.nodes if n.op == "output")
        fx.node.map_arg(out_node.args, self.output_nodes.add)
        self.device = graph_device(meta_val(n) for n in graph.find_nodes(op="placeholder"))
        if self.config.cat_in_place:
            self.cat_slot_of = plan_cat_slots(self)
        placeholder_pos = 0
        for node in graph.nodes:
            self.current = node
            if node.op == "placeholder":
                self._lower_placeholder(node, placeholder_pos)
                placeholder_pos += 1
            elif node.op == "get_attr":
                self._lower_get_attr(node)
            elif node.op == "call_function":
                self._lower_call(node)
            elif node.op == "output":
                outputs = self._lower_outputs(list(node.args[0]))
            else:
                raise Unsupported(f"fx node kind {node.op}")
        self.current = None
        return LoweredGraph(self.inputs, self.symbols, self.steps, outputs, self.buffer_meta, slices=self.slices)

    def _bind_symbol(self, value: Any, pos: int, kind: str, dim: int) -> None:
        if isinstance(value, torch.SymInt):
            expr = value.node.expr
            import sympy
            if isinstance(expr, sympy.Symbol) and expr.name not in self.symbols:
                self.symbols[expr.name] = (pos, kind, dim)

    def _lower_placeholder(self, node: fx.Node, pos: int) -> None:
        val = meta_val(node)
        self.inputs.append((node.name, val))
        if isinstance(val, torch.Tensor):
            for d, s in enumerate(val.shape):
                self._bind_symbol(s, pos, "size", d)
            for d, s in enumerate(val.stride()):
                self._bind_symbol(s, pos, "stride", d)
            name = f"in{pos}"
            layout = layout_of(val)
            self.buffer_meta[name] = (layout.sizes, layout.strides, val.dtype, val.device)
            self.env[node] = StridedValue(name, layout, val.dtype)
        elif isinstance(val, torch.SymInt):
            self._bind_symbol(val, pos, "value", 0)
            self.env[node] = sym_to_node(val)
        else:
            self.env[node] = val

    def _lower_get_attr(self, node: fx.Node) -> None:
        value = getattr(self.gm, node.target)
        if isinstance(value, torch.Tensor):
            name = self.new_name("const")
            self.buffer_meta[name] = (shape_of(value), tuple(const(s) for s in value.stride()), value.dtype, value.device)
            # get_attr tensors are bound by the wrapper under the name "constN"
            self.env[node] = StridedValue(name, layout_of(value), value.dtype)
            self.steps.append(FallbackCall(node.name, "get_attr", (value,), {}, [name], "constant"))
        else:
            self.env[node] = value

    def _args(self, node: fx.Node) -> tuple[tuple, dict]:
        def conv(a: Any) -> Any:
            if isinstance(a, fx.Node):
                value = self.env[a]
                return self.stored_form(value) or value
            if isinstance(a, (list, tuple)):
                return type(a)(conv(x) for x in a)
            if isinstance(a, torch.SymInt):
                return sym_to_node(a)
            return a
        return conv(node.args), {k: conv(v) for k, v in node.kwargs.items()}

    def _lower_call(self, node: fx.Node) -> None:
        target = node.target
        val = meta_val(node)
        if target is operator.getitem:
            base = self.env[node.args[0]]
            self.env[node] = base[node.args[1]] if isinstance(base, (list, tuple)) else None
            if self.env[node] is None:
                raise Unsupported(f"getitem on {type(base)}")
            # an output of a multi-output lowering (max-pool values): its own users decide
            self.env[node] = self._maybe_realize_one(node, self.env[node], list(node.users))
            return
        if target in _RUNTIME_CHECKS or (isinstance(val, (bool, torch.SymBool)) and
                                         getattr(target, "__module__", "") == "_operator"):
            self.env[node] = None          # shape assertions: Dynamo's guards already hold them
            return
        if isinstance(val, torch.SymFloat):
            self.env[node] = _symfloat_to_node(val)       # e.g. sym_float(s0) as a mean's divisor
            return
        if isinstance(val, (torch.SymInt, int)) and not isinstance(val, bool) and not isinstance(val, torch.Tensor):
            self.env[node] = sym_to_node(val)           # size arithmetic: sym_size, operator.mul, ...
            return
        lowering = LOWERINGS.get(target)
        reason = "no lowering for this op"
        if is_collective_op(target):
            reason = "communication: started early, waited for late (see the collectives)"
        odd = _dtype_without_kernels(node)
        if odd is not None:
            lowering, reason = None, f"no kernel code for {odd} (float8, complex, ... run through ATen)"
        if lowering is not None and str(target) not in self.forced_fallbacks:
            args, kwargs = self._args(node)
            try:
                result = lowering(self, *args, **kwargs)
                _tag_origins(result, node.name, args)
                self.env[node] = self._maybe_realize(node, result)
                return
            except Unsupported as e:
                reason = str(e)
        elif lowering is not None:
            reason = "forced by options['fallback_ops']"
        self._fallback(node, reason)

    def _realize_channels_last(self, node: fx.Node, args: tuple) -> None:
        """A value computed only to feed a channels-last convolution is written channels-last.

        Its own node may say NCHW (a channel shuffle's `.contiguous()`, a `view` after a `cat`),
        but nothing observes its layout except the convolution, which would copy it to
        channels-last first (cuDNN and oneDNN take both operands in one memory format): the
        copy Inductor avoids with its flexible layouts."""
        if not channels_last_conv(node):
            return
        for a in args:
            if isinstance(a, ComputedValue) and a.ndim == 4:
                self.stored(a, channels_last_layout(a.shape))

    def _node_order(self) -> dict[fx.Node, int]:
        if self._order is None:
            self._order = {n: i for i, n in enumerate(self.gm.graph.nodes)}
        return self._order

    def _maybe_realize(self, node: fx.Node, result: Any) -> Any:
        if isinstance(result, (list, tuple)):
            from .realize import item_readers
            return type(result)(self._maybe_realize_one(node, r, item_readers(node, i)) for i, r in enumerate(result))
        return self._maybe_realize_one(node, result, list(node.users))

    def _maybe_realize_one(self, node: fx.Node, value: Any, readers: list[fx.Node]) -> Any:
        if not isinstance(value, ComputedValue):
            return value
        meta = meta_val(node)
        if isinstance(meta, torch.Tensor) and shape_of(meta) == value.shape:
            value.meta = meta
        if node in self.cat_slot_of:
            value.slot = self.cat_slot_of[node]     # stored (if at all) into its slice of a cat
        from .realize import broadcast_only_for_kernels, channels_last_inputs, full_read_buffers, should_store
        from .realize import readers as readers_through_views
        if node in self.output_nodes and not is_view(node) and (
                all(u.op == "output" for u in node.users) or
                (full_read_buffers(value.load([var(f"i{k}") for k in range(value.ndim)]), value.shape)
                 and not any(r.target in REDUCTIONS for r in readers_through_views(node)))):
            # A value the graph returns (an activation the forward saves for the backward) is
            # stored here, in eager's strides, not when the output node is reached: stored
            # there, its inputs stayed alive to the end of the graph (T5's pre-activations, one
            # per layer, +400 MiB at the forward's end), and a value kernels read as well was
            # computed twice, the second time by a kernel of its own at the end (an RMSNorm's
            # saved rsqrt, [rows], recomputed after the block's last collective instead of
            # stored by the kernel of its row sums).  (A view stays lazy: stored at the output,
            # it is a view of its base where an ATen call stored that.  So does a broadcast of
            # smaller values that kernels read: stored here, it would be alive, larger than
            # what it reads, from here to the end.  And a value a reduction reads: stored at
            # the output, it joins the reduction's kernel as a stored prologue, or a pointwise
            # kernel of its own when the reduction is split (scheduler/split.py); stored here,
            # the reduction over few long rows was not split.)
            return self.realize(value, layout=_output_layout(meta))
        if not should_store(self, node, value):
            return value
        if node in self.output_nodes and getattr(value, "meta", None) is not None:
            # Also returned by the graph: stored once, in the strides it is returned with (the
            # backward was traced with them).  Stored dense, a padded view (Swin's attention
            # bias, sliced from the mask SDPA pads to 56 per row) came back in a second buffer
            # and the backward copied it into the padded strides again (+64 MiB at its start).
            layout = _output_layout(meta)
            if layout is not None:
                return self.realize(value, layout=layout)
        # channels-last where the convolutions reading it take it so (a channel shuffle's half,
        # whose own node says NCHW: else ATen copies it to channels-last in every call), or where
        # it is an intermediate computed from channels-last buffers only
        if value.ndim == 4 and ((readers and all(channels_last_conv(r) for r in readers)) or
                                (all(u.op != "output" for u in node.users) and channels_last_inputs(self, value))):
            return self.realize(value, layout=channels_last_layout(value.shape))
        if broadcast_only_for_kernels(self, node, value):
            return self.realize(value, layout=Layout(value.shape, contiguous_strides(value.shape)))
        return self.realize(value)

    def _fallback(self, node: fx.Node, reason: str) -> None:
        args, kwargs = self._args(node)
        if node.target in CONVOLUTIONS:
            self._realize_channels_last(node, args)
        if node.target in ATTENTION_BIAS_ARG:
            from .realize import aligned_attention_bias
            args, kwargs = aligned_attention_bias(self, node, args, kwargs)

        def to_ref(a: Any) -> Any:
            if isinstance(a, TensorValue):
                return self.as_buffer_ref(a)
            if isinstance(a, (list, tuple)):
                return type(a)(to_ref(x) for x in a)
            return a

        args, kwargs = to_ref(args), {k: to_ref(v) for k, v in kwargs.items()}
        val = meta_val(node)
        vals = list(val) if isinstance(val, (list, tuple)) else [val]
        outputs: list[str | None] = []
        values: list[Any] = []
        binds: list[tuple[str, str, int]] = []
        for v in vals:
            if isinstance(v, torch.Tensor):
                name = self.new_name()
                layout = layout_of(v)
                self.buffer_meta[name] = (layout.sizes, layout.strides, v.dtype, v.device)
                outputs.append(name)
                values.append(StridedValue(name, layout, v.dtype))
                for d, size in enumerate(v.shape):     # data-dependent sizes (nonzero, masked_select)
                    sname = _plain_symbol(size)
                    if sname is not None and sname not in self.symbols:
                        self.symbols[sname] = (-1, "runtime", 0)
                        binds.append((sname, name, d))
            elif isinstance(v, torch.SymInt) and _plain_symbol(v) and _plain_symbol(v) not in self.symbols:
                # a data-dependent int (e.g. .item()): the wrapper binds it by name after the call
                outputs.append(_plain_symbol(v))
                self.symbols[_plain_symbol(v)] = (-1, "runtime", 0)
                values.append(sym_to_node(v))
            elif isinstance(v, (torch.SymFloat, torch.SymBool)):
                raise Unsupported(f"{node.target} returns a data-dependent {type(v).__name__}")
            else:
                outputs.append(None)
                values.append(sym_to_node(v) if isinstance(v, (int, torch.SymInt)) and not isinstance(v, bool) else v)
        self.steps.append(FallbackCall(node.name, node.target, args, kwargs, outputs, reason, binds,
                                       multi=isinstance(val, (list, tuple))))
        self.fallback_reasons.append((node.name, str(node.target), reason))
        self.env[node] = type(val)(values) if isinstance(val, (list, tuple)) else values[0]

    def _lower_outputs(self, outs: list) -> list:
        """Lower graph outputs; an output that views another output's storage stays a view of it."""
        from torch.multiprocessing.reductions import StorageWeakRef
        results: list[Any] = [None] * len(outs)
        bases: dict[Any, tuple[fx.Node, str]] = {}
        order = sorted(range(len(outs)), key=lambda i: getattr(meta_val(outs[i]), "_base", None) is not None
                       if isinstance(outs[i], fx.Node) else True)
        for i in order:
            a = outs[i]
            meta = meta_val(a) if isinstance(a, fx.Node) else None
            key = None
            if isinstance(meta, torch.Tensor) and isinstance(self.env.get(a), ComputedValue):
                try:
                    key = StorageWeakRef(meta.untyped_storage())
                except Exception:
                    key = None
            if key is not None and key in bases:
                base_node, base_name = bases[key]
                bmeta = meta_val(base_node)
                blay = self.buffer_meta.get(base_name)
                if blay is not None and tuple(blay[0]) == shape_of(bmeta) and tuple(blay[1]) == layout_of(bmeta).strides:
                    try:
                        off = sym_to_node(meta.storage_offset()) - sym_to_node(bmeta.storage_offset())
                        name = self.new_name("view")
                        self.steps.append(AliasView(name, base_name, Layout(shape_of(meta), layout_of(meta).strides, off)))
                        results[i] = name
                        continue
                    except Unsupported:
                        pass
            results[i] = self._lower_output(a)
            if key is not None and isinstance(results[i], str) and results[i] in self.buffer_meta \
                    and _covers_storage(meta):
                # only a root (non-view) output may serve as the base others alias: a view's
                # buffer holds just its own elements, not the whole storage
                bases.setdefault(key, (a, results[i]))
        return results

    def _view_of_stored_base(self, node: fx.Node) -> StridedValue | None:
        """A view output (a saved transpose of a matmul operand) lowered while its base was
        still unstored, rebuilt as a view of the base's buffer where something (the matmul)
        stored the base since: else the output would be a second copy of it."""
        if not is_view(node) or not isinstance(node.args[0], fx.Node):
            return None
        base = node.args[0]
        stored = self.stored_form(self.env.get(base)) or self._view_of_stored_base(base)
        if stored is None:
            return None
        args, kwargs = self._args(node)
        current, self.current = self.current, node
        try:
            view = LOWERINGS[node.target](self, stored, *args[1:], **kwargs)
        except Unsupported:
            return None
        finally:
            self.current = current
        return view if isinstance(view, StridedValue) else None

    def _lower_output(self, a: Any) -> Any:
        if a is None:
            return None
        if not isinstance(a, fx.Node):
            return ("const", a)
        value = self.env[a]
        if isinstance(value, Node):
            return ("sym", value)
        if not isinstance(value, TensorValue):
            return ("const", value)
        if isinstance(value, ComputedValue):
            layout = _output_layout(meta_val(a))
            done = self.stored_form(value)     # stored for an ATen call that reads it
            if done is not None and (layout is None or done.layout == layout):
                value = done
            else:
                value = self._view_of_stored_base(a) or \
                    self.realize(value, layout=layout, origins=value.origins or [a.name])
        ref = self.as_buffer_ref(value)
        if ref.layout is None:
            return ref.buffer
        name = self.new_name("view")
        self.steps.append(AliasView(name, ref.buffer, ref.layout))
        return name




def _output_layout(meta: Any) -> Layout | None:
    """The layout a graph output is stored in: exactly eager's strides (even a non-dense view's),
    since AOTAutograd traced the backward graph, which may read this output, with them."""
    if isinstance(meta, torch.Tensor) and (is_dense(meta) or is_non_overlapping(meta)):
        return layout_of(meta)
    return None


_RUNTIME_CHECKS = {aten._assert_scalar.default, aten.sym_constrain_range_for_size.default,
                   aten._assert_tensor_metadata.default}


def _symfloat_to_node(v: "torch.SymFloat") -> Node:
    """A float computed from sizes (ToFloat(s0), an average's 1 / (N*H*W) as IntTrueDiv) as a
    float64 Node; anything else is unsupported."""
    hint = v.node.maybe_as_float() if hasattr(v.node, "maybe_as_float") else None
    if hint is not None:
        return const(hint, torch.float64)
    return _sympy_float_to_node(v.node.expr)


def _sympy_float_to_node(e: Any) -> Node:
    import sympy
    f64 = torch.float64
    name = type(e).__name__
    if isinstance(e, (sympy.Integer, sympy.Float, sympy.Rational)):
        return const(float(e), f64)
    if name == "ToFloat":
        return Node("cast", (sympy_to_node(e.args[0]),), f64, f64)
    if name == "IntTrueDiv":         # int / int in Python: a float quotient
        num, den = (Node("cast", (sympy_to_node(a),), f64, f64) for a in e.args)
        return op("truediv", num, den, dtype=f64)
    if name == "FloatTrueDiv":
        return op("truediv", _sympy_float_to_node(e.args[0]), _sympy_float_to_node(e.args[1]), dtype=f64)
    if isinstance(e, (sympy.Add, sympy.Mul)):
        name = "add" if isinstance(e, sympy.Add) else "mul"
        parts = [_sympy_float_to_node(a) if a.is_integer is not True
                 else Node("cast", (sympy_to_node(a),), f64, f64) for a in e.args]
        out = parts[0]
        for p in parts[1:]:
            out = op(name, out, p, dtype=f64)
        return out
    raise Unsupported(f"symbolic float {e}")


def _covers_storage(t: torch.Tensor) -> bool:
    """True when `t` is its storage's whole, dense content (so views of the storage are views of t)."""
    if any(isinstance(v, torch.SymInt) and v.node.maybe_as_int() is None for v in t.shape):
        return False                      # would install guards on symbolic sizes
    try:
        return (is_dense(t) and t.storage_offset() == 0
                and t.untyped_storage().nbytes() == t.numel() * t.element_size())
    except Exception:
        return False


def _plain_symbol(v: Any) -> str | None:
    """The name of a SymInt that is a bare symbol (s0, u0), else None."""
    if isinstance(v, torch.SymInt):
        import sympy
        expr = v.node.expr
        if isinstance(expr, sympy.Symbol):
            return expr.name
    return None


def _tag_origins(result: Any, name: str, args: Any) -> None:
    """Remember which fx nodes an unrealized value was built from (for reports and debugging)."""
    values = result if isinstance(result, (list, tuple)) else [result]
    inherited: list[str] = []

    def visit(a: Any) -> None:
        if isinstance(a, ComputedValue):
            inherited.extend(o for o in a.origins if o not in inherited)
        elif isinstance(a, (list, tuple)):
            for x in a:
                visit(x)
    visit(args)
    for v in values:
        if isinstance(v, ComputedValue) and not v.origins:
            v.origins = inherited + [name]


def lower_graph(gm: fx.GraphModule, config: Config) -> tuple[LoweredGraph, list[tuple[str, str, str]]]:
    """Lower `gm`; returns the program and (node, op, reason) for every ATen fallback."""
    from . import ops as lower_ops  # noqa: F401  (registers the op lowerings)
    lowering = GraphLowering(gm, config)
    program = lowering.run()
    for step in program.steps:
        if isinstance(step, ComputedBuffer) and step.name in _output_names(program):
            step.is_output = True
    return program, lowering.fallback_reasons


def _output_names(program: LoweredGraph) -> set[str]:
    names = {o for o in program.outputs if isinstance(o, str)}
    for s in program.steps:
        if isinstance(s, AliasView) and s.name in names:
            names.add(s.base)
    return names


# The dtypes both code generators read and write; an op touching any other (float8 formats,
# complex, uint16/32/64) runs through ATen, value for value as eager.
KERNEL_DTYPES = frozenset({torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32,
                           torch.int16, torch.int8, torch.uint8, torch.bool})


def _dtype_without_kernels(node: fx.Node) -> torch.dtype | None:
    """A tensor dtype among the node's inputs and outputs that no kernel can hold, if any."""
    values = [meta_val(node)] + [meta_val(a) for a in node.all_input_nodes]
    for v in values:
        for t in (v if isinstance(v, (list, tuple)) else (v,)):
            if isinstance(t, torch.Tensor) and t.dtype not in KERNEL_DTYPES:
                return t.dtype
    return None
