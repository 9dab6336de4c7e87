"""mode="reduce-overhead": compiled graphs replayed through CUDA graphs, by PyTorch's CUDA graph
trees (`torch._inductor.cudagraph_trees`, a torch component any backend may call).

Why the trees and not a runner of our own: they already do what a user needs and what a private
runner got wrong.  Parameters, buffers and the activations a backward reads are captured in place
(their addresses are checked, not copied); other inputs are copied only into the graph's own
buffers; every graph of a device shares one memory pool, forward and backward included, so
memory does not grow with the number of captures; training steps are detected (and
`torch.compiler.cudagraph_mark_step_begin()` honoured).  The trees' rule for outputs applies: an
output lives in the pool and a later replay of the same graph overwrites it, so a caller keeping
one across steps clones it (the trees raise a clear error when an overwritten output is read).

What is decided here, testable without a GPU (`plan_capture`): which inputs are static, which
graphs cannot be captured and why (CPU tensors, several devices, data-dependent shapes, a
mutated input that is not a parameter or buffer), and the bound on captures per graph for
dynamic shapes.  A graph that cannot be captured runs as compiled, with one logged reason.
"""
from __future__ import annotations

import dataclasses
import logging
from typing import Any, Callable, Sequence

import torch
import torch.fx as fx

log = logging.getLogger("torchfuse.cudagraphs")


@dataclasses.dataclass(frozen=True)
class CapturePlan:
    """How one compiled graph is replayed: `skip` says why it is not captured (None: captured)."""
    kind: str                          # "inference", "forward" or "backward"
    static: tuple[int, ...]            # inputs captured at their address: never copied
    mutated: tuple[int, ...]           # inputs the graph writes
    device_index: int | None
    skip: str | None
    # per output, where it was made (the trees name it in their errors, and require the list)
    stack_traces: tuple[str | None, ...] = ()
    placeholders: tuple = ()           # the trees' PlaceholderInfo, for their mutation messages


@dataclasses.dataclass
class TrainingState:
    """Shared by the forward and backward graphs of one Dynamo graph: a backward whose forward
    was captured must tell the trees it runs even when it cannot be captured itself."""
    forward_captured: bool = False


def _val(node: fx.Node) -> Any:
    return node.meta.get("val", node.meta.get("fake_result"))


def _mutated_inputs(gm: fx.GraphModule) -> set[int]:
    """Positions of the placeholders some op writes (AOTAutograd's input mutations: copy_)."""
    from torch.multiprocessing.reductions import StorageWeakRef
    by_storage: dict[Any, set[int]] = {}
    mutated: set[int] = set()
    for pos, node in enumerate(gm.graph.find_nodes(op="placeholder")):
        val = _val(node)
        if isinstance(val, torch.Tensor):
            by_storage.setdefault(StorageWeakRef(val.untyped_storage()), set()).add(pos)
    for node in gm.graph.nodes:
        schema = getattr(node.target, "_schema", None) if node.op == "call_function" else None
        if schema is None or not schema.is_mutable:
            continue
        for i, arg in enumerate(schema.arguments):
            if arg.alias_info is None or not arg.alias_info.is_write:
                continue
            value = node.args[i] if i < len(node.args) else node.kwargs.get(arg.name)
            val = _val(value) if isinstance(value, fx.Node) else None
            if isinstance(val, torch.Tensor):
                mutated |= by_storage.get(StorageWeakRef(val.untyped_storage()), set())
    return mutated


def _data_dependent(node: fx.Node) -> bool:
    from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols
    val = _val(node)
    try:
        return val is not None and bool(free_unbacked_symbols(val))
    except Exception:      # a value the helper cannot walk (opaque objects): not a shape
        return False


