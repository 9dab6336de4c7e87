"""Triton kernels compiled in worker processes, into Triton's on-disk cache.

Triton's compiler holds the GIL for much of a compile (its Python front end and the MLIR
passes), so the threads of `AsyncCompileMode` overlapped about 2x: GPT-2's 31 kernels took 3.1 s
with 16 threads on the lent H100 host, against 6 s one after another.  Here each planned launch
(triton_precompile.py) goes to one of a few long-lived worker processes, which compile it with
`kernel.warmup(...)` (and, on Triton 3.6, builds its C launcher); the parent then finds each
binary in Triton's cache and loads it in milliseconds.

Workers never touch the GPU.  They compile for the parent's target through `_TargetOnlyDriver`,
which answers the three questions `warmup` asks of Triton's driver (device 0, stream 0, the
parent's `GPUTarget`) and raises on anything else.  Anything a worker could not compile is
compiled by the parent as before, so a failing or missing worker costs time, never results.

Workers are started with `subprocess` (fork + exec of a fresh interpreter): forking a process
that has CUDA and threads running is not safe, and multiprocessing's spawn would re-import the
user's `__main__`.  They read pickled jobs on stdin and answer on a private copy of stdout; stray
prints go to stderr, which is discarded.  They exit when the parent closes their stdin (the
pool closes at interpreter exit).

The pool's start is kept off the first call's path: a few workers (EARLY_WORKERS) start while
AOTAutograd traces the graph (frontend/graph_compile.py `workers_start_early`), each tells the
parent when it is ready (imported Triton, compiled a warm-up kernel), and only then takes jobs,
from one queue shared by all; more start when a graph's kernels outnumber the free workers
(`WorkerPool.submit`), and the first call's wait compiles, in its own thread, what no worker
will take sooner (`Batch.help`).

Workers do not import torch (nor torchfuse: this file runs as a script).  Importing torch took
~2 s of a worker's start, and 16 workers starting at once took longer: a model's first call
waited for them (the H200 host: 2.6-4.4 s of precompile for 12-33 kernels).  A job therefore
names a tensor argument's dtype by its name (`("*", "bfloat16")`), and the worker hands Triton
a stand-in with that dtype, as Triton's own `MockTensor` does for `warmup`; Triton specializes
on the dtype's name, so the binary and its cache key are the ones the parent asks for.  Should
a Triton refuse the stand-in, the worker imports torch and uses real dtypes.

A binary's cache key reads Triton's settings (its knobs: environment variables such as
`TRITON_PTXAS_PATH`, or values set in code such as `knobs.nvidia.libdevice_path`) and the
backend's hash (ptxas's version, which Triton reads once per process and keeps).  Other code in
the process changes them: Inductor points Triton at torch's own ptxas after its first compile
asked for the version.  A worker then keyed its binaries by another ptxas than the parent
remembered, the parent never found them and compiled every kernel again, one at a time (a
MobileNetV3 training step compiled after Inductor's: 45 s, not 20).  So each job carries the
parent's settings and backend hash (`triton_settings`), and the worker takes both.
"""
from __future__ import annotations

import atexit
import contextlib
import logging
import os
import pickle
import queue
import select
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable, Sequence

log = logging.getLogger("torchfuse")

# (module file, module name, kernel name, args (("*", dtype name) for tensors), grid, keyword arguments,
#  GPUTarget, Triton cache dir or None[, Triton settings (triton_settings)])
Job = tuple

JOB_TIMEOUT = 300.0     # seconds a worker may take for one kernel before it is killed
READY_TIMEOUT = 120.0   # seconds a new worker may take to import Triton and compile its warm-up kernel
START_ATTEMPTS = 3      # a worker that failed to start this many times in a row is given up

# Sizing, from timings of one worker (benchmarks/probes/worker_start.py): a fresh worker is ready
# (interpreter, `import triton`, one warm-up compile) after ~1 s; a job then takes 0.1-0.5 s,
# and the first compile in a process that never compiled costs ~0.5 s more.  A worker started
# for a batch therefore pays for itself only from about its second job, and workers started
# ahead of the graph (EARLY_WORKERS, while Dynamo and AOTAutograd run) are worth more than
# workers started once the jobs are known.
EARLY_WORKERS = 4
JOBS_PER_NEW_WORKER = 2


