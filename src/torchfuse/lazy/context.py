"""`torchfuse.lazy`: the context manager / decorator that turns on eager micro-fusion.

    with torchfuse.lazy() as ctx:          # or @torchfuse.lazy, or torchfuse.lazy(options={...})
        y = (x * 2 + 1).relu().sum(-1)     # recorded, not run
        z = y @ w                          # matmul is not fusible: y's ops are compiled and run
    print(ctx.flushes)                     # a table: why each flush happened, ops, kernels, ...

Every lazy block keeps its own log of flushes (`ctx.flushes`, `ctx.explain()`); with
`options={"debug": True}` compile_graph writes every compiled graph's stages to the debug folder
and the block writes its flush log there as `lazy_<n>.txt` when it ends.
"""
from __future__ import annotations

import contextlib
import functools
import itertools
import logging
import os
import weakref
from typing import Any, Callable, Iterator, Mapping

import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode, _pop_mode, _push_mode

from ..report import Explanation
from ..config import Config
from ..passes import check_names
from . import capture, trace
from .cache import config_token
from .graph import FlushLog, FlushRecord, LazyNode, flush
from .mode import LazyMode           # (from mode, not state: mode installs its dispatch handler)
from .state import hooks, open_contexts, pop_lazy_modes, push_modes
from .tensor import LazyTensor

log = logging.getLogger("torchfuse.lazy")

DEFAULT_MAX_NODES = 512
# On CUDA a block flushes what is pending every this many recorded ops (see `lazy(pipeline_ops=)`)
# once they write at least this many elements: below that the GPU work of a part is shorter
# than the cost of an extra flush (GPT-2 small at batch 1, seq 128 writes ~15M elements per
# 128 ops and lost 20% pipelined; at batch 8, seq 512, ~400M, and gained 26%).
DEFAULT_CUDA_PIPELINE_OPS = 128
CUDA_PIPELINE_MIN_WORK = 1 << 26
MAX_LOG = 20000
_ids = itertools.count()


_default: "LazyContext | None" = None


def default_context() -> "LazyContext":
    """Logs flushes of values whose block has ended (e.g. a flush at exit that failed)."""
    global _default
    if _default is None:
        _default = LazyContext()
    return _default


hooks.default_context = default_context


_CONFIGS: dict[tuple, Config] = {}
_ENV = ("TORCHFUSE_DEBUG", "TORCHFUSE_STRICT", "TORCHFUSE_CACHE_DIR", "XDG_CACHE_HOME", "HOME")


def _config(options: Mapping[str, Any] | None) -> Config:
    """Config.from_options, memoized: `with torchfuse.lazy():` around every forward pass would
    otherwise rebuild (and later re-hash) a Config each time.  Keyed by the options and the
    environment variables from_options reads."""
    try:
        key = (tuple(sorted((options or {}).items())), tuple(os.environ.get(v) for v in _ENV))
        hash(key)
    except TypeError:                   # unhashable option values: no memo
        config = Config.from_options(options)
        check_names(config.passes)
        return config
    config = _CONFIGS.get(key)
    if config is None:
        if len(_CONFIGS) > 256:
            _CONFIGS.clear()
        config = _CONFIGS[key] = Config.from_options(options)
        check_names(config.passes)
    return config


@contextlib.contextmanager
def suspended() -> Iterator[None]:
    """Run torch code without lazy recording (flushes, compiled graphs, printing): pop our modes
    off the top of the dispatch mode stack and put them back afterwards."""
    popped = pop_lazy_modes()
    try:
        yield
    finally:
        push_modes(popped)


