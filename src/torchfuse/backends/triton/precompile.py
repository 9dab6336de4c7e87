"""Compile a graph's Triton kernels in parallel before its first call.

Triton compiles a kernel on its first launch, so a graph's first call compiles its kernels one
after another: 10-40 kernels of a model at 0.2-0.5 s each.  Here each kernel launch of the
generated wrapper is *planned* ahead of the call: the wrapper's launch expressions are
evaluated with the buffers replaced by their dtypes and the sizes by their example values, and
the launch helpers (triton_launch.py) hand over each planned launch instead of running it.
The planned launches are compiled by worker processes into Triton's disk cache
(compile_workers.py), in the background: compiling goes on while Dynamo finishes the frame and
AOTAutograd lowers the next graph, and the graph's first call waits for it.  The first real
launch then finds its binary in Triton's disk cache.  Whatever a worker could not compile is
compiled here by `kernel.warmup(...)` inside Triton's `AsyncCompileMode`, in a thread pool
(threads alone overlap only about 2x, as Triton holds the GIL for much of a compile).

A guess that differs from the real launch (an unaligned input, a different size on the first
call, a run-time symbol with no example value) only costs that one kernel's compile on first
use, as before.  Skipped under the interpreter, with `autotune` (its timings must see real
launches), and on Triton builds without `AsyncCompileMode`.
"""
from __future__ import annotations

import functools
import logging
import os
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Iterable

import torch

from ...counters import counters
from . import launch as triton_launch

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


def precompile(launches: list[tuple], workers: int) -> Future | None:
    """Compile the planned `launches` with up to `workers` worker processes (compile_workers.py),
    in the background: the caller goes on (Dynamo builds its guards, AOTAutograd lowers the
    backward) and waits on the returned future before the graph's first launch; that wait
    compiles, in the waiting thread, the kernels no worker has taken yet (`_Pending`).  A launch
    no worker compiled is compiled in a pool of threads after them.  None: nothing to compile."""
    if not launches or workers < 2 or not enabled():
        return None
    planned = len(launches)
    if not triton_launch._trusted:
        # a model whose kernels are all too large to verify a launcher on uses the probe's
        launches = [*launches, triton_launch.probe_launch(torch.float32)]
    pending = _Pending()
    _background.submit(_settle, pending, launches, workers, planned)
    return pending


class _Pending(Future):
    """A graph's background compile.  Its first call waits here; meanwhile it compiles, in its
    own thread, each queued kernel no worker has taken: when the workers are still starting (a
    graph compiled soon after the process started) or fewer than the kernels, the waiting thread
    is the one free to compile, and a kernel compiled here is in memory for its first launch."""

    def __init__(self) -> None:
        super().__init__()
        self.batch = None                   # the worker jobs, once the background thread made them
        self._published = threading.Event()

    def publish(self, batch: Any) -> None:
        self.batch = batch
        self._published.set()

    def result(self, timeout: float | None = None) -> Any:
        while not self.done() and not self._published.wait(0.01):
            pass
        if self.batch is not None and not self.done():
            ran = self.batch.help()
            if ran:
                counters.bump("kernels_compiled_while_waiting", ran)
        return super().result(timeout)


def _settle(pending: _Pending, launches: list[tuple], workers: int, planned: int) -> None:
    try:
        pending.set_result(_compile(launches, workers, planned, pending))
    except BaseException as e:     # (_compile catches compile errors itself)
        pending.set_exception(e)
    finally:
        pending._published.set()


# A few graphs may compile at once (a forward's kernels while the backward is lowered); each
# waits on the worker processes, so these threads hold the GIL only briefly.
_background = ThreadPoolExecutor(4, thread_name_prefix="torchfuse-precompile")


def _compile(launches: list[tuple], workers: int, planned: int, pending: _Pending | None = None) -> int:
    """The background job: how many of the planned launches were compiled."""
    import triton
    start = time.perf_counter()
    try:
        left = _compile_in_workers(launches, workers, pending)
        counters.add_seconds("precompile: workers", time.perf_counter() - start)
        if left:
            with ThreadPoolExecutor(workers, thread_name_prefix="torchfuse-compile") as pool:
                try:
                    mode = triton.AsyncCompileMode(pool, ignore_errors=True)
                except TypeError:      # older Triton: no ignore_errors (a failure then surfaces below)
                    mode = triton.AsyncCompileMode(pool)
                with mode:
                    for kernel, grid, args, constexprs, warps, names in left:
                        kernel.warmup(*args, grid=grid, **dict(zip(names, constexprs)), num_warps=warps)
    except Exception as e:        # a kernel that fails to compile fails again, with its error, on first use
        log.debug("torchfuse: parallel precompile stopped: %s: %s", type(e).__name__, e)
        return 0
    counters.bump("kernels_precompiled", planned)
    log.debug("torchfuse: precompiled %d Triton kernels (%d in this process) in %.2f s", planned, len(left),
              time.perf_counter() - start)
    return planned


