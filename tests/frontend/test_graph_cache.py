"""The graph-level cache (frontend/graph_cache.py): a restart loads each compiled graph from
AOTAutograd's bundled cache, under torchfuse's cache directory, instead of tracing it again.

Each case runs fresh processes sharing one cache directory; a child compiles a conv + batch norm
+ MLP model, runs a training step and an inference call, compares both with eager, and reports
AOTAutograd's cache counters and torchfuse's `graph_cache_hits`."""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

CHILD = r'''
import json, os, sys
import torch, torchfuse
from torch._dynamo.utils import counters as torch_counters
from torchfuse.frontend import graph_cache
options = json.loads(sys.argv[1])
if os.environ.get("LOAD_ARTIFACTS"):               # torch's portable cache, saved by another process
    with open(os.environ["LOAD_ARTIFACTS"], "rb") as f:
        torch.compiler.load_cache_artifacts(f.read())
if os.environ.get("FAKE_TORCHFUSE_SOURCE"):        # as if torchfuse's code had changed
    graph_cache.source_hash = lambda: os.environ["FAKE_TORCHFUSE_SOURCE"]
from torchfuse.frontend import saved_program
if os.environ.get("NO_CODE"):                      # as if generated code could not be stored
    graph_cache.capture = lambda call: None
if os.environ.get("NO_RESTORE"):                   # as if stored code could not be linked
    def _refuse(code, config):
        raise OSError("kernels gone")
    graph_cache.restore = _refuse
pickles = []
_pickled = graph_cache._pickled
graph_cache._pickled = lambda copy: pickles.append(1) or _pickled(copy)
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.BatchNorm2d(8), torch.nn.ReLU(),
                            torch.nn.Flatten(), torch.nn.Linear(8 * 6 * 5, 4))
eager = torch.nn.Sequential(*[m for m in model])
state = {k: v.clone() for k, v in model.state_dict().items()}
x = torch.randn(3, 3, 6, 5)
compiled = torchfuse.compile(model, options=options)
compiled(x).square().mean().backward()
grads = [p.grad.clone() for p in model.parameters()]
model.zero_grad()
model.load_state_dict(state)
eager(x).square().mean().backward()
err = max((g - p.grad).abs().max().item() for g, p in zip(grads, model.parameters()))
model.eval()
with torch.no_grad():
    err = max(err, (compiled(x) - eager(x)).abs().max().item())
if os.environ.get("SAVE_ARTIFACTS"):
    with open(os.environ["SAVE_ARTIFACTS"], "wb") as f:
        f.write(torch.compiler.save_cache_artifacts()[0])
print("RESULT", json.dumps({"aot": dict(torch_counters["aot_autograd"]), "builds": torchfuse.counters["kernel_builds"],
                            "hits": torchfuse.counters["graph_cache_hits"],
                            "linked": torchfuse.counters["compiled_graph_loads"],
                            "lowered": torchfuse.counters.seconds.get("lowering", 0.0) > 0,
                            "pickles": len(pickles), "err": err}))
'''


def _run(cache: Path, options: dict | None = None, **env: str) -> dict:
    proc = subprocess.run([sys.executable, "-c", CHILD, json.dumps(options or {})], capture_output=True, text=True,
                          env=dict(os.environ, TORCHFUSE_CACHE_DIR=str(cache), **env), timeout=300)
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            out = json.loads(line[7:])
            assert out["err"] < 1e-4, out
            return out
    raise AssertionError(proc.stderr[-3000:])


def _start(cache: Path, options: dict | None = None) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", CHILD, json.dumps(options or {})], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=dict(os.environ, TORCHFUSE_CACHE_DIR=str(cache)))


