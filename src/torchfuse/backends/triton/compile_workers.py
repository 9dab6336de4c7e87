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
prints go to stderr, which is discarded.  They exit when the parent closes their stdin.

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

import logging
import os
import pickle
import queue
import select
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Sequence

log = logging.getLogger("torchfuse")

# (module file, module name, kernel name, args (("*", dtype name) for tensors), grid, keyword arguments,
#  GPUTarget, Triton cache dir or None[, Triton settings (triton_settings)])
Job = tuple

JOB_TIMEOUT = 300.0     # seconds a worker may take for one kernel before it is killed


class WorkerPool:
    """`size` worker processes, started on first use (or by `start`) and kept for the process."""

    def __init__(self, size: int):
        self.size = size
        self._slots: queue.Queue = queue.Queue()
        self._lock = threading.Lock()
        for _ in range(size):
            self._slots.put(None)         # None: not started yet (or died)

    def start(self, target: Any = None) -> None:
        """Start every worker now, without waiting: they import torch and Triton, and compile one
        small kernel for `target` (a GPUTarget) while the caller goes on tracing and lowering.
        A worker's first compile costs ~0.5 s more than later ones (MLIR, LLVM and ptxas starting
        up), and a graph gives each worker only one or two kernels."""
        for proc in self._take_idle():
            self._slots.put(proc if _alive(proc) else _spawn(target))

    def grow(self, size: int) -> None:
        with self._lock:
            for _ in range(size - self.size):
                self._slots.put(None)
            self.size = max(self.size, size)

    def close(self) -> None:
        """Stop the workers (they exit when their stdin closes)."""
        for proc in self._take_idle():
            if proc is not None:
                proc.stdin.close()
                try:
                    proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    proc.kill()

    def _take_idle(self) -> list[subprocess.Popen | None]:
        """Every slot not busy with a job, taken out of the queue."""
        taken = []
        while True:
            try:
                taken.append(self._slots.get_nowait())
            except queue.Empty:
                return taken

    def run(self, jobs: Sequence[Job]) -> list[tuple[str | None, float]]:
        """Compile `jobs`; for each, (None or the error its worker reported, seconds it took)."""
        if not jobs:
            return []
        with ThreadPoolExecutor(min(self.size, len(jobs)), thread_name_prefix="torchfuse-worker") as threads:
            return list(threads.map(self._one, jobs))

    def _one(self, job: Job) -> tuple[str | None, float]:
        proc = self._slots.get()
        try:
            if not _alive(proc):
                proc = _spawn(job[6])            # job[6]: the target, for the warm-up
            pickle.dump(job, proc.stdin)
            proc.stdin.flush()
            if not select.select([proc.stdout], [], [], JOB_TIMEOUT)[0]:
                raise TimeoutError(f"no answer in {JOB_TIMEOUT} s")    # a hung compile: its worker goes
            return pickle.load(proc.stdout)
        except Exception as e:        # the worker died (or could not start): its slot starts a new one
            if proc is not None:
                proc.kill()
            proc = None
            return f"worker failed: {type(e).__name__}: {e}", 0.0
        finally:
            self._slots.put(proc)


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
    """The process-wide pool, with at least `size` workers."""
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = WorkerPool(size)
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
