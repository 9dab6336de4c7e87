"""Tiered first calls (runtime/tiered.py, Config.first_calls): while a graph's kernels still build
in the background, its calls run its aten graph through ATen, with the compiled graph's outputs
and layouts; the first call after the build switches to the kernels.  The builds are held here
(each on its own event), so nothing depends on timing: the C++ backend's g++ build, and the
Triton backend's precompile future under the interpreter."""
from __future__ import annotations

import copy
import threading
import warnings
from concurrent.futures import Future

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

import torchfuse
from torchfuse import counters
from torchfuse.backends.cpp import CppBackend
from torchfuse.backends.cpp.build import CompileError, clear_memory_cache
from torchfuse.runtime import tiered
from torchfuse.runtime.tiered import EagerTier


class HeldBuilds:
    """Every C++ build started in the background waits for `release(i)` (i: the order the builds
    were started in); the kernels it builds count their launches.  A build in the foreground
    (first_calls="wait") runs at once."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch):
        self.events: list[threading.Event] = []
        self.by_code: dict[int, threading.Event] = {}
        self.launches = 0
        self.fail: str | None = None
        start, build = CppBackend.start_build, CppBackend._build
        held = self

        def start_build(backend, code, config, debug):
            event = threading.Event()
            held.by_code[id(code)] = event
            future = start(backend, code, config, debug)
            if future is not None:
                held.events.append(event)
            return future

        def _build(backend, code, config, debug, threads):
            event = held.by_code.get(id(code))
            if event is not None and event in held.events:
                assert event.wait(120), "a held build was never released"
            if held.fail is not None:
                raise CompileError(held.fail)
            kernels = build(backend, code, config, debug, threads)
            return {name: held._counting(fn) if name in code.kernel_args else fn for name, fn in kernels.items()}
        monkeypatch.setattr(CppBackend, "start_build", start_build)
        monkeypatch.setattr(CppBackend, "_build", _build)
        clear_memory_cache()     # (a library loaded by another test is not built in the background)

    def _counting(self, fn):
        def launch(*args):
            self.launches += 1
            return fn(*args)
        return launch

    def release(self, which: tuple[int, ...] | None = None) -> None:
        """Let the builds `which` (all: None) go on."""
        for i in range(len(self.events)) if which is None else which:
            self.events[i].set()


@pytest.fixture
def held(monkeypatch):
    builds = HeldBuilds(monkeypatch)
    yield builds
    builds.release()          # (a test that failed early leaves no build thread waiting)
    torchfuse.wait_compiled(120)


def options(tmp_path, **more):
    # a fresh cache: the library is built, not loaded (loading is not done in the background)
    return {"first_calls": "eager", "cache_dir": str(tmp_path), "strict": True, **more}


def fn(x, y):
    h = torch.tanh(x * 1.5 + y.t())
    return h.softmax(-1), (h * h).sum(0), h.t()


def inputs(dtype=torch.float32):
    x = torch.randn(13, 7, dtype=dtype)
    y = torch.randn(13, 15, dtype=dtype)[:, 1::2].t()      # [7, 13], non-contiguous
    return x, y


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_first_call_runs_through_aten_until_the_build_ends(tf, held, tmp_path, dtype):
    compiled = torch.compile(fn, backend="torchfuse", options=options(tmp_path))
    before = counters["calls_tiered"], counters["tiered_switches"]
    args = inputs(dtype)
    expected = fn(*args)
    tf.assert_same(compiled(*args), expected, check_stride=True)     # the build is held: no wait
    assert len(held.events) == 1 and not held.events[0].is_set()
    assert held.launches == 0
    tf.assert_same(compiled(*args), expected, check_stride=True)
    assert counters["calls_tiered"] - before[0] == 2
    held.release()
    torchfuse.wait_compiled(120)
    args = inputs(dtype)
    tf.assert_same(compiled(*args), fn(*args), check_stride=True)
    assert held.launches >= 2, "the call after the build ran no kernel"
    assert counters["calls_tiered"] - before[0] == 2
    assert counters["tiered_switches"] - before[1] == 1


@pytest.mark.parametrize("first", [0, 1], ids=["forward_built_first", "backward_built_first"])
def test_training_across_the_switch(tf, held, tmp_path, first):
    """Forward and backward each build in the background; a training step made while both are
    held, once only one is built (a compiled backward reading the activations the forward saved
    through ATen, or the reverse), and once both are, has eager's loss and gradients."""
    torch.manual_seed(1)
    model = torch.nn.Sequential(torch.nn.Linear(11, 19), torch.nn.LayerNorm(19), torch.nn.GELU(),
                                torch.nn.Linear(19, 5))
    reference = copy.deepcopy(model)
    compiled = torch.compile(model, backend="torchfuse", options=options(tmp_path))

    def step(m, x):
        m.zero_grad()
        loss = (m(x) * torch.linspace(-1, 1, 5)).sum()
        loss.backward()
        return [loss.detach()] + [p.grad.clone() for p in m.parameters()]

    launches = []
    for built in ((), (first,), (0, 1)):       # nothing built, one built, both built
        if built:
            held.release(built)
            _until(lambda: len(tiered._pending) == 2 - len(built))
        x = torch.randn(9, 11)
        got = step(compiled, x)
        for k, (g, e) in enumerate(zip(got, step(reference, x))):
            tf.assert_same(g, e, what=f"step with {len(built)} graph(s) built, tensor {k}: ")
        launches.append(held.launches)
    assert len(held.events) == 2, "forward and backward each built in the background"
    assert launches[0] == 0                     # all through ATen
    assert launches[2] > launches[1] > 0        # one graph's kernels, then the other's too