def test_restart_loads_graphs_and_changes_miss(tmp_path):
    cold = _run(tmp_path)
    assert cold["aot"].get("autograd_cache_saved") == 2 and cold["hits"] == 0, cold   # training + inference
    assert (tmp_path / "graphs").is_dir()
    warm = _run(tmp_path)
    # AOTAutograd traced nothing: forward, backward and inference graphs came from the cache
    assert warm["aot"].get("autograd_cache_hit") == 2 and not warm["aot"].get("autograd_cache_miss"), warm
    assert warm["hits"] == 3, warm
    assert warm["linked"] == 3 and not warm["lowered"], warm    # the stored code, none of torchfuse's stages
    other_config = _run(tmp_path, {"inline_max_cost": 11})
    assert other_config["aot"].get("autograd_cache_miss") == 2 and other_config["hits"] == 0, other_config
    other_source = _run(tmp_path, FAKE_TORCHFUSE_SOURCE="0" * 32)
    assert other_source["aot"].get("autograd_cache_miss") == 2 and other_source["hits"] == 0, other_source
    off = _run(tmp_path, {"graph_cache": False})
    assert not off["aot"].get("autograd_cache_hit") and off["hits"] == 0, off


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
def test_restart_links_stored_triton_code(tmp_path):
    """Triton graphs (here under Triton's interpreter) keep their generated code in the entry too."""
    options = {"cpu_backend": "triton"}
    cold = _run(tmp_path, options, TRITON_INTERPRET="1")
    assert cold["linked"] == 0 and cold["lowered"], cold
    warm = _run(tmp_path, options, TRITON_INTERPRET="1")
    assert warm["hits"] == 3 and warm["linked"] == 3 and not warm["lowered"], warm


def test_entries_keep_the_graph_only_where_a_hit_compiles_it(tmp_path):
    """Pickling a graph with its fake tensors cost GPT-2 0.6-1.2 s of a cold compile: an entry
    whose code is stored keeps no graph.  Where no code could be stored, the graph is kept and a
    restart compiles it; where stored code cannot be linked and there is no graph, the entry is a
    miss, compiled and stored again."""
    cold = _run(tmp_path)
    assert cold["pickles"] == 0 and cold["aot"].get("autograd_cache_saved") == 2, cold
    unlinkable = _run(tmp_path, NO_RESTORE="1")
    assert unlinkable["hits"] == 0 and unlinkable["aot"].get("autograd_cache_miss") == 2, unlinkable
    assert unlinkable["lowered"], unlinkable
    no_code = tmp_path / "no_code"
    cold = _run(no_code, NO_CODE="1")
    assert cold["pickles"] == 3, cold                       # forward, backward, inference
    warm = _run(no_code, NO_CODE="1")
    assert warm["aot"].get("autograd_cache_hit") == 2 and warm["hits"] == 3, warm
    assert warm["linked"] == 0 and warm["lowered"], warm   # compiled from the stored graphs