def plan_capture(gm: fx.GraphModule, kind: str, static_inputs: Sequence[int]) -> CapturePlan:
    """Whether and how the compiled form of `gm` (the graph as lowered) is captured.

    `static_inputs`: for inference and forward graphs the parameters and buffers (AOTAutograd's
    static_input_indices; a hoisted value appended by passes/hoist_static counts as one); for
    a backward graph they are found here: every input that is not a tangent (the saved
    activations, captured by the forward's graph in the same pool)."""
    placeholders = list(gm.graph.find_nodes(op="placeholder"))
    if kind == "backward":
        static = {i for i, n in enumerate(placeholders) if "tangents" not in n.name}
    else:
        static = set(static_inputs)
    mutated = _mutated_inputs(gm)
    devices: dict[torch.device, str] = {}
    for node in gm.graph.nodes:
        val = _val(node)
        vals = val if isinstance(val, (list, tuple)) else (val,)
        for v in vals:
            if isinstance(v, torch.Tensor) and v.device.type != "meta":
                devices.setdefault(v.device, node.name)
    skip = None
    cuda = [d for d in devices if d.type == "cuda"]
    if not cuda:
        skip = "the graph has no CUDA tensors"
    elif any(d.type != "cuda" for d in devices):
        other = next(d for d in devices if d.type != "cuda")
        skip = f"it uses a {other.type} tensor ({devices[other]})"
    elif len(cuda) > 1:
        skip = f"it spans several devices ({', '.join(map(str, cuda))})"
    else:
        node = next((n for n in gm.graph.nodes if _data_dependent(n)), None)
        if node is not None:
            skip = f"{node.name} has a data-dependent shape"
        elif mutated - static:
            i = min(mutated - static)
            skip = f"it mutates input {i} ({placeholders[i].name}), which is not a parameter or buffer"
    outputs = next(iter(reversed(gm.graph.nodes))).args[0]
    outputs = outputs if isinstance(outputs, (list, tuple)) else (outputs,)
    traces = tuple(o.stack_trace if isinstance(o, fx.Node) else None for o in outputs)
    try:
        from torch._inductor.cudagraph_utils import get_placeholder_info
        placeholder_info = tuple(get_placeholder_info(gm.graph))
    except Exception:       # only for messages
        placeholder_info = ()
    return CapturePlan(kind, tuple(sorted(static)), tuple(sorted(mutated)),
                       cuda[0].index if len(cuda) == 1 else None, skip, traces, placeholder_info)


def size_key(args: Sequence[Any]) -> tuple:
    """What a new capture is made for: the integer (symbolic size) inputs, as the trees key them."""
    return tuple(a for a in args if isinstance(a, int) and not isinstance(a, bool))


class _Bounded:
    """At most `limit` captures (sizes) per graph; past it, new sizes run uncaptured, logged once."""

    def __init__(self, captured: Callable, plain: Callable, limit: int, name: str):
        # an instance attribute: Dynamo wraps a backward in functools.wraps, which copies the
        # instance's __dict__ but not its class's attributes
        self._boxed_call = True
        self.captured, self.plain, self.limit, self.name = captured, plain, limit, name
        self.keys: set[tuple] = set()
        self.warned = False

    def __call__(self, args: list) -> Any:
        key = size_key(args)
        if key not in self.keys:
            if len(self.keys) >= self.limit:
                if not self.warned:
                    log.warning("torchfuse: %s has been captured for %d sizes (cudagraph_max_sizes); "
                                "new sizes run without CUDA graphs", self.name, self.limit)
                    self.warned = True
                return self.plain(args)
            self.keys.add(key)
        return self.captured(args)


def wrap(call: Callable, plan: CapturePlan, state: TrainingState, max_sizes: int, name: str) -> Callable:
    """`call` (a boxed compiled graph) replayed through the CUDA graph trees as `plan` says."""
    from .static_values import StaticPrologue
    if isinstance(call, StaticPrologue):
        # the prologue keeps running in Python each call (it sees parameter updates); what it
        # hands on, the inputs plus the hoisted values, is what gets captured
        call.main = wrap(call.main, plan, state, max_sizes, name)
        return call
    if plan.skip is None:
        try:
            from torch._inductor import cudagraph_trees  # noqa: F401  (is it there?)
        except ImportError as e:
            plan = dataclasses.replace(plan, skip=f"torch's CUDA graph trees are unavailable ({e})")
    if plan.skip is not None:
        log.warning("torchfuse: %s runs without CUDA graphs: %s", name, plan.skip)
        if plan.kind == "backward" and state.forward_captured:
            return _running_backward(call, plan)
        return call
    if plan.kind == "forward":
        state.forward_captured = True
    captured = _deferred(call, plan)
    return _Bounded(captured, call, max_sizes, name) if max_sizes > 0 else captured


def _deferred(call: Callable, plan: CapturePlan) -> Callable:
    """The trees' capture made on the first real call (as Inductor does): integer inputs must be
    real sizes to key the captures by, not the symbols the graph was traced with."""
    from torch._inductor import cudagraph_trees
    captured: Callable | None = None

    def run(args: list) -> Any:
        nonlocal captured
        if captured is None:
            captured = cudagraph_trees.cudagraphify_impl(
                call, args, plan.static, device_index=plan.device_index, is_backward=plan.kind == "backward",
                is_inference=plan.kind == "inference", stack_traces=list(plan.stack_traces),
                placeholders=list(plan.placeholders), mutated_input_idxs=plan.mutated)
        return captured(args)

    run._boxed_call = True    # type: ignore[attr-defined]
    return run


def _running_backward(call: Callable, plan: CapturePlan) -> Callable:
    """A backward that cannot be captured, after a captured forward: the trees must know the
    backward ran, or they treat the next forward as a continuation of this step."""
    from torch._inductor import cudagraph_trees

    def run(args: list) -> Any:
        manager = cudagraph_trees.get_manager(plan.device_index or 0, create_if_none_exists=False)
        if manager is not None:
            manager.set_to_running_backward()
        return call(args)

    run._boxed_call = True    # type: ignore[attr-defined]
    return run
