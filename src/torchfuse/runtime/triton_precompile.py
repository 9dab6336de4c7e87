"""Compile a graph's Triton kernels in parallel before its first call.

Triton compiles a kernel on its first launch, so a graph's first call compiles its kernels one
after another: ~40 kernels of a transformer at 0.2-0.5 s each is most of a model's compile time.
Here each kernel launch of the generated wrapper is *planned* ahead of the call: the wrapper's
launch expressions are evaluated with the buffers replaced by their dtypes and the sizes by
their example values, and the launch helpers (triton_launch.py) hand each planned launch to
`kernel.warmup(...)` inside Triton's `AsyncCompileMode`, which compiles in a thread pool
(Triton releases the GIL while it compiles).  The first real launch then finds its binary in
the kernel's cache.

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
    """Compile the planned `launches` in a pool of `workers` threads; returns how many."""
    if not launches or workers < 2 or not enabled():
        return 0
    import triton
    start = time.perf_counter()
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
    counters.bump("kernels_precompiled", len(launches))
    log.debug("torchfuse: precompiled %d Triton kernels with %d threads in %.2f s", len(launches), workers,
              time.perf_counter() - start)
    return len(launches)


def enabled() -> bool:
    """Parallel precompile applies to compiled Triton (not under the interpreter: nothing to compile)."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        return False
    import triton
    return hasattr(triton, "AsyncCompileMode")


def default_workers() -> int:
    return max(1, min(16, (os.cpu_count() or 1)))
