"""Tiered first calls: a graph whose kernels still compile in the background runs through ATen.

With `Config.first_calls="eager"`, a graph whose kernels are not ready when it is called (Triton
binaries compiled by worker processes on a GPU, a C++ library that g++ is still building) does not
wait for them: the call runs the graph's own aten graph (what torchfuse lowered, after its
passes) op by op through ATen, and returns what the compiled graph would, in its layout.  The
first call after the background compile ended switches to the compiled graph for good; from then
on a call costs one test of a local variable more than the compiled graph alone.

Nothing of it is silent: every call run this way is counted (counters["calls_tiered"], their
time under counters.seconds["first calls: ATen"]), each switch too ("tiered_switches", logged),
and a background compile that failed is reported at the switch as a failed build is anywhere
else: one warning and the graph runs eagerly from then on (counters["eager_fallbacks"]), or, in
strict mode, the error raises from that call.  `wait_compiled()` blocks until every background
compile of the process has ended (benchmarks time "until compiled" with it; a harness judging
compiled numerics sets first_calls="wait" instead).
"""
from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future
from typing import Any, Callable

import torch
import torch.fx as fx

from ..counters import counters

log = logging.getLogger("torchfuse")

_pending: set[Future] = set()
_pending_lock = threading.Lock()
_last_done: list[float] = [0.0]      # perf_counter() when the latest background compile ended


def track(future: Future) -> None:
    """Count `future` among the background compiles `wait_compiled` waits for."""
    with _pending_lock:
        _pending.add(future)

    def done(f: Future) -> None:
        with _pending_lock:
            _pending.discard(f)
            _last_done[0] = max(_last_done[0], time.perf_counter())
    future.add_done_callback(done)


def wait_compiled(timeout: float | None = None) -> float:
    """Wait until every graph's background kernel compile (Config.first_calls="eager") has ended,
    failed ones included; returns the time.perf_counter() at which the last one ended (0.0 when
    none ever ran).  The next call of each graph runs its kernels.  TimeoutError if `timeout`
    seconds pass first."""
    deadline = None if timeout is None else time.perf_counter() + timeout
    while True:
        with _pending_lock:
            futures = list(_pending)
        if not futures:
            return _last_done[0]
        for f in futures:
            left = None if deadline is None else max(0.0, deadline - time.perf_counter())
            try:
                f.exception(left)       # (a failure is the graph's to report, at its switch)
            except TimeoutError:
                raise TimeoutError(f"torchfuse: kernels still compiling after {timeout} s") from None
            with _pending_lock:
                _pending.discard(f)     # (its done callback may not have run yet)


def tiered(gm: fx.GraphModule, graph_name: str, compiled: Future, strict: bool,
           on_failure: Callable[[BaseException], Callable]) -> Callable:
    """A boxed callable that runs `gm` through ATen (`EagerTier`) while `compiled`, a Future of
    the compiled graph's boxed callable, is not done, and that callable from the first call
    after it is.  A failed `compiled` raises from that call in `strict` mode, else the callable
    `on_failure(error)` returns (it warns and runs the graph eagerly) takes over."""
    eager = EagerTier(gm)
    started = time.perf_counter()
    ready: list[float] = []
    target: Callable | None = None
    track(compiled)
    compiled.add_done_callback(lambda _: ready.append(time.perf_counter()))

    def switch() -> Callable:
        nonlocal target, on_failure
        try:
            call = compiled.result()
        except Exception as e:
            if strict:
                raise
            call = on_failure(e)
        else:
            log.info("torchfuse: %s runs its kernels from now on (compiled in the background in %.2f s; "
                     "%d call(s) ran through ATen meanwhile)", graph_name, (ready or [time.perf_counter()])[0] - started,
                     eager.calls)
            counters.bump("tiered_switches")
            eager.gm = on_failure = None     # (the aten graph and its constants are not needed again)
        target = call
        run._torchfuse_lib = getattr(call, "_torchfuse_lib", None)   # type: ignore[attr-defined]
        return call

    def run(args: list) -> Any:
        if target is not None:
            return target(args)
        if compiled.done():
            return switch()(args)
        return eager(args)

    run._boxed_call = True  # type: ignore[attr-defined]
    run._torchfuse_tier = eager  # type: ignore[attr-defined]
    run._torchfuse_compiled = compiled  # type: ignore[attr-defined]
    return run


class EagerTier:
    """The graph run through ATen, its outputs in the compiled graph's layout.

    The compiled graph allocates each output it computes with the strides of its node's example
    value (the wrapper's buffers), which ATen usually gives too; an output whose strides differ
    (static ones: known when the graph was compiled) is copied into those strides, unless it
    shares memory with an input or another output (a view the caller may rely on: AOTAutograd
    regenerates aliases of inputs itself).  Inputs the graph mutates (AOTAutograd's copy_ of
    kept input mutations) are written by the same ops the compiled graph runs."""

    def __init__(self, gm: fx.GraphModule):
        self.gm: fx.GraphModule | None = gm
        self.calls = 0
        self._layouts: list[tuple | None] | None = None

    def __call__(self, args: list) -> Any:
        start = time.perf_counter()
        try:
            out = self.gm(*args)
            if self._layouts is None:
                self._layouts = _static_layouts(self.gm)
            if isinstance(out, (tuple, list)) and any(
                    want is not None and isinstance(o, torch.Tensor) and _differs(o, want)
                    for o, want in zip(out, self._layouts)):
                out = type(out)(_restrided(list(out), self._layouts, args))
        finally:
            args.clear()
        self.calls += 1
        counters.bump("calls_tiered")
        counters.add_seconds("first calls: ATen", time.perf_counter() - start)
        return out


def _static_layouts(gm: fx.GraphModule) -> list[tuple | None]:
    """Per output of `gm`: (sizes, strides) of its example value where all are ints, else None."""
    output = gm.graph.output_node()
    values = output.args[0] if isinstance(output.args[0], (tuple, list)) else (output.args[0],)
    layouts: list[tuple | None] = []
    for v in values:
        val = v.meta.get("val") if isinstance(v, fx.Node) else None
        if isinstance(val, torch.Tensor) and all(type(s) is int for s in (*val.shape, *val.stride())):
            layouts.append((tuple(val.shape), tuple(val.stride())))
        else:
            layouts.append(None)
    return layouts


def _differs(t: torch.Tensor, want: tuple) -> bool:
    """Whether `t`'s layout differs from (sizes, strides) `want` where it matters: dims of size 1
    are never stepped over, and an empty tensor has no layout."""
    sizes, strides = want
    if tuple(t.shape) != sizes or t.numel() == 0:
        return False
    return any(size > 1 and a != b for size, a, b in zip(sizes, t.stride(), strides))


def _restrided(outs: list, layouts: list[tuple | None], args: list) -> list:
    def storage(t: Any) -> int | None:
        return t.untyped_storage().data_ptr() if isinstance(t, torch.Tensor) else None
    shared = [storage(a) for a in args] + [storage(o) for o in outs]
    for i, (o, want) in enumerate(zip(outs, layouts)):
        if want is None or not isinstance(o, torch.Tensor) or not _differs(o, want):
            continue
        ptr = storage(o)
        if shared.count(ptr) > 1 or ptr in shared[:len(args)]:
            continue
        copy = torch.empty_strided(want[0], want[1], dtype=o.dtype, device=o.device)
        outs[i] = copy.copy_(o)
    return outs

