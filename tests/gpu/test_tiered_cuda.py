"""Tiered first calls on CUDA (runtime/tiered.py): while a graph's Triton kernels compile in the
worker processes, its calls run through ATen; the first call after the precompile ended runs the
kernels.  The real precompile runs; only its end is held (on an event), so nothing depends on
how fast the workers are.  Skipped without a GPU; run with `python -m pytest tests/gpu`."""
from __future__ import annotations

import copy
import threading
from concurrent.futures import Future

import pytest
import torch

import torchfuse
from torchfuse import counters

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.fixture
def held(monkeypatch):
    """Each graph's precompile (the real one, in the workers) reports its end only once the
    test sets the event."""
    from torchfuse.backends.triton import precompile as triton_precompile
    event = threading.Event()
    real = triton_precompile.precompile
    started: list[Future] = []

    def precompile(launches, workers):
        pending = real(launches, workers)
        if pending is None:
            return None
        out: Future = Future()
        started.append(out)

        def finish():
            event.wait(300)
            out.set_result(pending.result())
        threading.Thread(target=finish, daemon=True).start()
        return out
    monkeypatch.setattr(triton_precompile, "precompile", precompile)
    yield event, started
    event.set()
    torchfuse.wait_compiled(300)


def _close(out, ref, dtype):
    tol = {torch.float32: 1e-4, torch.bfloat16: 5e-2}[dtype]
    torch.testing.assert_close(out, ref, atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_calls_run_through_aten_until_the_precompile_ends(held, dtype):
    event, started = held
    scale = float(torch.rand(()).item()) + 1.0       # (a graph no earlier test compiled)

    def fn(x, w):
        h = torch.nn.functional.gelu(x @ w) * scale
        return h.softmax(-1), h.sum(0)
    x = torch.randn(37, 64, device="cuda", dtype=dtype)
    w = torch.randn(64, 96, device="cuda", dtype=dtype)
    compiled = torch.compile(fn, backend="torchfuse", options={"first_calls": "eager", "strict": True})
    tiered, switches = counters["calls_tiered"], counters["tiered_switches"]
    for o, r in zip(compiled(x, w), fn(x, w)):
        _close(o, r, dtype)
    assert len(started) == 1 and counters["calls_tiered"] - tiered == 1
    event.set()
    torchfuse.wait_compiled(300)
    for o, r in zip(compiled(x, w), fn(x, w)):
        _close(o, r, dtype)
    assert counters["calls_tiered"] - tiered == 1          # the second call ran the kernels
    assert counters["tiered_switches"] - switches == 1


def test_training_step_across_the_switch(held):
    event, started = held
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(48, 80), torch.nn.LayerNorm(80), torch.nn.GELU(),
                                torch.nn.Linear(80, 10)).cuda()
    reference = copy.deepcopy(model)
    compiled = torch.compile(model, backend="torchfuse", options={"first_calls": "eager", "strict": True})

    def step(m, x):
        m.zero_grad()
        loss = m(x).square().mean()
        loss.backward()
        return [loss.detach()] + [p.grad.clone() for p in m.parameters()]
    tiered = counters["calls_tiered"]
    for release in (False, True):
        if release:
            event.set()
            torchfuse.wait_compiled(300)
        x = torch.randn(33, 48, device="cuda")
        for g, e in zip(step(compiled, x), step(reference, x)):
            _close(g, e, torch.float32)
        if not release:
            assert counters["calls_tiered"] - tiered == 2       # forward and backward through ATen
    assert counters["calls_tiered"] - tiered == 2
    assert len(started) == 2


def test_cuda_graphs_wait_for_the_kernels(held):
    """mode="reduce-overhead" captures compiled graphs only: the first call waits."""
    event, _ = held
    threading.Timer(0.5, event.set).start()
    x = torch.randn(64, 128, device="cuda")
    compiled = torchfuse.compile(lambda t: (t * 3).softmax(-1), mode="reduce-overhead",
                                 options={"first_calls": "eager", "strict": True})
    tiered = counters["calls_tiered"]
    for _ in range(3):
        _close(compiled(x).clone(), (x * 3).softmax(-1), torch.float32)
    assert counters["calls_tiered"] == tiered