class LazyContext:
    """One lazy block (reusable: each `with` / decorated call enters it again).

    `flushes`: a `FlushLog` (prints as a table) of a `FlushRecord` per flush; the
    newest MAX_LOG of them (`num_flushes` counts all).
    `report`: a `torchfuse.Explanation` with the graphs and kernels compiled for this block.
    """

    def __init__(self, options: Mapping[str, Any] | None = None, max_nodes: int = DEFAULT_MAX_NODES,
                 defer_matmuls: bool = True, dynamic: bool | None = True, pipeline_ops: int | None = None,
                 capture_modules: bool = True):
        self.config = _config(options)
        self.token = config_token(self.config)  # the config's part of compiled-graph cache keys
        self.max_nodes = max_nodes
        self.defer_matmuls = defer_matmuls      # record matmuls/attention/convolutions too
        self.dynamic = dynamic                  # symbolic sizes: True, False, None = from the 2nd size
        self.capture_modules = capture_modules  # top-level modules compiled from their 2nd call
        self.forced_fallbacks = frozenset(self.config.fallback_ops)
        self.flushes = FlushLog()               # the newest MAX_LOG flushes at most
        self.num_flushes = 0                    # all flushes, including those trimmed from the log
        self.report = Explanation()
        self.live: list[weakref.ref] = []       # wrappers handed out while pending
        self.recorded = 0                       # estimate of the pending graph's size (see mode)
        self.work = 0                           # elements written by the ops recorded since
                                                # the last flush (pipelining, see mode)
        # pipelining (see `lazy`): cut every `pipeline_ops` recorded ops; auto: on CUDA, from the
        # first time a part's work reaches pipeline_min_work; explicit: always, on every device
        auto = pipeline_ops is None
        self.pipeline_ops = (DEFAULT_CUDA_PIPELINE_OPS if auto else pipeline_ops) or max_nodes
        self.pipelining = not auto              # on: cut every pipeline_ops ops (see mode)
        # below this many recorded ops neither cut can be due: a predicted op skips the check
        self.flush_check_from = min(self.max_nodes, self.pipeline_ops)
        # the same for an op on a CPU tensor: only an explicit (or already started) pipelining
        # cuts at CPU ops (see mode._flush_first), so it can wait until max_nodes
        self.flush_check_from_cpu = self.flush_check_from if self.pipelining else self.max_nodes
        self.pipeline_min_work = CUDA_PIPELINE_MIN_WORK
        self.id = next(_ids)
        self.backward_task = -1                 # autograd graph task last seen recording (mode)
        # op prediction (see trace.py): nodes recorded since the last flush, the trie step of
        # the last one (None: prediction off until the next flush), ops predicted / not
        self.trace: list[LazyNode] = []
        self.cursor: trace.Step | None = trace.root_for(self)
        self.trace_hits = 0
        self.trace_misses = 0
        self._entered: list[tuple[LazyMode, LazyMode | None, bool]] = []

    # -- context manager / decorator -------------------------------------------------------
    def __enter__(self) -> "LazyContext":
        _install_print_guard()
        # Only one lazy mode on the stack: a nested block replaces the outer one until it ends
        # (values of the outer block stay pending and can be used inside).
        outer = _pop_mode() if isinstance(_get_current_dispatch_mode(), LazyMode) else None
        mode = LazyMode(self)
        _push_mode(mode)
        capturing = self.capture_modules
        self._entered.append((mode, outer, capturing))
        open_contexts().append(self)
        capture.block_entered(capturing)
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        mode, outer, capturing = self._entered.pop()
        current = _get_current_dispatch_mode()
        if current is mode:
            _pop_mode()
        elif current is not None:   # someone left a mode of their own on top of ours
            log.warning("torchfuse.lazy: dispatch modes were not exited in order")
        # (no mode at all: ours was taken off by a compiled backward or an optimizer step that
        # raised before putting it back)
        contexts = open_contexts()
        for i in range(len(contexts) - 1, -1, -1):
            if contexts[i] is self:
                del contexts[i]
                break
        capture.block_exited(capturing)
        try:
            self.flush_all("end of the lazy block")
        except Exception as e:
            if exc_type is None:
                raise
            if isinstance(e, exc_type):
                # the values whose flush raised in the block are still pending and fail alike
                # (an index out of range): the block's own error says it
                log.debug("torchfuse.lazy: flushing at the end of a block that raised failed again: %s", e)
            else:
                log.exception("torchfuse.lazy: flushing at the end of a block that raised failed")
        finally:
            if outer is not None:
                _push_mode(outer)
            self._write_debug_log()

    def __call__(self, fn: Callable) -> Callable:
        """Decorator: run `fn` inside this block.  Returned LazyTensors come back as the plain
        tensors computed for them (no autograd history is lost: those never require grad)."""
        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            with self:
                out = fn(*args, **kwargs)
            return torch.utils._pytree.tree_map_only(LazyTensor, _plain, out)
        wrapper.lazy_context = self  # type: ignore[attr-defined]
        return wrapper

    # -- flushing ----------------------------------------------------------------------------
    def pending_values(self) -> list[tuple[LazyNode, int]]:
        """(node, output) of every live wrapper of this block that is still pending; drops
        dead and computed entries from the list."""
        out, keep = [], []
        for ref in self.live:
            w = ref()
            if w is not None and w._lz_real is None and w._lz_node is not None:
                keep.append(ref)
                out.append((w._lz_node, w._lz_idx))
        self.live = keep
        return out

    def flush(self) -> None:
        """Compute every live pending value of this block now."""
        self.flush_all("ctx.flush()")

    def flush_all(self, reason: str) -> None:
        values = self.pending_values()
        self.recorded = self.work = 0
        if values:
            flush(values, reason, self)
        trace.reset(self)              # (also when nothing was pending: dead nodes only)

    def _track(self, refs: list) -> None:
        """Remember weak references to new pending wrappers (for the flush at exit)."""
        self.live.extend(refs)
        if len(self.live) > 4 * self.max_nodes:
            self.pending_values()         # prune

    def _log_flush(self, record: FlushRecord) -> None:
        self.log_module_call(record)
        self.recorded = len(self.pending_values())
        self.work = 0
        log.debug("lazy block %d: flush: %s", self.id, record)

    def log_module_call(self, record: FlushRecord) -> None:
        """A flush or a compiled module call (capture.py) in the flush log."""
        self.flushes.append(record)
        self.num_flushes += 1
        if len(self.flushes) > MAX_LOG:
            # A block that runs a long loop must not grow its log forever: keep the newest half.
            del self.flushes[:MAX_LOG // 2]

    def _log_compile(self, report: Explanation) -> None:
        self.report.graphs += report.graphs
        self.report.kernels += report.kernels
        self.report.fallbacks += report.fallbacks
        self.report.refused_fusions += report.refused_fusions
        self.report.passes += report.passes

    # -- reporting ---------------------------------------------------------------------------
    @property
    def kernels(self) -> int:
        """Kernels run by this block's flushes (compiled or taken from the cache)."""
        return sum(f.kernels for f in self.flushes)

    def explain(self) -> str:
        lines = [f"torchfuse.lazy block {self.id}: {len(self.flushes)} flush(es), "
                 f"{sum(f.ops for f in self.flushes)} op(s), {self.kernels} kernel launch(es), "
                 f"{sum(not f.cache_hit for f in self.flushes)} compiled graph(s)",
                 self.flushes.table(width=1000)]
        for i, f in enumerate(self.flushes):
            lines.append(f"  #{i} ops: {', '.join(f.op_names)}")
        if self.report.kernels:
            lines.append("kernels compiled:")
            lines += [f"  {k}" for k in self.report.kernels]
        return "\n".join(lines)

    def __repr__(self) -> str:
        return f"<torchfuse.lazy block {self.id}: {len(self.flushes)} flush(es)>"

    def _write_debug_log(self) -> None:
        if not self.config.debug or not self.flushes:
            return
        try:
            path = self.config.debug_dir
            path.mkdir(parents=True, exist_ok=True)
            (path / f"lazy_{self.id}.txt").write_text(self.explain() + "\n")
        except OSError as e:
            log.warning("torchfuse.lazy: could not write the debug log: %s", e)


def _plain(t: LazyTensor) -> torch.Tensor:
    if t._lz_real is not None and not t.requires_grad and t.grad_fn is None:
        return t._lz_real
    return t


def lazy(fn: Callable | None = None, *, options: Mapping[str, Any] | None = None,
         max_nodes: int = DEFAULT_MAX_NODES, defer_matmuls: bool = True, dynamic: bool | None = True,
         pipeline_ops: int | None = None, capture_modules: bool = True) -> Any:
    """Eager micro-fusion: inside the block fusible aten ops are recorded and compiled in
    batches by torchfuse when their results are needed.

    `with torchfuse.lazy() as ctx:` / `@torchfuse.lazy` / `@torchfuse.lazy(options={...})`.
    `options` are torchfuse's compile options (see `torchfuse.Config`); `max_nodes` bounds the
    number of ops recorded before everything pending is flushed.  `defer_matmuls` (default on)
    records matmuls, attention and convolutions too (they run through ATen inside the compiled
    graph); off, they run eagerly and force the pending values they read, one flush each.
    `dynamic`: True compiles graphs with symbolic sizes (a new batch size compiles nothing);
    None compiles static sizes first and symbolic ones from a structure's second size on
    (static C++ kernels are faster); False compiles every size separately.
    `pipeline_ops`: flush what is pending every this many recorded ops, so that a GPU runs the
    kernels of one part of a long block (a model's first layers) while Python records the next
    part; recording alone would leave it idle.  None (default): on CUDA, every
    DEFAULT_CUDA_PIPELINE_OPS ops from the first time such a part writes
    CUDA_PIPELINE_MIN_WORK elements or more (small work is not worth an extra flush; once on,
    a block stays on, so its cuts do not move with the sizes); off on CPU (C++ kernels run on
    the recording thread: nothing to overlap); 0: off; n: every n ops on every device.
    `capture_modules` (default on): a module called at the block's top level runs compiled
    (Dynamo + torchfuse, forward and backward) from its second call on (see `capture.py`); off,
    its ops are recorded one by one on every call.
    """
    if fn is not None:
        if not callable(fn):
            raise TypeError("torchfuse.lazy: pass options by keyword: torchfuse.lazy(options={...})")
        return LazyContext(options, max_nodes, defer_matmuls, dynamic, pipeline_ops, capture_modules)(fn)
    return LazyContext(options, max_nodes, defer_matmuls, dynamic, pipeline_ops, capture_modules)


# --------------------------------------------------------------------------------------------
# printing a plain tensor inside a block
# --------------------------------------------------------------------------------------------

_print_guard_installed = False


def _install_print_guard() -> None:
    """`print(x)` of a plain tensor formats it with a dozen small aten ops (abs, isfinite, max,
    item, ...).  Inside a lazy block they would be recorded and flushed one by one; format with
    the lazy mode suspended instead.  Outside lazy blocks the wrapper only checks a list."""
    global _print_guard_installed
    if _print_guard_installed:
        return
    import torch._tensor_str as ts
    original = ts._str

    @functools.wraps(original)
    def _str(self: torch.Tensor, *, tensor_contents: Any = None) -> str:
        if open_contexts():
            with suspended():
                return original(self, tensor_contents=tensor_contents)
        return original(self, tensor_contents=tensor_contents)
    ts._str = _str
    _print_guard_installed = True
