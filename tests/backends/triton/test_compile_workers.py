"""Triton kernels compiled in worker processes (backends/triton/compile_workers.py).

Triton compiles for a CUDA target without a GPU (its wheel ships ptxas), so the workers are
tested here for real: a job leaves a cubin in Triton's cache, a second worker process finds
the same cache entry (what the parent relies on: it loads what a worker compiled), errors come
back as text, and a worker that died is replaced.
"""
from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")   # as the other Triton tests; the workers drop it

from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

from torchfuse.backends.triton import compile_workers  # noqa: E402

triton = pytest.importorskip("triton")

KERNELS = '''
import triton
import triton.language as tl

@triton.jit
def scale(x, y, n, XBLOCK: tl.constexpr):
    offs = tl.program_id(0) * XBLOCK + tl.arange(0, XBLOCK)
    mask = offs < n
    tl.store(y + offs, tl.load(x + offs, mask) * 2.5, mask)

@triton.jit
def broken(x, n, XBLOCK: tl.constexpr):
    offs = tl.arange(0, 3)          # not a power of two: Triton refuses it
    tl.store(x + offs, 1.0)
'''


@pytest.fixture
def setup(tmp_path):
    from triton.backends.compiler import GPUTarget
    module = tmp_path / "tf_test_kernels.py"
    module.write_text(KERNELS)
    pool = compile_workers.WorkerPool(2)
    cache = tmp_path / "cache"

    def job(name, dtype=torch.float32, n=1024, block=1024):
        args = (dtype, dtype, n) if name == "scale" else (dtype, n)
        return (str(module), "tf_test_kernels", name, tuple(map(compile_workers._encode, args)), (1,),
                {"XBLOCK": block, "num_warps": 4}, GPUTarget("cuda", 90, 32), str(cache))
    yield pool, job, cache
    pool.close()


def _errors(answers: list[tuple]) -> list:
    assert all(seconds >= 0 for _, seconds in answers)
    return [error for error, _ in answers]


def _entries(cache: Path) -> set[str]:
    return set(os.listdir(cache)) if cache.exists() else set()


def test_a_job_leaves_a_binary_another_process_finds(setup):
    pool, job, cache = setup
    assert _errors(pool.run([job("scale"), job("scale", torch.bfloat16)])) == [None, None]
    first = _entries(cache)
    assert len(first) == 2          # one binary per dtype
    assert any(f.endswith(".cubin") for d in first for f in os.listdir(cache / d))
    other = compile_workers.WorkerPool(1)
    try:
        assert _errors(other.run([job("scale")])) == [None]
    finally:
        other.close()
    assert _entries(cache) == first     # the same key in another process: a cache hit


def test_workers_never_import_torch(setup, tmp_path):
    """A worker starts in a fraction of the time when it does not import torch: two kernel
    modules record whether torch is loaded, one before and one after the worker's first compile."""
    pool, job, cache = setup
    marks = []
    for i in range(2):
        mark = tmp_path / f"torch_loaded_{i}"
        module = tmp_path / f"tf_mark_{i}.py"
        module.write_text(f"import sys\nopen({str(mark)!r}, 'w').write(str('torch' in sys.modules))\n" + KERNELS)
        marks.append(mark)
        assert _errors(pool.run([(str(module),) + job("scale", torch.bfloat16)[1:]])) == [None]
    assert [m.read_text() for m in marks] == ["False", "False"]


def test_a_worker_binary_is_the_one_real_dtypes_ask_for(setup, tmp_path):
    """The worker compiles with stand-in dtypes; a process with torch asking for the same kernel
    with real dtypes must find that binary in the cache (a hit adds no entry)."""
    import subprocess
    import sys
    pool, job, cache = setup
    for dtype in (torch.float32, torch.bfloat16, torch.int64):
        assert _errors(pool.run([job("scale", dtype)])) == [None]
    compiled = _entries(cache)
    assert len(compiled) == 3
    script = f"""
import importlib.util, torch, triton
from triton.backends.compiler import GPUTarget
from torchfuse.backends.triton import compile_workers
compile_workers._use_target(GPUTarget("cuda", 90, 32))
triton.knobs.cache.dir = {str(cache)!r}
spec = importlib.util.spec_from_file_location("tf_test_kernels", {str(tmp_path / "tf_test_kernels.py")!r})
module = importlib.util.module_from_spec(spec)
spec.loader.exec_module(module)
for dtype in (torch.float32, torch.bfloat16, torch.int64):
    module.scale.warmup(dtype, dtype, 1024, grid=(1,), XBLOCK=1024, num_warps=4)
"""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    subprocess.run([sys.executable, "-c", script], check=True, env=env, timeout=300)
    assert _entries(cache) == compiled


