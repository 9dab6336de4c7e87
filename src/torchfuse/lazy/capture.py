"""Module capture: a module called again at the top of a lazy block runs as compiled graphs.

Recording aten ops one by one costs at least what a TorchDispatchMode that only runs each op
costs, and on real models that floor alone is slower than eager (0.54-0.62x of eager GPT-2 and
Llama forwards on an H100 host; BENCHMARKS.md, "Lazy mode").  No recording design gets past it:
only not seeing the ops one by one does.  So inside a lazy block, a module called at the block's
top level (not from inside another module's forward) is recorded op by op on its first call,
like any code, and from its second call runs through `torch.compile` with torchfuse's backend
and the block's Config: Dynamo captures its forward once (guards re-check every call; new batch
sizes recompile at most once), and AOTAutograd compiles its backward.  The rest of the block
(a loss, an optimizer step, code between modules) is still recorded and fused lazily.

How:
* While any lazy block is open a global forward pre-hook sees the calls of modules that are not
  inside a module already seen (`_pre_hook`), and arms each at its first call, for its second: its
  `_compiled_call_impl` (the slot `nn.Module.compile()` uses, read by `nn.Module.__call__`) is a
  `_CapturedCall`; when the last block closes, armed modules are disarmed, so code outside lazy
  blocks (a later `torch.compile(model)` included) sees the module as it was.
* A captured call computes the pending LazyTensors it is given (one flush), takes the lazy mode
  off the dispatch stack, runs the compiled module on plain tensors and puts the mode back; its
  outputs are plain tensors, which later ops record lazily as usual.  Inputs that carry autograd
  history as LazyTensors are not captured (the call records op by op).
* Backward: autograd calls the compiled graphs' backward nodes from inside the block (the lazy
  mode is on), so each `CompiledFunctionBackward` node created by the call gets a pre-hook that
  computes the gradients it is given and takes the lazy mode off, and a post-hook that puts it
  back: AOTAutograd's backward (its lazy compile included) runs on plain tensors.
* A module whose first compiled call fails in Dynamo or the backend is recorded op by op from
  then on, with one warning.
* Optimizer steps run outside the lazy mode too (global step pre/post hooks): their in-place
  updates of parameters and state ran eagerly anyway, each op paying the mode's dispatch (~30 us
  an op on the CPU, one op per parameter for a for-loop optimizer).  Everything pending is
  computed first, so no pending value sees the updated weights.

`lazy(capture_modules=False)` turns this off (every op recorded, as before).
"""
from __future__ import annotations

import logging
import threading
import time
import weakref
from typing import TYPE_CHECKING, Any, Callable

import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode
from torch.utils._pytree import tree_flatten, tree_map_only

from .graph import FlushRecord, flush
from .state import LazyMode, current_context, pop_lazy_modes, push_modes
from .tensor import LazyTensor, materialize, unwrap

if TYPE_CHECKING:
    from .context import LazyContext

log = logging.getLogger("torchfuse.lazy")

_lock = threading.Lock()
_open_blocks = 0                        # lazy blocks open in all threads
_capturing = 0                          # of those, blocks with capture_modules on
_states: "weakref.WeakKeyDictionary[torch.nn.Module, _ModuleState]" = weakref.WeakKeyDictionary()
_inner: "weakref.WeakSet[torch.nn.Module]" = weakref.WeakSet()     # submodules of counted modules
_armed: "weakref.WeakSet[torch.nn.Module]" = weakref.WeakSet()     # modules whose call is captured


class _ModuleState:
    """What the lazy mode knows of one top-level module: compiled callables (one per Config),
    compiled calls made, and whether capturing it failed."""
    __slots__ = ("compiled", "failed", "compiled_calls", "__weakref__")

    def __init__(self) -> None:
        self.compiled: dict[str, Callable] = {}
        self.failed = False
        self.compiled_calls = 0


# (torch's hook dict, key, hook) of each global hook, the forward pre-hook first: registered
# once, through torch's API; then a block that is the only one open puts them back by key and
# the last to close takes them out, 0.1 us each instead of a registration's 1.2 us (a
# `with torchfuse.lazy():` around a few ops pays this every time).
_hook_slots: list[tuple[Any, int, Callable]] = []


def _install_hooks() -> None:
    if not _hook_slots:
        from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook
        for fn, register in ((_pre_hook, torch.nn.modules.module.register_module_forward_pre_hook),
                             (_enter_optimizer_step, register_optimizer_step_pre_hook),
                             (_leave_optimizer_step, register_optimizer_step_post_hook)):
            handle = register(fn)
            _hook_slots.append((handle.hooks_dict_ref(), handle.id, fn))
        _remove_hooks()
    for hooks, key, fn in _hook_slots if _capturing else _hook_slots[1:]:
        hooks[key] = fn


