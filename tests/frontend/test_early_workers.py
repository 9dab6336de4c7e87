"""Compile workers start while AOTAutograd runs (frontend/graph_compile.py `workers_start_early`):
a compile still running after the delay starts its inputs' backends' workers once; one that
ends before (a graph cache hit) starts none."""
from __future__ import annotations

import threading

import torch

from torchfuse.config import Config
from torchfuse.frontend import graph_compile


def _recording(monkeypatch) -> tuple[list, threading.Event]:
    calls: list = []
    fired = threading.Event()

    def record(inputs, config):
        calls.append([x.device.type for x in inputs if isinstance(x, torch.Tensor)])
        fired.set()
    monkeypatch.setattr(graph_compile, "_start_compile_workers", record)
    return calls, fired


def test_a_long_compile_starts_workers_once(monkeypatch):
    calls, fired = _recording(monkeypatch)
    monkeypatch.setattr(graph_compile, "_starts_workers", lambda inputs, config: True)   # (meta: no backend)
    monkeypatch.setattr(graph_compile, "EARLY_START_DELAY", 0.0)
    with graph_compile.workers_start_early([torch.randn(3, 5, device="meta"), 7], Config()):
        assert fired.wait(30)
    assert calls == [["meta"]]


def test_a_short_compile_starts_none(monkeypatch):
    calls, fired = _recording(monkeypatch)
    monkeypatch.setattr(graph_compile, "_starts_workers", lambda inputs, config: True)
    monkeypatch.setattr(graph_compile, "EARLY_START_DELAY", 60.0)
    with graph_compile.workers_start_early([torch.randn(3, 5, device="meta")], Config()):
        pass
    assert not fired.wait(0.1) and calls == []


def test_cpp_graphs_arm_nothing(monkeypatch):
    """C++ compiles in this process: no timer for CPU inputs (nor for inputs without tensors)."""
    calls, fired = _recording(monkeypatch)
    monkeypatch.setattr(graph_compile, "EARLY_START_DELAY", 0.0)
    for inputs in ([3], [torch.randn(3, 5)]):
        with graph_compile.workers_start_early(inputs, Config()):
            assert not fired.wait(0.1)
    assert calls == []


def test_the_backend_arms_it_before_aot_autograd(monkeypatch):
    """Dynamo's backend arms the early start with the graph's inputs before AOTAutograd runs (the
    aten graph is compiled inside it), and the compiled function matches eager."""
    import contextlib

    from torchfuse.frontend import dynamo
    events: list = []

    @contextlib.contextmanager
    def recording(inputs, config):
        events.append(("armed", [tuple(x.shape) for x in inputs if isinstance(x, torch.Tensor)]))
        yield
        events.append("disarmed")
    original = dynamo.compile_aten_graph

    def compiled(*args, **kwargs):
        events.append("compile")
        return original(*args, **kwargs)
    monkeypatch.setattr(dynamo, "workers_start_early", recording)
    monkeypatch.setattr(dynamo, "compile_aten_graph", compiled)
    torch._dynamo.reset()
    fn = torch.compile(lambda x: (x * 1.5).tanh(), backend="torchfuse", options={"graph_cache": False})
    x = torch.randn(9, 13)
    torch.testing.assert_close(fn(x), (x * 1.5).tanh())
    assert events == [("armed", [(9, 13)]), "compile", "disarmed"]
