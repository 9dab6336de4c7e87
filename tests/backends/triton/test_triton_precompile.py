"""Planning a graph's Triton launches ahead of its first call (triton_precompile.py).

The compile itself needs a GPU (tests/gpu); here the plan is checked under the interpreter:
every kernel of the graph is planned, with the grid, block sizes and warps of the real launch.
"""
from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")    # as the other Triton tests (no kernel runs here)

import pytest  # noqa: E402
import torch  # noqa: E402

import torchfuse  # noqa: E402
from torchfuse.backends.triton import launch as triton_launch, precompile as triton_precompile  # noqa: E402

pytest.importorskip("triton")


def test_planned_launches_match_the_real_ones(monkeypatch):
    planned: list[tuple] = []
    monkeypatch.setattr(triton_precompile, "enabled", lambda: True)     # plan under the interpreter too
    monkeypatch.setattr(triton_precompile, "precompile", lambda launches, workers: planned.extend(launches))
    real: list[tuple] = []
    original = triton_launch._launch

    def recording(kernel, grid, args, constexprs, warps, names=("XBLOCK", "RBLOCK", "BIG")):
        if triton_launch._hook is not None:       # the planning pass: hand it to the planner
            return original(kernel, grid, args, constexprs, warps, names)
        # recorded, not run: the launches are what is compared (outputs are left unwritten)
        real.append((kernel, tuple(grid), tuple(a.dtype if isinstance(a, torch.Tensor) else a for a in args),
                     tuple(constexprs), warps, tuple(names)))
    monkeypatch.setattr(triton_launch, "_launch", recording)

    def fn(x, y, z):
        a = (x * 2.5).softmax(-1)          # a reduction kernel
        b = x.t().contiguous() + y * 3     # a tiled (transposing) kernel
        return a, b, (z + 1.25).sin()      # a pointwise kernel (of its own size: it fuses with neither)
    x, y, z = torch.randn(61, 59), torch.randn(59, 61), torch.randn(37)
    e = torchfuse.explain(fn, x, y, z, options={"cpu_backend": "triton"})
    assert len(e.kernels) == 3
    plans = [(k, tuple(g), tuple(args), tuple(c), w, tuple(n)) for k, g, args, c, w, n in planned]
    assert len(plans) == 3
    assert sorted(set(map(repr, plans))) == sorted(set(map(repr, real)))     # (explain may run it twice)


def test_split_reductions_of_a_symbolic_graph_are_planned(monkeypatch):
    """A split reduction over a symbolic length binds its split factor at run time with the
    wrapper's `_split_factor`: planning must evaluate that binding, or the kernels reading it are
    left to compile one by one on first launch (76 of a ResNet-18 training step's 120 kernels
    after its dynamic recompile, on an H200)."""
    planned: list[tuple] = []
    calls: list[str] = []
    monkeypatch.setattr(triton_precompile, "enabled", lambda: True)
    monkeypatch.setattr(triton_precompile, "precompile", lambda launches, workers: planned.extend(launches))
    plan = triton_precompile.plan_launches

    def seen(kernel_calls, scope, dtypes, symbols):
        calls.extend(call for call, _ in kernel_calls)
        return plan(kernel_calls, scope, dtypes, symbols)
    monkeypatch.setattr(triton_precompile, "plan_launches", seen)

    def fn(x):
        return (x * x).sum()
    compiled = torch.compile(fn, backend="torchfuse", dynamic=True,
                             options={"cpu_backend": "triton", "split_min_chunk": 256, "strict": True})
    x = torch.randn(6, 2, 64, 64)
    torch.testing.assert_close(compiled(x), fn(x), rtol=1e-4, atol=1e-3)
    assert any("_part_" in call for call in calls), calls           # the split happened
    names = {launch[0].fn.__name__ for launch in planned}
    # every kernel planned (a row of symbolic length: its persistent and looped variants)
    assert {n.rsplit("_", 1)[0] for n in names} == {c.split("(", 1)[1].split(",")[0].rsplit("_", 1)[0]
                                                    for c in calls}, (names, calls)


KERNELS = '''
import triton
import triton.language as tl

@triton.jit
def scale(x, y, n, XBLOCK: tl.constexpr):
    offs = tl.program_id(0) * XBLOCK + tl.arange(0, XBLOCK)
    mask = offs < n
    tl.store(y + offs, tl.load(x + offs, mask) * 2.5, mask)
'''