class Task:
    """One job of a `Batch`, done by whoever claims it first: a worker, or the thread waiting for
    the batch (`Batch.help`), which runs `local` instead."""

    __slots__ = ("job", "local", "answer", "claimed", "by_worker")

    def __init__(self, job: Job, local: Callable[[], Any] | None):
        self.job, self.local = job, local
        self.answer: tuple[str | None, float] | None = None
        self.claimed = False
        self.by_worker = False


class Batch:
    """Jobs submitted together (one graph's kernels); `answers` in their order once `wait` ends."""

    def __init__(self, jobs: Sequence[Job], local: Sequence[Callable[[], Any] | None] | None = None):
        self.tasks = [Task(job, fn) for job, fn in zip(jobs, local or [None] * len(jobs))]
        self._lock = threading.Lock()
        self._left = len(self.tasks)
        self._done = threading.Event()
        self.helping = False
        self.busy_workers: Callable[[], int] = lambda: 0     # started workers busy on a job (the pool's)
        if not self.tasks:
            self._done.set()

    def claim(self, task: Task) -> bool:
        with self._lock:
            if task.claimed:
                return False
            task.claimed = True
            return True

    def finish(self, task: Task, answer: tuple[str | None, float]) -> None:
        with self._lock:
            task.answer = answer
            self._left -= 1
            if self._left == 0:
                self._done.set()

    def cancel(self, reason: str) -> None:
        """Answer every job nobody claimed with `reason` (the caller compiles those itself),
        but those a thread helping (`help`) will run."""
        for task in self.tasks:
            if (task.local is None or not self.helping) and self.claim(task):
                self.finish(task, (reason, 0.0))

    def help(self) -> int:
        """Run, in this thread, the jobs that no worker will take sooner: the waiting thread has
        nothing else to do.  A job still queued means no worker was free; a worker busy on a
        job takes the next in 0.1-0.5 s, sooner than this process compiles it (its first
        compile ~1 s: benchmarks/probes/worker_start.py), while a worker still starting is about
        as far off; so this thread takes the queued jobs beyond one per busy, started worker.
        Returns how many ran here."""
        ran = 0
        self.helping = True
        while not self.done():
            queued = [t for t in self.tasks if t.local is not None and not t.claimed]
            if not queued:
                break
            if len(queued) <= self.busy_workers() or not self.claim(queued[0]):
                self._done.wait(0.01)
                continue
            task = queued[0]
            start = time.perf_counter()
            try:
                task.local()
                error = None
            except Exception as e:     # the kernel fails again, with its error, on first launch
                error = f"in-process: {type(e).__name__}: {e}"
            self.finish(task, (error, time.perf_counter() - start))
            ran += 1
        return ran

    def done(self) -> bool:
        return self._done.is_set()

    def wait(self, timeout: float | None = None) -> bool:
        return self._done.wait(timeout)

    def answers(self) -> list[tuple[str | None, float]]:
        return [task.answer or ("not compiled", 0.0) for task in self.tasks]


class _Worker:
    """One worker process and the thread that feeds it jobs from the pool's queue."""

    def __init__(self, owner: "WorkerPool", target: Any):
        self.owner, self.target = owner, target
        self.proc: subprocess.Popen | None = None
        self.busy = False          # holds a job (a worker still starting holds none)
        self.gone = False          # could not be started: given up
        self.ready = threading.Event()     # its process answered that it is ready for jobs
        self.thread = threading.Thread(target=self._serve, name="torchfuse-worker", daemon=True)

    def _serve(self) -> None:
        failed_starts = 0
        while True:
            if not _alive(self.proc):
                if self.owner._closed:
                    self._kill()
                    return
                try:
                    self.proc = _spawn(self.target)
                    if _answer(self.proc, READY_TIMEOUT) != "ready":
                        raise RuntimeError("no ready message")
                    failed_starts = 0
                    self.ready.set()
                except Exception as e:
                    log.debug("torchfuse: a compile worker did not start: %s: %s", type(e).__name__, e)
                    self._kill()
                    failed_starts += 1
                    if failed_starts >= START_ATTEMPTS or self.owner._closed:
                        self.gone = True
                        return
                    continue
            task = None if self.owner._closed else self.owner._queue.get()
            if task is None:           # the pool closes: this worker exits when its stdin does
                if self.proc is not None:
                    with contextlib.suppress(OSError, ValueError):
                        self.proc.stdin.close()
                return
            batch, task = task
            if not _alive(self.proc):     # died while idle: the job goes back, this worker restarts
                self._kill()
                self.owner._queue.put((batch, task))
                continue
            if not batch.claim(task):
                continue              # the waiting thread took it
            self.busy = True
            task.by_worker = True
            try:
                batch.finish(task, self._run(task.job))
            finally:
                self.busy = False

    def _run(self, job: Job) -> tuple[str | None, float]:
        proc = self.proc
        try:
            pickle.dump(job, proc.stdin)
            proc.stdin.flush()
            return _answer(proc, JOB_TIMEOUT)
        except Exception as e:        # the worker died or hung: the next job starts a new one
            self._kill()
            return f"worker failed: {type(e).__name__}: {e}", 0.0

    def _kill(self) -> None:
        self.ready.clear()
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            self.proc = None