def _until(condition, timeout=120.0):
    event = threading.Event()
    for _ in range(int(timeout / 0.01)):
        if condition():
            return
        event.wait(0.01)
    raise AssertionError("timed out")


def test_strict_raises_at_the_switch(held, tmp_path):
    compiled = torch.compile(fn, backend="torchfuse", options=options(tmp_path))
    args = inputs()
    held.fail = "g++ said no"
    compiled(*args)                               # through ATen, the build held
    held.release()
    torchfuse.wait_compiled(120)
    with pytest.raises(CompileError, match="g\\+\\+ said no"):
        compiled(*args)
    with pytest.raises(CompileError):             # and at every call after
        compiled(*args)


def test_failed_build_warns_once_and_runs_eagerly(tf, held, tmp_path):
    compiled = torch.compile(fn, backend="torchfuse", options=options(tmp_path, strict=False))
    args = inputs()
    held.fail = "g++ said no"
    before = counters["eager_fallbacks"]
    compiled(*args)
    held.release()
    torchfuse.wait_compiled(120)
    with pytest.warns(UserWarning, match="building the kernels of .* failed"):
        tf.assert_same(compiled(*args), fn(*args))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        tf.assert_same(compiled(*args), fn(*args))
    assert counters["eager_fallbacks"] - before == 1


def test_wait_mode_waits_for_the_build(tf, held, tmp_path):
    """first_calls="wait": the build runs in the foreground and the first call launches kernels."""
    compiled = torch.compile(fn, backend="torchfuse", options=options(tmp_path, first_calls="wait"))
    before = counters["calls_tiered"]
    args = inputs()
    tf.assert_same(compiled(*args), fn(*args), check_stride=True)
    assert held.events == [] and held.launches >= 1
    assert counters["calls_tiered"] == before


def test_cuda_graph_mode_waits(tf, held, tmp_path):
    """mode="reduce-overhead" records compiled graphs only: no ATen tier (on CPU tensors the
    mode changes nothing else)."""
    compiled = torchfuse.compile(fn, mode="reduce-overhead", options=options(tmp_path))
    before = counters["calls_tiered"]
    args = inputs()
    tf.assert_same(compiled(*args), fn(*args))
    assert held.events == [] and held.launches >= 1
    assert counters["calls_tiered"] == before


def test_explain_reports_the_tiered_calls(held, tmp_path):
    report = torchfuse.explain(fn, *inputs(), options=options(tmp_path))
    assert report.calls_tiered == 1
    assert len(report.first_calls) == 1 and "background" in report.first_calls[0]
    assert "1 ran through ATen" in str(report)
    assert "first calls" in report.save_html(tmp_path / "report.html").read_text()
    held.release()
    # explain's own default judges the compiled graph: it waits
    report = torchfuse.explain(fn, *inputs(), options={"cache_dir": str(tmp_path / "again")})
    assert report.calls_tiered == 0 and report.first_calls == []


def test_inputs_mutated_by_the_graph_are_mutated_by_the_aten_tier(tf, held, tmp_path):
    """An inference graph keeps its input mutations as copy_ (batch norm's running statistics):
    the ATen tier writes them as the kernels would."""
    torch.manual_seed(2)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 6, 3), torch.nn.BatchNorm2d(6), torch.nn.ReLU()).train()
    reference = copy.deepcopy(model)
    compiled = torch.compile(model, backend="torchfuse", options=options(tmp_path))
    x = torch.randn(2, 3, 9, 11)
    with torch.no_grad():
        got, expected = compiled(x), reference(x)
    assert held.launches == 0 and held.events
    tf.assert_same(got, expected)
    tf.assert_same(model[1].running_mean, reference[1].running_mean)
    tf.assert_same(model[1].running_var, reference[1].running_var)