# A process standing for a GPU one: Triton compiles for an H100 (its wheel ships ptxas) through the
# workers' target-only driver; `precompile` runs as for a graph, and the first call's wait is
# `pending.result()`.
PARENT = '''
import importlib.util, os, sys, threading, torch, triton
from triton.backends.compiler import GPUTarget
from torchfuse import counters
from torchfuse.backends.triton import compile_workers, launch, precompile
compile_workers._use_target(GPUTarget("cuda", 90, 32))
triton.knobs.cache.dir = {cache!r}
launch._trusted[("test",)] = {{"x"}}                 # (no launcher probe: nothing launches here)
spec = importlib.util.spec_from_file_location("tf_test_kernels", {module!r})
module = importlib.util.module_from_spec(spec)
spec.loader.exec_module(module)
launches = [(module.scale, (1,), (dtype, dtype, 1024), (block,), 4, ("XBLOCK",))
            for dtype in (torch.float32, torch.bfloat16) for block in (256, 1024)]
if {broken!r}:     # every worker job fails (its kernel file is gone): compiled by this process's threads
    make = compile_workers.job_for
    compile_workers.job_for = lambda *a, **k: ("/nonexistent/kernels.py",) + make(*a, **k)[1:]
if {workers_start!r}:       # nobody waits on the future until the workers are done: they compile all
    pending = precompile.precompile(launches, 2)
    while not pending.done():
        threading.Event().wait(0.05)
    assert pending.result() == 4
else:       # workers that never get ready: the first call's wait compiles them all, in its own thread
    compile_workers._spawn = lambda target=None: __import__("subprocess").Popen(
        [sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=-1, stdout=-1)
    pending = precompile.precompile(launches, 2)
    assert pending.result() == 4
    assert counters["kernels_compiled_while_waiting"] == 4, dict(counters)
    assert all(module.scale.device_caches[0][0]), "the binaries are in memory for the first launch"
print("COUNTS", counters["kernels_compiled_in_workers"], counters["kernels_compiled_while_waiting"])
'''


@pytest.mark.parametrize("order", [("here", "workers"), ("workers", "here"), ("broken", "here")])
def test_kernels_compiled_while_waiting_are_the_workers_binaries(tmp_path, order):
    """The first call's wait compiles what no worker took (here: no worker can start) in its own
    thread; those binaries are the ones the workers make: whichever compiles a kernel first,
    the other finds it in Triton's cache and adds no entry.  Jobs the workers fail are compiled
    by this process's threads, to the same binaries."""
    import subprocess
    import sys
    (tmp_path / "tf_test_kernels.py").write_text(KERNELS)
    cache = tmp_path / "cache"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    entries = []
    for who in order:
        script = PARENT.format(cache=str(cache), module=str(tmp_path / "tf_test_kernels.py"),
                               workers_start=who in ("workers", "broken"), broken=who == "broken")
        proc = subprocess.run([sys.executable, "-c", script], env=env, timeout=300, capture_output=True, text=True)
        assert proc.returncode == 0, proc.stderr[-3000:]
        counts = next(line.split()[1:] for line in proc.stdout.splitlines() if line.startswith("COUNTS"))
        entries.append(sorted(os.listdir(cache)))
        if who == "workers" and len(entries) == 1:
            assert counts == ["4", "0"]          # (nothing queued is left for the wait when workers are free)
        if who == "broken":
            assert counts == ["0", "0"]          # all four compiled after the workers failed them
    assert len(entries[0]) == 4 and entries[1] == entries[0]


def test_cpu_graphs_start_no_compile_workers(monkeypatch):
    """C++ and the Triton interpreter compile in this process: compiling a CPU graph (for longer
    than the early start's delay) starts no worker, and the results are eager's."""
    from torchfuse.backends.triton import compile_workers
    from torchfuse.frontend import graph_compile
    started = []
    monkeypatch.setattr(graph_compile, "EARLY_START_DELAY", 0.0)
    monkeypatch.setattr(compile_workers, "pool", lambda size: started.append(size))
    for cpu_backend in ("cpp", "triton"):
        torch._dynamo.reset()
        fn = torch.compile(lambda x, y: (x * y).softmax(-1) + y.sum(0), backend="torchfuse",
                           options={"cpu_backend": cpu_backend, "strict": True})
        x, y = torch.randn(7, 33, dtype=torch.float64), torch.randn(33, 7, dtype=torch.float64).t()
        torch.testing.assert_close(fn(x, y), (x * y).softmax(-1) + y.sum(0))
    assert started == []


def test_ranks_on_one_host_share_the_compile_workers(monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(64)), raising=False)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    assert triton_precompile.default_workers() == 16          # one process: 16 at most
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert triton_precompile.default_workers() == 16          # 64 cores / 4 ranks
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    assert triton_precompile.default_workers() == 8
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    assert triton_precompile.default_workers() == 1           # never none
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(48)), raising=False)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "")                # unset: an initialized group counts
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda group=None: 16)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    assert triton_precompile.default_workers() == 12          # 16 ranks over 4 hosts' GPUs: 4 here
