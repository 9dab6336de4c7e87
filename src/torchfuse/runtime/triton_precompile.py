"""Compile a graph's Triton kernels in parallel before its first call.

Triton compiles a kernel on its first launch, so a graph's first call compiles its kernels one
after another: 10-40 kernels of a model at 0.2-0.5 s each.  Here each kernel launch of the
generated wrapper is *planned* ahead of the call: the wrapper's launch expressions are
evaluated with the buffers replaced by their dtypes and the sizes by their example values, and
the launch helpers (triton_launch.py) hand over each planned launch instead of running it.
The planned launches are compiled by worker processes into Triton's disk cache
(compile_workers.py), then `kernel.warmup(...)` inside Triton's `AsyncCompileMode` loads them
here in a thread pool (and compiles whatever a worker could not: threads alone overlap only
about 2x, as Triton holds the GIL for much of a compile).  The first real launch then finds its
binary in the kernel's cache.

A guess that differs from the real launch (an unaligned input, a different size on the first
call, a run-time symbol with no example value) only costs that one kernel's compile on first
use, as before.  Skipped under the interpreter, with `autotune` (its timings must see real
launches), and on Triton builds without `AsyncCompileMode`.
"""
from __future__ import annotations

import logging
import os
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Iterable

import torch

from ..counters import counters
from . import triton_launch

log = logging.getLogger("torchfuse")


def _hint(v: Any) -> Any:
    if isinstance(v, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        hint = v.node.hint
        if hint is None:
            raise LookupError("no example value")
        return hint
    return v


def symbol_values(program: Any) -> dict[str, int]:
    """Example values of the graph's size symbols, read from its inputs' example (fake) values."""
    values: dict[str, int] = {}
    for name, (pos, kind, dim) in program.symbols.items():
        val = program.inputs[pos][1]
        try:
            if kind == "size":
                values[name] = int(_hint(val.shape[dim]))
            elif kind == "stride":
                values[name] = int(_hint(val.stride(dim)))
            elif kind != "runtime":
                values[name] = int(_hint(val))
        except (LookupError, TypeError, ValueError, AttributeError):
            continue      # unknown until run time: the launches using it are not planned
    return values


def plan_launches(calls: Iterable[tuple[str, list[tuple[str, str]]]], scope: dict[str, Any],
                  buffer_dtypes: dict[str, torch.dtype], symbols: dict[str, int]) -> list[tuple]:
    """The launches the wrapper's launch expressions `calls` (each with the symbol bindings
    evaluated before it) would make, as (kernel, grid, args, constexprs, warps, names), with
    dtypes in place of tensors.  Launches that cannot be planned are left out."""
    env: dict[str, Any] = dict(scope)
    env.update(buffer_dtypes)        # Triton's warmup takes a dtype where a tensor goes
    env.update(symbols)
    planned: list[tuple] = []
    with triton_launch.launch_hook(lambda *launch: planned.append(launch)):
        for call, bindings in calls:
            try:
                for sym, expr in bindings:
                    env[sym] = eval(expr, env)
                eval(call, env)
            except Exception as e:       # a guess we cannot make: compiled on first use instead
                log.debug("torchfuse: not precompiled: %s (%s: %s)", call, type(e).__name__, e)
    return planned


def precompile(launches: list[tuple], workers: int) -> int:
    """Compile the planned `launches` with `workers` worker processes (compile_workers.py), then
    load them in a pool of as many threads (cache hits by then; the threads compile whatever a
    worker could not); returns how many launches were planned."""
    if not launches or workers < 2 or not enabled():
        return 0
    import triton
    start, planned = time.perf_counter(), len(launches)
    if not triton_launch._trusted:
        # a model whose kernels are all too large to verify a launcher on uses the probe's
        launches = [*launches, triton_launch.probe_launch(torch.float32)]
    with counters.timed("precompile: workers"):
        _compile_in_workers(launches, workers)
    try:
        with ThreadPoolExecutor(workers, thread_name_prefix="torchfuse-compile") as pool:
            try:
                mode = triton.AsyncCompileMode(pool, ignore_errors=True)
            except TypeError:      # older Triton: no ignore_errors (a failure then surfaces below)
                mode = triton.AsyncCompileMode(pool)
            with mode:
                for kernel, grid, args, constexprs, warps, names in launches:
                    kernel.warmup(*args, grid=grid, **dict(zip(names, constexprs)), num_warps=warps)
    except Exception as e:        # a kernel that fails to compile fails again, with its error, on first use
        log.debug("torchfuse: parallel precompile stopped: %s: %s", type(e).__name__, e)
        return 0
    counters.bump("kernels_precompiled", planned)
    log.debug("torchfuse: precompiled %d Triton kernels with %d threads in %.2f s", planned, workers,
              time.perf_counter() - start)
    return planned


def _specialization(v: Any) -> Any:
    """What Triton specializes an argument on (ints: 1, divisible by 16, 32-bit range)."""
    if isinstance(v, bool) or not isinstance(v, int):
        return v
    return ("int", v == 1, v % 16 == 0, -2**31 <= v < 2**31)


def _compile_in_workers(launches: list[tuple], workers: int) -> None:
    from triton.runtime.driver import driver

    from . import compile_workers
    try:
        import triton
        target = driver.active.get_current_target()
        cache_dir = triton.knobs.cache.dir if hasattr(triton, "knobs") else None
    except Exception as e:      # no target to compile for: the threads compile everything
        log.debug("torchfuse: no compile workers: %s: %s", type(e).__name__, e)
        return
    jobs, seen = [], set()
    for kernel, grid, args, constexprs, warps, names in launches:
        key = (id(kernel), tuple(map(_specialization, args)), constexprs, warps)
        if key in seen:           # the same binary: aliases of one kernel, sizes Triton does not tell apart
            continue
        seen.add(key)
        job = compile_workers.job_for(kernel, grid, args, {**dict(zip(names, constexprs)), "num_warps": warps},
                                      target, cache_dir)
        if job is not None:
            jobs.append(job)
    answers = compile_workers.pool(workers).run(jobs)
    errors = [e for e, _ in answers if e]
    counters.bump("kernels_compiled_in_workers", len(jobs) - len(errors))
    if errors:
        log.debug("torchfuse: %d of %d worker compiles failed (compiled here instead), first: %s", len(errors),
                  len(jobs), errors[0])
    if answers:
        slowest = max(range(len(jobs)), key=lambda i: answers[i][1])
        log.debug("torchfuse: %d kernels compiled in %d workers, %.2f s in all, slowest %s (%.2f s)", len(jobs),
                  workers, sum(s for _, s in answers), jobs[slowest][2], answers[slowest][1])


def enabled() -> bool:
    """Parallel precompile applies to compiled Triton (not under the interpreter: nothing to compile)."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        return False
    import triton
    return hasattr(triton, "AsyncCompileMode")


def default_workers() -> int:
    return max(1, min(16, (os.cpu_count() or 1)))