def _set_pre_hook(on: bool) -> None:
    hooks, key, fn = _hook_slots[0]
    if on:
        hooks[key] = fn
    else:
        hooks.pop(key, None)


def _remove_hooks() -> None:
    for hooks, key, _ in _hook_slots:
        hooks.pop(key, None)


def block_entered(capturing: bool) -> None:
    """A lazy block opened (`capturing`: with capture_modules on): install the hooks and re-arm
    captured modules (first open block).  The forward pre-hook only while a capturing block is
    open: any global module hook sends every module call through nn.Module's slow path
    (1-2 us more a call on the CPU), which a block that records every op would pay for nothing."""
    global _open_blocks, _capturing
    with _lock:
        _open_blocks += 1
        if capturing:
            _capturing += 1
            if _capturing == 1 and _open_blocks > 1:
                _set_pre_hook(True)
        if _open_blocks > 1:
            return
        _install_hooks()
        if _armed:
            for module in list(_armed):
                if module._compiled_call_impl is None:
                    module._compiled_call_impl = _CapturedCall(module)


def block_exited(capturing: bool) -> None:
    """A lazy block closed: the last one removes the hooks and disarms captured modules."""
    global _open_blocks, _capturing
    with _lock:
        _open_blocks -= 1
        if capturing:
            _capturing -= 1
            if _capturing == 0 and _open_blocks > 0:
                _set_pre_hook(False)
        if _open_blocks > 0:
            return
        _remove_hooks()
        if _armed:
            for module in list(_armed):
                if isinstance(module._compiled_call_impl, _CapturedCall):
                    module._compiled_call_impl = None


def _pre_hook(module: torch.nn.Module, args: Any) -> None:
    """Arms a top-level module called inside a lazy block at its first call (for its next)."""
    if module in _inner:
        return None
    ctx = current_context()
    if ctx is None or not ctx.capture_modules or torch.compiler.is_compiling():
        return None
    state = _states.get(module)
    if state is None:
        state = _states[module] = _ModuleState()
        for sub in module.modules():
            if sub is not module:
                _inner.add(sub)
    if not state.failed and module not in _armed and module._compiled_call_impl is None:
        _armed.add(module)
        module._compiled_call_impl = _CapturedCall(module)   # from the next call on
    return None


class _CapturedCall:
    """`module._compiled_call_impl` of an armed module: the compiled call inside a lazy block,
    the module's own `_call_impl` anywhere else."""
    __slots__ = ("module",)

    def __init__(self, module: torch.nn.Module):
        self.module = weakref.ref(module)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        module = self.module()
        ctx = current_context()
        state = _states.get(module) if module is not None else None
        if (ctx is None or state is None or state.failed or not ctx.capture_modules
                or torch.compiler.is_compiling() or not _lazy_mode_on_top()):
            return module._call_impl(*args, **kwargs)
        leaves, _ = tree_flatten((args, kwargs))
        lazy_inputs = [t for t in leaves if isinstance(t, LazyTensor)]
        if any(t.requires_grad for t in lazy_inputs):
            return module._call_impl(*args, **kwargs)   # keep its autograd history: record it
        if lazy_inputs:
            _compute(lazy_inputs, ctx, f"inputs of a compiled {type(module).__name__} call")
            args, kwargs = tree_map_only(LazyTensor, _plain, (args, kwargs))
        return _run_compiled(module, state, ctx, args, kwargs)


def _run_compiled(module: torch.nn.Module, state: _ModuleState, ctx: "LazyContext",
                  args: tuple, kwargs: dict) -> Any:
    compiled = state.compiled.get(ctx.token)
    if compiled is None:
        compiled = state.compiled[ctx.token] = _compile(module, ctx)
    first = state.compiled_calls == 0
    popped = pop_lazy_modes()
    hooked = _remove_hook()          # Dynamo traces the module without the arming hook
    sequence = _sequence_nr()
    t0 = time.perf_counter()
    try:
        out = compiled(*args, **kwargs)
    except torch._dynamo.exc.TorchDynamoException as e:
        if not first or ctx.config.strict:
            raise
        state.failed = True
        log.warning("torchfuse.lazy: compiling %s's forward failed (%s: %s); its calls are recorded "
                    "op by op instead", type(module).__name__, type(e).__name__, e)
        push_modes(popped)
        popped = []
        return module._call_impl(*args, **kwargs)
    finally:
        _restore_hook(hooked)
        push_modes(popped)
    ms = (time.perf_counter() - t0) * 1e3
    state.compiled_calls += 1
    if torch.is_grad_enabled():
        _guard_backward(out, sequence)
    outputs = sum(isinstance(t, torch.Tensor) for t in tree_flatten(out)[0])
    ctx.log_module_call(FlushRecord(f"compiled {type(module).__name__} call", 0, outputs, 0,
                                    cache_hit=not first, graph="module", ms=ms))
    return out