class WorkerPool:
    """At most `size` worker processes, each started in the background by a thread of its own
    (`start`, or `submit` when a batch needs more) and kept for the process; jobs wait in one
    queue for the first free worker."""

    def __init__(self, size: int):
        self.size = size
        self._queue: queue.SimpleQueue = queue.SimpleQueue()     # (batch, task), or None: a worker stops
        self._workers: list[_Worker] = []
        self._lock = threading.Lock()
        self._closed = False

    @property
    def started(self) -> int:
        """Workers started (or starting) and not given up."""
        with self._lock:
            return sum(1 for w in self._workers if not w.gone)

    def start(self, target: Any = None, count: int | None = None) -> None:
        """Start workers up to `count` (default: `size`) now, without waiting: each imports Triton
        and compiles one small kernel for `target` (a GPUTarget), so that its first job finds the
        compiler started, while the caller goes on tracing and lowering."""
        with self._lock:
            self._add(min(self.size, self.size if count is None else count) - self._live(), target)

    def grow(self, size: int) -> None:
        with self._lock:
            self.size = max(self.size, size)

    def _busy(self) -> int:
        return sum(1 for w in list(self._workers) if w.busy and w.ready.is_set())

    def _live(self) -> int:
        return sum(1 for w in self._workers if not w.gone)

    def _add(self, count: int, target: Any) -> None:
        self._workers = [w for w in self._workers if not w.gone]
        for _ in range(max(0, count)):
            if self._closed:
                return
            worker = _Worker(self, target)
            self._workers.append(worker)
            worker.thread.start()

    def submit(self, jobs: Sequence[Job], local: Sequence[Callable[[], Any] | None] | None = None) -> Batch:
        """Queue `jobs` (`local[i]`: job i done in the waiting thread instead, see `Batch.help`).
        Workers are added where the free ones are fewer than the jobs, one per
        JOBS_PER_NEW_WORKER jobs beyond them, up to `size`."""
        batch = Batch(jobs, local)
        batch.busy_workers = self._busy
        with self._lock:
            if self._closed:
                batch.cancel("worker failed: the pool is closed")
                return batch
            free = sum(1 for w in self._workers if not w.gone and not w.busy)
            beyond = len(batch.tasks) - free
            if beyond > 0:
                target = jobs[0][6] if len(jobs[0]) > 6 else None
                self._add(min(self.size - self._live(), -(-beyond // JOBS_PER_NEW_WORKER)), target)
        for task in batch.tasks:
            self._queue.put((batch, task))
        return batch

    def wait(self, batch: Batch) -> list[tuple[str | None, float]]:
        """The batch's answers, once every job is done; jobs left when no worker could be started
        are answered with an error (their caller compiles them)."""
        while not batch.wait(0.25):
            with self._lock:
                live = self._live()
            if not live:
                batch.cancel("worker failed: no compile worker could be started")
        return batch.answers()

    def run(self, jobs: Sequence[Job]) -> list[tuple[str | None, float]]:
        """Compile `jobs`; for each, (None or the error its worker reported, seconds it took)."""
        return self.wait(self.submit(jobs))

    def close(self, timeout: float = 10.0) -> None:
        """Stop the workers: jobs still queued are answered with an error, each worker exits
        when its stdin closes (after the job it is on), and one that does not is killed."""
        with self._lock:
            self._closed = True
            workers, self._workers = self._workers, []
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                break
            if item is not None and item[0].claim(item[1]):
                item[0].finish(item[1], ("worker failed: the pool is closed", 0.0))
        for _ in workers:
            self._queue.put(None)
        # stdin closed first, all at once: one still starting exits after its warm-up (which
        # removes its folder), one on a job after that job
        procs = [w.proc for w in workers if w.proc is not None]
        for proc in procs:
            with contextlib.suppress(OSError, ValueError):
                proc.stdin.close()
        deadline = time.monotonic() + timeout
        for worker in workers:
            worker.thread.join(max(0.0, deadline - time.monotonic()))
        for proc in procs:
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def _answer(proc: subprocess.Popen, timeout: float) -> Any:
    """The worker's next message, or TimeoutError."""
    if not select.select([proc.stdout], [], [], timeout)[0]:
        raise TimeoutError(f"no answer in {timeout} s")
    return pickle.load(proc.stdout)


def _alive(proc: subprocess.Popen | None) -> bool:
    return proc is not None and proc.poll() is None


def _spawn(target: Any = None) -> subprocess.Popen:
    env = dict(os.environ)
    env.pop("TRITON_INTERPRET", None)    # workers exist to compile (tests set it process-wide)
    warm_up = [pickle.dumps(target).hex()] if target is not None else []
    # this file as a script: importing the package would import torch
    run = f"import runpy; runpy.run_path({str(Path(__file__).resolve())!r}, run_name='__main__')"
    return subprocess.Popen([sys.executable, "-c", run, *warm_up],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env)


_pool: WorkerPool | None = None
_pool_lock = threading.Lock()


def pool(size: int) -> WorkerPool:
    """The process-wide pool, of at least `size` workers at most; closed at interpreter exit."""
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = WorkerPool(size)
            atexit.register(_pool.close, 5.0)
        elif _pool.size < size:
            _pool.grow(size)
        return _pool


def job_for(kernel: Any, grid: tuple, args: tuple, keywords: dict, target: Any, cache_dir: str | None,
            settings: Settings | None = None) -> Job | None:
    """The job compiling `kernel.warmup(*args, grid=grid, **keywords)` in a worker, under the
    parent's Triton `settings` (`triton_settings()`), or None when the kernel was not loaded from
    a file a worker can import."""
    fn = getattr(kernel, "fn", None)
    scope = getattr(fn, "__globals__", {})
    path, module = scope.get("__file__"), scope.get("__name__")
    if not path or not module or not os.path.exists(path):
        return None
    return (path, module, fn.__name__, tuple(map(_encode, args)), grid, keywords, target, cache_dir, settings)


# (environment variables Triton's knobs read, as this process has them; {(group, knob): value} for
#  knobs set in code to plain values; the target's backend hash, or None)
Settings = tuple

# What a worker never takes from the parent: the cache folder travels in the job itself, and
# the interpreter switch is what workers exist to ignore.
_OWN_GROUPS = ("cache",)
_OWN_KNOBS = (("runtime", "interpret"),)
_OWN_VARIABLES = ("TRITON_INTERPRET",)


def _knob_groups() -> dict[str, Any]:
    try:
        from triton import knobs
    except ImportError:            # a Triton before knobs: its settings are the environment alone
        return {}
    return {name: group for name, group in vars(knobs).items() if isinstance(group, knobs.base_knobs)}


def _knob_variables(groups: dict[str, Any]) -> set[str]:
    return {desc.key for name, group in groups.items() if name not in _OWN_GROUPS
            for desc in group.knob_descriptors.values()
            if isinstance(getattr(desc, "key", None), str) and desc.key not in _OWN_VARIABLES}


def triton_settings(target: Any = None) -> Settings:
    """This process's Triton settings that a compile for `target` reads (what a worker applies
    first)."""
    groups = _knob_groups()
    env = {key: os.environ[key] for key in _knob_variables(groups) if key in os.environ}
    try:      # variables Triton's C++ side reads (those set now): part of every key
        from triton._C.libtriton import get_cache_invalidating_env_vars
        env.update(get_cache_invalidating_env_vars())
    except (ImportError, AttributeError):
        pass
    plain = (str, int, float, bool, type(None))
    overrides = {(name, knob): value for name, group in groups.items() if name not in _OWN_GROUPS
                 for knob, value in vars(group).items()
                 if knob in group.knob_descriptors and isinstance(value, plain) and (name, knob) not in _OWN_KNOBS}
    backend_hash = None
    if target is not None:
        try:
            from triton.compiler.compiler import make_backend
            backend_hash = make_backend(target).hash()
        except Exception as e:    # a worker then hashes its own backend (a mismatch costs a compile here)
            log.debug("torchfuse: no backend hash for %s: %s: %s", target, type(e).__name__, e)
    return env, overrides, backend_hash


def _encode(arg: Any) -> Any:
    """A torch dtype (a pointer argument planned without its tensor) as `("*", name)`: the worker
    can unpickle it without importing torch."""
    cls = type(arg)
    if cls.__name__ == "dtype" and cls.__module__ == "torch":
        return ("*", str(arg).rpartition(".")[2])
    return arg


class _DType:
    """A torch dtype by name: what Triton reads of a pointer argument's dtype is `str(dtype)`."""

    def __init__(self, name: str):
        self.name = name

    def __str__(self) -> str:
        return f"torch.{self.name}"

    __repr__ = __str__

    def __eq__(self, other: Any) -> bool:
        return str(self) == str(other)

    def __hash__(self) -> int:
        return hash(str(self))


class _Pointer:
    """A tensor argument for `warmup`, as Triton's `MockTensor`: a dtype and an aligned address."""

    def __init__(self, dtype: Any):
        self.dtype = dtype
        self.shape = [1]

    def stride(self) -> tuple:
        return (1,)

    @staticmethod
    def data_ptr() -> int:
        return 0          # aligned to 16 bytes, as the parent's plan assumes

    @staticmethod
    def ptr_range() -> int:
        return 0


def _decode(args: tuple, real_dtypes: bool) -> tuple:
    if real_dtypes:
        import torch
        return tuple(getattr(torch, a[1]) if type(a) is tuple else a for a in args)
    return tuple(_Pointer(_DType(a[1])) if type(a) is tuple else a for a in args)


# ---------------------------------------------------------------------------------------------
# The worker side.

class _TargetOnlyDriver:
    """What `JITFunction.warmup` needs of Triton's driver to compile, and nothing else."""

    def __init__(self, target: Any):
        self.target = target

    def get_current_device(self) -> int:
        return 0

    def get_current_stream(self, device: int | None = None) -> int:
        return 0

    def get_current_target(self) -> Any:
        return self.target

    def __getattr__(self, name: str) -> Any:
        raise RuntimeError(f"a torchfuse compile worker has no GPU: driver.{name} is not available")


_modules: dict[str, Any] = {}


def compile_job(job: Job) -> None:
    """Compile one job in this process (the worker's side; also callable in-process by tests)."""
    import importlib.util

    import triton
    path, module_name, kernel_name, args, grid, keywords, target, cache_dir, *settings = job
    _use_target(target)
    if settings and settings[0] is not None:
        _apply_settings(settings[0], target)
    if cache_dir and hasattr(triton, "knobs"):
        triton.knobs.cache.dir = cache_dir
    module = _modules.get(path)
    if module is None:
        spec = importlib.util.spec_from_file_location(module_name, path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)     # type: ignore[union-attr]
        _modules[path] = module
    kernel = getattr(module, kernel_name)
    try:
        binary = kernel.warmup(*_decode(args, real_dtypes=False), grid=grid, **keywords)
    except (TypeError, KeyError, AttributeError):   # a Triton that refuses the stand-in: same binary
        if "torch" in sys.modules:
            raise
        binary = kernel.warmup(*_decode(args, real_dtypes=True), grid=grid, **keywords)
    _build_launcher(binary)


_last_settings: list = [None]     # the settings the worker took last (their knobs are set here)


def _apply_settings(settings: Settings, target: Any) -> None:
    """Take the parent's Triton settings: its values of the variables the knobs read (unset where
    it has none), the knobs it set in code (those set for an earlier job and not now go back to
    their defaults), and its backend hash for `target`."""
    previous = _last_settings[0]
    if settings == previous:
        return
    _last_settings[0] = settings
    env, overrides, backend_hash = settings
    groups = _knob_groups()
    _modules.clear()      # a kernel keeps its binaries in memory, whatever the settings they had
    try:       # read again under these settings where the parent sent no hash
        from triton.backends.nvidia.compiler import get_ptxas_version
        get_ptxas_version.cache_clear()
    except (ImportError, AttributeError):
        pass
    _use_backend_hash(target, backend_hash)
    for key in _knob_variables(groups) | set(env):
        if key in env:
            os.environ[key] = env[key]
        else:
            os.environ.pop(key, None)
    for name, knob in set(previous[1] if previous else ()) - set(overrides):
        groups[name].__dict__.pop(knob, None)
    for (name, knob), value in overrides.items():
        if name in groups:
            setattr(groups[name], knob, value)


_own_hash: dict[type, Any] = {}


def _use_backend_hash(target: Any, backend_hash: str | None) -> None:
    """Key binaries for `target` by the parent's backend hash (None: this process's own).  The
    hash is what the parent's compile would key by: its ptxas version as the parent first read
    it, even where the parent's environment names another ptxas since."""
    try:
        from triton.compiler.compiler import make_backend
        cls = type(make_backend(target))
    except Exception:       # no backend for the target: the job reports the error itself
        return
    own = _own_hash.setdefault(cls, cls.hash)
    if backend_hash is None:
        cls.hash = own
    else:
        cls.hash = lambda self: backend_hash if self.target == target else own(self)


def _build_launcher(binary: Any) -> None:
    """Triton before 3.7 also builds a C launcher per kernel signature, with the C compiler, when
    a kernel is first launched: 0.27 s each on the lent host, one after another in the parent
    (GPT-2 has 7 signatures).  Built here, it lands in Triton's cache too.  Later Triton has one
    launcher for every kernel (no `make_launcher`), and nothing to build."""
    from triton.backends.nvidia import driver as nvidia
    if binary is not None and hasattr(nvidia, "make_launcher"):
        nvidia.CudaLauncher(binary.src, binary.metadata)


def _warm_up(target: Any) -> None:
    """Compile one small kernel, so that the first real job finds the compiler started."""
    import triton
    import triton.language as tl

    @triton.jit
    def warm_up(x, y, n, XBLOCK: tl.constexpr):
        offs = tl.program_id(0) * XBLOCK + tl.arange(0, XBLOCK)
        tl.store(y + offs, tl.sum(tl.load(x + offs, offs < n), 0) + 1.0, offs < n)
    _use_target(target)
    import tempfile
    saved = triton.knobs.cache.dir
    with tempfile.TemporaryDirectory(prefix="torchfuse-warm-up-") as fresh:
        triton.knobs.cache.dir = fresh          # a cache hit would start nothing
        try:
            pointer = _Pointer(_DType("float32"))
            _build_launcher(warm_up.warmup(pointer, pointer, 1024, grid=(1,), XBLOCK=1024, num_warps=4))
        finally:
            triton.knobs.cache.dir = saved


def _use_target(target: Any) -> None:
    from triton.runtime.driver import driver
    current = getattr(driver, "_active", None)     # not `driver.active`: that would look for a GPU
    if not isinstance(current, _TargetOnlyDriver) or current.target != target:
        driver.set_active(_TargetOnlyDriver(target))


def main() -> None:
    import triton.compiler  # noqa: F401  (imported before the first job arrives)
    if len(sys.argv) > 1:
        try:
            _warm_up(pickle.loads(bytes.fromhex(sys.argv[1])))
        except Exception:     # only a warm-up: the jobs report their own errors
            pass
    answers = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)                 # prints from the compiler must not corrupt the answers
    pickle.dump("ready", answers)     # the parent hands this worker jobs from now on
    answers.flush()
    jobs = sys.stdin.buffer
    while True:
        try:
            job = pickle.load(jobs)
        except EOFError:
            return
        start = time.perf_counter()
        try:
            compile_job(job)
            error = None
        except BaseException as e:   # reported to the parent, which compiles the kernel itself
            error = f"{type(e).__name__}: {e}"
        pickle.dump((error, time.perf_counter() - start), answers)
        answers.flush()


if __name__ == "__main__":
    main()