def test_a_worker_keys_its_binary_as_the_parent_does_after_triton_settings_changed(tmp_path):
    """Triton reads ptxas's version once per process (part of every binary's key); Inductor points
    Triton at torch's own ptxas after its first compile read it.  A worker started since read the
    new ptxas and keyed its binaries by it, so the parent never found them and compiled every
    kernel again.  A job carries the parent's settings and backend hash: here, in a process with
    torch standing for the parent, the version it read first, then a setting that names another
    ptxas release (as far as the key can tell), then a worker's compile, then the parent's own
    compile of the same kernel finds the worker's binary (no new cache entry)."""
    import subprocess
    import sys
    (tmp_path / "tf_test_kernels.py").write_text(KERNELS)
    cache = tmp_path / "cache"
    script = f"""
import importlib.util, os, torch, triton
from triton.backends.compiler import GPUTarget
from triton.backends.nvidia.compiler import get_ptxas_version
from torchfuse.backends.triton import compile_workers
target = GPUTarget("cuda", 90, 32)
compile_workers._use_target(target)
triton.knobs.cache.dir = {str(cache)!r}
version = get_ptxas_version(90)                     # the parent's first compile reads it
os.environ["TRITON_MOCK_PTX_VERSION"] = version.replace("V", "V9", 1)   # then a setting changes
pool = compile_workers.WorkerPool(1)
job = ({str(tmp_path / "tf_test_kernels.py")!r}, "tf_test_kernels", "scale", (("*", "float32"), ("*", "float32"), 1024),
       (1,), {{"XBLOCK": 1024, "num_warps": 4}}, target, {str(cache)!r}, compile_workers.triton_settings(target))
assert pool.run([job])[0][0] is None
pool.close()
compiled = set(os.listdir({str(cache)!r}))
assert len(compiled) == 1, compiled
spec = importlib.util.spec_from_file_location("tf_test_kernels", {str(tmp_path / "tf_test_kernels.py")!r})
module = importlib.util.module_from_spec(spec)
spec.loader.exec_module(module)
module.scale.warmup(torch.float32, torch.float32, 1024, grid=(1,), XBLOCK=1024, num_warps=4)
assert set(os.listdir({str(cache)!r})) == compiled, "the parent compiled the kernel again"
"""
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "TRITON_MOCK_PTX_VERSION")}
    proc = subprocess.run([sys.executable, "-c", script], env=env, timeout=300, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_a_job_applies_the_parents_knobs_and_drops_them_after(setup, monkeypatch):
    """The settings a job carries reach the worker's compile (a knob set in code in the parent,
    after the workers started), and a later job without them goes back to Triton's defaults."""
    from triton.backends.compiler import GPUTarget
    pool, job, cache = setup
    target = GPUTarget("cuda", 90, 32)
    pool.start(target)
    assert _errors(pool.run([job("scale")] * 2)) == [None, None]       # both workers, before the change
    assert len(_entries(cache)) == 1
    from triton.backends.nvidia.compiler import get_ptxas_version
    other = get_ptxas_version(90).replace("V", "V9", 1)     # another ptxas release, as far as the key can tell
    monkeypatch.setitem(triton.knobs.nvidia.__dict__, "mock_ptx_version", other)
    settings = compile_workers.triton_settings()       # no target: the worker hashes its backend itself
    assert settings[1][("nvidia", "mock_ptx_version")] == other
    assert _errors(pool.run([job("scale") + (settings,)] * 2)) == [None, None]
    assert len(_entries(cache)) == 2                   # another ptxas: another binary
    assert _errors(pool.run([job("scale") + (({}, {}, None),)] * 2)) == [None, None]
    assert len(_entries(cache)) == 2                   # the default again: the first binary


def test_errors_come_back_and_the_worker_goes_on(setup):
    pool, job, cache = setup
    answers = _errors(pool.run([job("broken"), job("scale"), job("missing")]))
    assert answers[0].startswith("CompilationError") and "power of 2" in answers[0]
    assert answers[1] is None
    assert answers[2].startswith("AttributeError")


def test_workers_started_ahead_warm_up_then_take_jobs(setup):
    pool, job, cache = setup
    from triton.backends.compiler import GPUTarget
    pool.start(GPUTarget("cuda", 90, 32), count=1)     # each compiles a kernel of its own, in a cache of its own
    pool.start(GPUTarget("cuda", 90, 32), count=1)     # started once
    assert pool.started == 1
    worker, = pool._workers
    assert worker.ready.wait(120) and worker.proc.poll() is None
    assert _errors(pool.run([job("scale")])) == [None]
    assert pool.started == 1                     # a free worker: none added for one job
    assert len(_entries(cache)) == 1             # the warm-up kernels did not land in the cache


def test_a_dead_worker_is_replaced(setup):
    pool, job, cache = setup
    assert _errors(pool.run([job("scale")])) == [None]
    for worker in pool._workers:           # kill whatever workers were started
        if worker.proc is not None:
            worker.proc.kill()
            worker.proc.wait()
    assert _errors(pool.run([job("scale", block=512)])) == [None]
    assert len(_entries(cache)) == 2


def test_only_kernels_loaded_from_a_file_become_jobs():
    from triton.backends.compiler import GPUTarget

    @triton.jit
    def local(x):
        pass
    target = GPUTarget("cuda", 90, 32)
    # defined in this test file: importable by path, so it is a job; a dtype travels by name
    job = compile_workers.job_for(local, (1,), (torch.float32, 7), {}, target, None)
    assert job[2] == "local" and job[3] == (("*", "float32"), 7)

    class NotAKernel:
        pass
    assert compile_workers.job_for(NotAKernel(), (1,), (), {}, target, None) is None


def test_a_worker_that_does_not_answer_in_time_is_killed(setup, monkeypatch):
    pool, job, cache = setup
    monkeypatch.setattr(compile_workers, "JOB_TIMEOUT", 0.001)    # no compile answers that fast
    (error, _), = pool.run([job("scale")])
    assert error.startswith("worker failed: TimeoutError")
    monkeypatch.setattr(compile_workers, "JOB_TIMEOUT", 300.0)
    assert _errors(pool.run([job("scale", block=256)])) == [None]      # a new worker took the slot


def test_new_sizes_of_a_symbolic_graph_reuse_one_binary(setup, tmp_path):
    """A graph compiled with symbolic sizes must compile no kernel at a new batch size: its
    kernels do not specialize on the size symbols (backends/triton/codegen.py), so sizes of every
    specialization class (1, multiples of 16, others) find one binary.  Compiled here for a CUDA
    target from the Triton source torchfuse generated (on a GPU, batch 16 compiled 8 of a
    Llama's kernels again before)."""
    import inspect

    from torchfuse.backends.triton import launch as triton_launch
    pool, job, cache = setup
    known = set(triton_launch._modules)
    compiled = torch.compile(lambda y: (y + 1.25).sin(), backend="torchfuse", dynamic=True,
                             options={"cpu_backend": "triton", "strict": True})
    for n in (3, 6):
        y = torch.randn(n, 5)
        torch.testing.assert_close(compiled(y), (y + 1.25).sin())
    module = next(m for key, m in triton_launch._modules.items() if key not in known)
    source = inspect.getsource(module)
    assert "do_not_specialize=" in source, source
    fn = next(v for v in vars(module).values() if hasattr(v, "fn") and v.fn.__name__.startswith("poi_"))
    params = list(inspect.signature(fn.fn).parameters.values())
    constexprs = {p.name: {"XBLOCK": 128, "RBLOCK": 1, "BIG": False}[p.name] for p in params
                  if "constexpr" in str(p.annotation)}
    from triton.backends.compiler import GPUTarget

    def args_for(n: int) -> tuple:
        values = {"xnumel": 5 * n, "rnumel": 1}
        out = []
        for p in params:
            if p.name in constexprs:
                continue
            if p.name in values:
                out.append(values[p.name])
            elif p.name.startswith("s") and p.name[1:].isdigit():     # a size symbol
                out.append(n)
            else:
                out.append(compile_workers._encode(torch.float32))
        return tuple(out)
    jobs = [(module.__file__, module.__name__, fn.fn.__name__, args_for(n), (1,), {**constexprs, "num_warps": 2},
             GPUTarget("cuda", 90, 32), str(cache)) for n in (3, 16, 1, 32)]
    assert _errors(pool.run(jobs)) == [None] * 4
    assert len(_entries(cache)) == 1, _entries(cache)


def test_workers_are_added_for_the_jobs_beyond_the_free_ones(setup, monkeypatch):
    """One worker per JOBS_PER_NEW_WORKER jobs that the free workers do not cover, up to the
    pool's size: a started worker pays for itself only from about its second job."""
    from triton.backends.compiler import GPUTarget
    pool, job, cache = setup
    pool.size = 4
    pool.start(GPUTarget("cuda", 90, 32), count=1)
    jobs = [job("scale", block=b) for b in (64, 128, 256)]      # 2 beyond the free worker: 1 more
    assert _errors(pool.run(jobs)) == [None] * 3
    assert pool.started == 2
    jobs = [job("scale", dtype, block=b) for dtype in (torch.float16, torch.bfloat16) for b in (64, 128, 256, 512)]
    assert _errors(pool.run(jobs)) == [None] * 8               # 6 beyond two free: 3 more, but 4 at most
    assert pool.started == 4
    assert len(_entries(cache)) == 11


def _never_starts(target=None):
    import subprocess
    import sys
    return subprocess.Popen([sys.executable, "-c", "pass"], stdin=subprocess.PIPE, stdout=subprocess.PIPE)


def test_jobs_no_worker_takes_run_in_the_waiting_thread(setup, monkeypatch):
    """`Batch.help`: what is still queued runs in the thread that waits (a worker would have
    taken it had one been free); without that thread, jobs no worker can start for come back
    as failures, which the caller compiles itself."""
    import threading
    pool, job, cache = setup
    monkeypatch.setattr(compile_workers, "_spawn", _never_starts)
    ran = []
    jobs = [job("scale", block=b) for b in (64, 128)]
    batch = pool.submit(jobs, [lambda b=b: ran.append((b, threading.current_thread())) for b in (64, 128)])
    assert batch.help() == 2
    assert sorted(b for b, _ in ran) == [64, 128] and {t for _, t in ran} == {threading.current_thread()}
    assert _errors(pool.wait(batch)) == [None, None]
    assert not any(task.by_worker for task in batch.tasks)
    answers = _errors(pool.run([job("scale")]))
    assert answers[0].startswith("worker failed: no compile worker could be started")
    assert not _entries(cache)


def test_an_error_in_the_waiting_thread_is_reported_and_not_retried(setup, monkeypatch):
    pool, job, cache = setup
    monkeypatch.setattr(compile_workers, "_spawn", _never_starts)

    def fails():
        raise ValueError("no such kernel")
    batch = pool.submit([job("scale")], [fails])
    assert batch.help() == 1
    (error, _), = pool.wait(batch)
    assert error == "in-process: ValueError: no such kernel"


def test_the_pool_closes_at_exit_with_no_process_left(tmp_path):
    """A process that exits with workers starting, busy and idle leaves none behind and does not
    hang (the pool closes at interpreter exit)."""
    import subprocess
    import sys
    (tmp_path / "tf_test_kernels.py").write_text(KERNELS)
    script = f"""
import os, torch
from triton.backends.compiler import GPUTarget
from torchfuse.backends.triton import compile_workers
target = GPUTarget("cuda", 90, 32)
pool = compile_workers.pool(3)
pool.start(target, count=2)
job = ({str(tmp_path / "tf_test_kernels.py")!r}, "tf_test_kernels", "scale", (("*", "float32"), ("*", "float32"), 1024),
       (1,), {{"XBLOCK": 1024, "num_warps": 4}}, target, {str(tmp_path / "cache")!r})
assert pool.run([job])[0][0] is None
pool.start(target)                       # the third: still starting at exit
pool.submit([job[:5] + ({{"XBLOCK": 256, "num_warps": 4}},) + job[6:]])      # maybe still compiling at exit
print("PIDS", *[w.proc.pid for w in pool._workers if w.proc is not None], flush=True)
"""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", script], env=env, timeout=120, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
    pids = [int(p) for line in proc.stdout.splitlines() if line.startswith("PIDS") for p in line.split()[1:]]
    assert len(pids) >= 2
    for pid in pids:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            continue
        status = Path(f"/proc/{pid}/status").read_text() if Path(f"/proc/{pid}/status").exists() else ""
        assert "zombie" in status or not status, f"worker {pid} outlived its parent"


def test_the_waiting_thread_leaves_a_job_to_each_busy_worker(setup, monkeypatch):
    """A busy worker takes the next job sooner than the waiting thread compiles it: of two queued
    jobs and one busy worker, the thread runs one and leaves the other to the worker."""
    import threading
    pool, job, cache = setup
    monkeypatch.setattr(compile_workers, "_spawn", _never_starts)
    ran = []
    batch = pool.submit([job("scale"), job("scale", block=512)], [lambda: ran.append(0), lambda: ran.append(1)])
    batch.busy_workers = lambda: 1
    helped = []
    helper = threading.Thread(target=lambda: helped.append(batch.help()))
    helper.start()
    while not ran:
        helper.join(0.01)
    assert ran == [0] and helper.is_alive()            # waits for the worker to take job 1
    last = batch.tasks[1]
    assert batch.claim(last)                           # the worker takes it
    batch.finish(last, (None, 0.5))
    helper.join(30)
    assert helped == [1] and ran == [0]