def test_damaged_entries_are_rebuilt(tmp_path):
    _run(tmp_path)
    entries = [p for p in (tmp_path / "graphs").rglob("*") if p.is_file()]
    assert entries
    for k, p in enumerate(entries):          # truncated, or overwritten with other bytes
        data = p.read_bytes()
        p.write_bytes(data[: len(data) // 2] if k % 2 == 0 else bytes(reversed(data)))
    rebuilt = _run(tmp_path)                 # correct results (checked in _run), nothing loaded
    assert rebuilt["hits"] == 0, rebuilt
    again = _run(tmp_path)
    assert again["aot"].get("autograd_cache_hit") == 2 and again["hits"] == 3, again


def test_two_processes_racing_on_one_cache(tmp_path):
    procs = [_start(tmp_path) for _ in range(2)]
    for p in procs:
        out, err = p.communicate(timeout=300)
        result = next((json.loads(line[7:]) for line in out.splitlines() if line.startswith("RESULT ")), None)
        assert result is not None and result["err"] < 1e-4, err[-3000:]
    after = _run(tmp_path)
    assert after["aot"].get("autograd_cache_hit") == 2 and after["hits"] == 3, after


def test_a_failing_graph_cache_turns_itself_off(monkeypatch, caplog):
    """If compiling through the graph cache raises (torch internals differ between versions),
    the graph compiles without it, one warning says so, and later compiles skip it."""
    import logging

    import torch

    import torchfuse
    from torchfuse.frontend import graph_cache

    def broken(*args, **kwargs):
        raise TypeError("this torch's SerializableAOTDispatchCompiler takes other arguments")

    monkeypatch.setattr(graph_cache, "serializable", broken)
    monkeypatch.setattr(graph_cache, "_off_reason", None)
    fn = lambda x: torch.relu(x * 2) + 1  # noqa: E731
    x = torch.randn(5, 3)
    with caplog.at_level(logging.WARNING, logger="torchfuse"):
        for _ in range(2):
            torch._dynamo.reset()
            torch.testing.assert_close(torchfuse.compile(fn)(x), fn(x))
    assert graph_cache._off_reason is not None
    assert sum("graph cache is off" in r.message for r in caplog.records) == 1


def test_dynamo_restart_signals_leave_the_graph_cache_on(monkeypatch):
    """A RestartAnalysis raised while compiling (Dynamo's signal to trace again: here the one
    that specializes a float, seen in the soak) is passed on to Dynamo, not taken for a
    graph-cache failure that turns the cache off for the process."""
    import torch
    restart = getattr(torch._dynamo.exc, "TensorifyScalarRestartAnalysis", None)
    if restart is None:
        pytest.skip("this torch has no TensorifyScalarRestartAnalysis")

    from torchfuse.frontend import graph_cache
    real = graph_cache.enabled
    raised = []

    def enabled_once_restarting(*args, **kwargs):
        if not raised:
            raised.append(1)
            raise restart("trace again")
        return real(*args, **kwargs)

    monkeypatch.setattr(graph_cache, "enabled", enabled_once_restarting)
    monkeypatch.setattr(graph_cache, "_off_reason", None)
    torch._dynamo.reset()
    fn = lambda x: (x * 2).sin() + 1  # noqa: E731
    x = torch.randn(4, 5)
    torch.testing.assert_close(torch.compile(fn, backend="torchfuse")(x), fn(x))
    assert raised and graph_cache._off_reason is None


def test_portable_cache_artifacts_carry_graphs_and_kernels(tmp_path):
    """`torch.compiler.save_cache_artifacts()` after a compile, `load_cache_artifacts()` in a
    process with an empty cache directory: its compile is a warm start (every graph a cache hit,
    no kernel built), with eager's results."""
    blob = tmp_path / "artifacts.bin"
    first = _run(tmp_path / "a", SAVE_ARTIFACTS=str(blob))
    assert first["hits"] == 0 and first["builds"] > 0, first
    warm = _run(tmp_path / "b", LOAD_ARTIFACTS=str(blob))
    assert warm["hits"] > 0 and warm["builds"] == 0 and not warm["lowered"], warm
    assert any(p.suffix == ".so" for p in (tmp_path / "b" / "cpp").rglob("*")), "no library carried"
    # a blob altered on the way (one byte of a carried library) fails torch's checksum and loads
    # nothing: a cold compile, with eager's results
    data = blob.read_bytes()
    blob.write_bytes(data.replace(b"\x7fELF", b"\x7fELG", 1))
    cold = _run(tmp_path / "c", LOAD_ARTIFACTS=str(blob))
    assert cold["hits"] == 0 and cold["builds"] > 0, cold


def test_warm_cache_logs_what_it_loaded_from_where(tmp_path, monkeypatch, caplog):
    """With DEBUG logging, a graph-cache hit says what was loaded and from which folder (it said
    nothing), and so does the library it links."""
    import logging

    import torch
    monkeypatch.setenv("TORCHFUSE_CACHE_DIR", str(tmp_path))
    x = torch.randn(9, 6)

    def run():
        torch._dynamo.reset()
        f = torch.compile(lambda a: torch.softmax(a * 1.5, -1) + 2, backend="torchfuse")
        torch.testing.assert_close(f(x), torch.softmax(x * 1.5, -1) + 2)
    run()
    from torchfuse.backends.cpp import build as cpp_build
    cpp_build.clear_memory_cache()
    with caplog.at_level(logging.DEBUG, logger="torchfuse"):
        run()
    text = caplog.text
    assert "graph cache hit" in text and str(tmp_path / "graphs") in text, text[-3000:]
    assert "C++ library loaded from the disk cache" in text and str(tmp_path / "cpp") in text, text[-3000:]