def _compile(module: torch.nn.Module, ctx: "LazyContext") -> Callable:
    # imported at the first capture: the Dynamo frontend takes ~2 s to import, which
    # `import torchfuse` does not pay
    from ..frontend.dynamo import TorchfuseBackend
    ref = weakref.ref(module)

    def call(*args: Any, **kwargs: Any) -> Any:
        return ref()(*args, **kwargs)
    # A function around the call, not the module: Dynamo then inlines the module's forward and
    # never reads `_compiled_call_impl`, which holds this capture.  Each module's function gets
    # a code object of its own: Dynamo keeps compiled entries per code object, and modules
    # sharing one would share its recompile limit (8), the ninth module running eagerly.
    call.__code__ = call.__code__.replace(co_name=f"captured_{type(module).__name__}")
    return torch.compile(call, backend=TorchfuseBackend(ctx.config), dynamic=ctx.dynamic)


def _lazy_mode_on_top() -> bool:
    return isinstance(_get_current_dispatch_mode(), LazyMode)


def _compute(values: list[LazyTensor], ctx: "LazyContext", reason: str) -> None:
    """Compute the pending ones of `values` in one flush."""
    pending = [(t._lz_node, t._lz_idx) for t in values if t._lz_real is None and t._lz_node is not None]
    if pending:
        flush(pending, reason, ctx)


def _plain(t: LazyTensor) -> torch.Tensor:
    return materialize(t, "a compiled module call")


def _remove_hook() -> bool:
    """Take the global forward pre-hook out while blocks are open; True if it was in."""
    with _lock:
        if not _hook_slots:
            return False
        hooks, key, _ = _hook_slots[0]
        return hooks.pop(key, None) is not None


def _restore_hook(removed: bool) -> None:
    if not removed:
        return
    with _lock:
        if _capturing > 0:
            hooks, key, fn = _hook_slots[0]
            hooks[key] = fn


def _sequence_nr() -> int | None:
    get = getattr(torch._C._autograd, "_get_sequence_nr", None)
    return get() if get is not None else None


# --------------------------------------------------------------------------------------------
# the backward of a compiled call runs outside the lazy mode
# --------------------------------------------------------------------------------------------

MAX_WALK = 100_000              # nodes visited looking for compiled backward nodes (no sequence_nr)


class _Popped(threading.local):
    def __init__(self) -> None:
        self.stack: list[list] = []


_popped = _Popped()


def _guard_backward(out: Any, sequence: int | None) -> None:
    """Hook every compiled backward node created since autograd's `sequence` number (the
    compiled graphs' and, across graph breaks, those behind the eager ops between them)."""
    todo = [t.grad_fn for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor) and t.grad_fn is not None]
    seen: set[int] = set()
    while todo and len(seen) < MAX_WALK:
        node = todo.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        name = type(node).__name__
        if name == "AccumulateGrad":
            continue
        if sequence is not None and node._sequence_nr() < sequence:
            continue                # made before this call
        if name.startswith("CompiledFunction"):
            node.register_prehook(_enter_compiled_backward)
            node.register_hook(_leave_compiled_backward)
            continue
        todo.extend(n for n, _ in node.next_functions)


def _enter_compiled_backward(grad_outputs: tuple) -> tuple | None:
    _popped.stack.append(pop_lazy_modes())
    if not any(isinstance(g, LazyTensor) for g in grad_outputs):
        return None
    return tuple(unwrap(g, "gradients into a compiled backward") for g in grad_outputs)


def _leave_compiled_backward(grad_inputs: tuple, grad_outputs: tuple) -> None:
    if _popped.stack:
        push_modes(_popped.stack.pop())


# --------------------------------------------------------------------------------------------
# optimizer steps run outside the lazy mode
# --------------------------------------------------------------------------------------------

def _enter_optimizer_step(optimizer: Any, args: Any, kwargs: Any) -> None:
    ctx = current_context()
    if ctx is None or not _lazy_mode_on_top():
        _popped.stack.append([])
        return None
    ctx.flush_all("an optimizer step")
    _popped.stack.append(pop_lazy_modes())
    return None


def _leave_optimizer_step(optimizer: Any, args: Any, kwargs: Any) -> None:
    if _popped.stack:
        push_modes(_popped.stack.pop())
