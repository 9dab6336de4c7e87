"""The bottom of the lazy mode: what every other lazy module reads, importing none of them.

* the open lazy blocks of each thread (`open_contexts`, `current_context`);
* `LazyMode`, the dispatch mode type that marks a block on torch's mode stack, and taking our
  modes off that stack and putting them back (`pop_lazy_modes` / `push_modes`);
* `hooks`: the few functions a lower module calls in an upper one (a `LazyTensor` read outside
  its block runs `mode.eager_call`; reading its data flushes through `graph.flush`; ...).  Each
  upper module sets its hook when it is imported, and importing `torchfuse.lazy` imports them
  all, so imports point down only.
"""
from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any, Callable

from torch.utils._python_dispatch import TorchDispatchMode, _get_current_dispatch_mode, _pop_mode, _push_mode

if TYPE_CHECKING:
    from .context import LazyContext
    from .graph import LazyNode


class _State(threading.local):
    def __init__(self) -> None:
        self.contexts: list[LazyContext] = []   # open lazy blocks of this thread, innermost last


_state = _State()


def open_contexts() -> list["LazyContext"]:
    """The open lazy blocks of this thread, innermost last (the list itself: entering and
    leaving a block edit it)."""
    return _state.contexts


def current_context() -> "LazyContext | None":
    return _state.contexts[-1] if _state.contexts else None


class LazyMode(TorchDispatchMode):
    """The dispatch mode of an open lazy block.  Its handler is `mode._lazy_torch_dispatch`,
    assigned by mode.py (see there why not in the class body)."""

    def __init__(self, ctx: "LazyContext"):
        super().__init__()
        self.ctx = ctx


def pop_lazy_modes() -> list:
    """Pop our modes off the top of the dispatch mode stack (see `context.suspended`); returns
    them for `push_modes`.  Plain functions: flushes call this pair and a generator-based context
    manager costs microseconds."""
    popped = []
    while isinstance(_get_current_dispatch_mode(), LazyMode):
        popped.append(_pop_mode())
    return popped


def push_modes(popped: list) -> None:
    for m in reversed(popped):
        _push_mode(m)


def _unset(*args: Any, **kwargs: Any) -> Any:
    raise RuntimeError("torchfuse.lazy: a hook was called before its module was imported")


class Hooks:
    """Functions of upper modules that lower ones call, each set by its own module at import."""
    # mode.py: run an op eagerly on computed inputs (a LazyTensor's __torch_dispatch__)
    eager_call: Callable[..., Any]
    # graph.py: compute pending values (values, reason, block or None)
    flush: Callable[[list[tuple["LazyNode", int]], str, "LazyContext | None"], None]
    # mode.py: forget the recording plans (graph.clear_cache)
    clear_plans: Callable[[], None]
    # context.py: the block that logs flushes of values whose own block has ended
    default_context: Callable[[], "LazyContext"]

    def __init__(self) -> None:
        self.eager_call = self.flush = self.clear_plans = self.default_context = _unset


hooks = Hooks()
