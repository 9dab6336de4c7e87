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
    monkeypatch.setattr(graph_compile, "EARLY_START_DELAY", 0.0)
    with graph_compile.workers_start_early([torch.randn(3, 5), 7], Config()):
        assert fired.wait(30)
    assert calls == [["cpu"]]


def test_a_short_compile_starts_none(monkeypatch):
    calls, fired = _recording(monkeypatch)
    monkeypatch.setattr(graph_compile, "EARLY_START_DELAY", 60.0)
    with graph_compile.workers_start_early([torch.randn(3, 5)], Config()):
        pass
    assert not fired.wait(0.1) and calls == []
    with graph_compile.workers_start_early([3], Config()):      # no tensor: no device to start for
        pass
    assert calls == []


def test_the_backend_starts_them_before_aot_autograd(monkeypatch):
    """Dynamo's backend arms the early start before AOTAutograd traces (the first aten graph
    is compiled after the start), and the compiled function matches eager."""
    events: list[str] = []
    monkeypatch.setattr(graph_compile, "EARLY_START_DELAY", 0.0)
    monkeypatch.setattr(graph_compile, "_start_compile_workers", lambda inputs, config: events.append("start"))
    original = graph_compile.compile_aten_graph

    def compiled(*args, **kwargs):
        import time
        for _ in range(300):         # the timer fires at once; give its thread the GIL
            if events:
                break
            time.sleep(0.01)
        events.append("compile")
        return original(*args, **kwargs)
    monkeypatch.setattr(graph_compile, "compile_aten_graph", compiled)
    from torchfuse.frontend import dynamo
    monkeypatch.setattr(dynamo, "compile_aten_graph", compiled)
    torch._dynamo.reset()
    fn = torch.compile(lambda x: (x * 1.5).tanh(), backend="torchfuse", options={"graph_cache": False})
    x = torch.randn(9, 13)
    torch.testing.assert_close(fn(x), (x * 1.5).tanh())
    assert events[:2] == ["start", "compile"]