def _compile_here(launch: tuple) -> None:
    """The launch's binary compiled in this process (what a worker would have left in the cache)."""
    kernel, grid, args, constexprs, warps, names = launch
    kernel.warmup(*args, grid=grid, **dict(zip(names, constexprs)), num_warps=warps)


def _specialization(v: Any) -> Any:
    """What Triton specializes an argument on (ints: 1, divisible by 16, 32-bit range)."""
    if isinstance(v, bool) or not isinstance(v, int):
        return v
    return ("int", v == 1, v % 16 == 0, -2**31 <= v < 2**31)


def _compile_in_workers(launches: list[tuple], workers: int, pending: _Pending | None = None) -> list[tuple]:
    """Compile the launches' binaries in the worker processes (or in the thread waiting on
    `pending`); returns the launches not compiled (no job could be made, or the worker failed)."""
    from triton.runtime.driver import driver

    from . import compile_workers
    try:
        import triton
        target = driver.active.get_current_target()
        cache_dir = triton.knobs.cache.dir if hasattr(triton, "knobs") else None
    except Exception as e:      # no target to compile for: the threads compile everything
        log.debug("torchfuse: no compile workers: %s: %s", type(e).__name__, e)
        return launches
    settings = compile_workers.triton_settings(target)
    jobs, job_launches, left, seen = [], [], [], set()
    for launch in launches:
        kernel, grid, args, constexprs, warps, names = launch
        key = (id(kernel), tuple(map(_specialization, args)), constexprs, warps)
        if key in seen:           # the same binary: aliases of one kernel, sizes Triton does not tell apart
            continue
        seen.add(key)
        job = compile_workers.job_for(kernel, grid, args, {**dict(zip(names, constexprs)), "num_warps": warps},
                                      target, cache_dir, settings)
        if job is None:
            left.append(launch)
        else:
            jobs.append(job)
            job_launches.append(launch)
    pool = compile_workers.pool(workers)
    batch = pool.submit(jobs, [functools.partial(_compile_here, launch) for launch in job_launches])
    if pending is not None:
        pending.publish(batch)
    answers = pool.wait(batch)
    # (a kernel that failed in the waiting thread fails again, with its error, on first launch)
    left += [launch for launch, (error, _) in zip(job_launches, answers) if error and not error.startswith("in-process")]
    errors = [e for e, _ in answers if e]
    from .launch_probe import probe
    counters.bump("kernels_compiled_in_workers", sum(1 for launch, task in zip(job_launches, batch.tasks)
                                                     if task.by_worker and not task.answer[0]
                                                     and launch[0] is not probe))
    if errors:
        log.debug("torchfuse: %d of %d worker compiles failed (compiled here instead), first: %s", len(errors),
                  len(jobs), errors[0])
    if answers:
        slowest = max(range(len(jobs)), key=lambda i: answers[i][1])
        log.debug("torchfuse: %d kernels compiled in %d workers, %.2f s in all, slowest %s (%.2f s)", len(jobs),
                  workers, sum(s for _, s in answers), jobs[slowest][2], answers[slowest][1])
    return left


def enabled() -> bool:
    """Parallel precompile applies to compiled Triton (not under the interpreter: nothing to compile)."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        return False
    import triton
    return hasattr(triton, "AsyncCompileMode")


def default_workers() -> int:
    """Compile workers for this process: its share of the cores it may run on, at most 16.  Ranks
    of a distributed job on one host (torchrun's LOCAL_WORLD_SIZE, else the GPUs an initialized
    process group spreads over) split the cores: sixteen workers per rank (4 ranks x 16 on 64
    cores) would compete with the ranks' own host work, which sets the pace of tensor-parallel
    steps."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):      # (not on Linux)
        cores = os.cpu_count() or 1
    return max(1, min(16, cores // local_processes()))


def local_processes() -> int:
    """Processes of this job that share the host's cores: LOCAL_WORLD_SIZE (torchrun), else the
    ranks of an initialized process group up to the visible GPUs (mp.spawn sets no variable),
    else 1."""
    local = os.environ.get("LOCAL_WORLD_SIZE", "")
    if local.isdigit() and int(local) > 0:
        return int(local)
    import torch.distributed as dist
    if dist.is_available() and dist.is_initialized():
        return max(1, min(dist.get_world_size(), torch.cuda.device_count() or dist.get_world_size()))
    return 1