def test_triton_precompile_under_the_interpreter(tf, monkeypatch):
    """Triton: the graph's precompile future (compile workers on a GPU) decides the switch."""
    pytest.importorskip("triton")
    from torchfuse.backends.triton import launch as triton_launch, precompile as triton_precompile
    futures: list[Future] = []

    def precompile(launches, workers):
        futures.append(Future())
        return futures[-1]
    monkeypatch.setattr(triton_precompile, "enabled", lambda: True)
    monkeypatch.setattr(triton_precompile, "precompile", precompile)
    launches = []
    original = triton_launch._launch

    def counting(*args, **kwargs):
        if triton_launch._hook is None:            # (not the planning pass)
            launches.append(args[0])
        return original(*args, **kwargs)
    monkeypatch.setattr(triton_launch, "_launch", counting)
    compiled = torch.compile(fn, backend="torchfuse",
                             options={"first_calls": "eager", "cpu_backend": "triton", "strict": True})
    args = inputs()
    tf.assert_same(compiled(*args), fn(*args), check_stride=True)
    assert len(futures) == 1 and launches == []
    futures[0].set_result(3)
    tf.assert_same(compiled(*args), fn(*args), check_stride=True)
    assert launches, "the call after the precompile launched no kernel"

    # first_calls="wait": the first call waits on the future (here set by another thread)
    torch._dynamo.reset()
    launches.clear()
    compiled = torch.compile(fn, backend="torchfuse",
                             options={"first_calls": "wait", "cpu_backend": "triton", "strict": True})
    timer = threading.Timer(0.05, lambda: [f.set_result(0) for f in futures if not f.done()])
    before = counters["calls_tiered"]
    timer.start()
    try:
        tf.assert_same(compiled(*args), fn(*args))
    finally:
        timer.cancel()
    assert launches and counters["calls_tiered"] == before


def test_outputs_take_the_compiled_graphs_layout():
    """An output whose ATen strides differ from its node's (the compiled graph's) is copied into
    them; an output sharing memory with an input is returned as it is."""
    x = torch.randn(2, 5, 3, 7)
    gm = make_fx(lambda x: (x.relu() * 2, x[:, 1:]))(x)
    out_node = gm.graph.output_node()
    relu_val = out_node.args[0][0].meta["val"]
    out_node.args[0][0].meta["val"] = relu_val.to(memory_format=torch.channels_last)   # as a pass would decide
    tier = EagerTier(gm)
    args = [x]
    got = tier(args)
    assert args == []                                    # boxed: the inputs are handed over
    assert got[0].stride() == x.contiguous(memory_format=torch.channels_last).stride()
    torch.testing.assert_close(got[0], x.relu() * 2)
    assert got[1].data_ptr() == x[:, 1:].data_ptr()      # a view of the input stays one


def test_symbolic_sizes(tf, held, tmp_path):
    """A graph with symbolic sizes (its size inputs are ints) runs through ATen at any size."""
    compiled = torch.compile(fn, backend="torchfuse", dynamic=True, options=options(tmp_path))
    for rows in (13, 6):
        x, y = torch.randn(rows, 7), torch.randn(7, rows + 2)[:, 1:-1]
        tf.assert_same(compiled(x, y), fn(x, y), check_stride=True)
    assert held.launches == 0 and len(held.events) == 1
    held.release()
    torchfuse.wait_compiled(120)
    x, y = torch.randn(9, 7), torch.randn(7, 11)[:, 1:-1]
    tf.assert_same(compiled(x, y), fn(x, y), check_stride=True)
    assert held.launches > 0 and len(held.events) == 1      # (the same graph: no recompile)


def test_saved_cache_artifacts_wait_for_the_background_build(tf, held, tmp_path, monkeypatch):
    """`torch.compiler.save_cache_artifacts()` right after a compile carries the library that
    g++ was still building (runtime/cache_artifacts.py): it waits for the build."""
    cache = pytest.importorskip("torch.compiler._cache")
    monkeypatch.setenv("TORCHFUSE_CACHE_DIR", str(tmp_path))     # (artifacts are of the default cache)
    cache.CacheArtifactManager.clear()
    compiled = torch.compile(fn, backend="torchfuse", options=options(tmp_path))
    args = inputs()
    tf.assert_same(compiled(*args), fn(*args))
    assert len(held.events) == 1 and not held.events[0].is_set()
    threading.Timer(0.2, held.release).start()
    saved = torch.compiler.save_cache_artifacts()
    assert saved is not None
    assert any(k.startswith("cpp/") and k.endswith(".so") for k in saved[1].artifacts["torchfuse"]), saved[1]


def test_training_step_with_running_statistics(tf, held, tmp_path):
    """A training forward keeps batch norm's running-statistics updates as input mutations in
    the graph: the ATen tier performs them, and gradients equal eager's."""
    torch.manual_seed(3)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.BatchNorm2d(8), torch.nn.ReLU(),
                                torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(8, 4)).train()
    reference = copy.deepcopy(model)
    compiled = torch.compile(model, backend="torchfuse", options=options(tmp_path))
    for _ in range(2):
        x = torch.randn(5, 3, 7, 9)
        compiled(x).square().sum().backward()
        reference(x).square().sum().backward()
    assert held.launches == 0 and held.events                 # both steps through ATen
    tf.assert_same(model[1].running_mean, reference[1].running_mean)
    tf.assert_same(model[1].running_var, reference[1].running_var)
    for p, q in zip(model.parameters(), reference.parameters()):
        tf.assert_same(p.grad, q.grad, atol=1e-4, rtol=1e-4)
