"""Saved programs (frontend/saved_program.py): `aot_compile` with torchfuse, save, and load in a
fresh process that runs the program without Dynamo, AOTAutograd or torchfuse's stages.

One child process saves, another (started afresh, so nothing is left in memory) loads; both share
a cache directory under tmp_path.  The loading child reports torchfuse's and Dynamo's counters,
the time of its first call and the largest difference from eager on random inputs."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

MODELS = r'''
import torch
def make(name):
    torch.manual_seed(0)
    if name == "mlp":
        model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.LayerNorm(32), torch.nn.GELU(),
                                    torch.nn.Linear(32, 8))
        return model, torch.randn(4, 16)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.BatchNorm2d(8), torch.nn.ReLU(),
                                torch.nn.MaxPool2d(2), torch.nn.Conv2d(8, 8, 3, padding=1), torch.nn.GELU(),
                                torch.nn.Flatten(), torch.nn.Linear(8 * 4 * 4, 5))
    model.eval()                       # (inference: conv + batch norm fold, hoisted out of the call)
    return model, torch.randn(2, 3, 8, 8)

def run(model, x):
    return model(x)
'''

SAVE = r'''
import json, sys, torch, torchfuse
from models import make, run
name, path, options = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
model, x = make(name)
torch.save(model.state_dict(), path + ".state")
with torch.set_grad_enabled(name == "mlp"):
    compiled = torch.compile(run, fullgraph=True, backend="torchfuse", options=options).aot_compile(((model, x), {}))
    err = (compiled(model, x) - model(x)).abs().max().item()
    compiled.save_compiled_function(path)
    err = max(err, (compiled(model, x) - model(x)).abs().max().item())     # still runs after saving
print("RESULT", json.dumps({"err": err}))
'''

LOAD = r'''
import json, os, sys, time
import torch, torchfuse
import torch._dynamo                        # (imported before the clock starts, as a warm start has it)
from torch._dynamo.utils import counters as torch_counters
from torchfuse.frontend import graph_cache
from models import make
if os.environ.get("FAKE_TORCHFUSE_SOURCE"):        # as if torchfuse's code had changed since the save
    graph_cache.source_hash = lambda: os.environ["FAKE_TORCHFUSE_SOURCE"]
name, path = sys.argv[1], sys.argv[2]
model, _ = make(name)
model.load_state_dict(torch.load(path + ".state"))
torch.manual_seed(1)
inputs = [torch.randn_like(make(name)[1]) for _ in range(3)]
train = name == "mlp"
with torch.set_grad_enabled(train):
    t0 = time.perf_counter()
    with open(path, "rb") as f:
        fn = torch.compiler.load_compiled_function(f)
    t1 = time.perf_counter()
    out = fn(model, inputs[0])
    t2 = time.perf_counter()
    print(f"load {t1 - t0:.3f} s, first call {1e3 * (t2 - t1):.1f} ms", file=sys.stderr)
    err = (out - model(inputs[0])).abs().max().item()
    for x in inputs[1:]:
        err = max(err, (fn(model, x) - model(x)).abs().max().item())
    if train:                                # the backward came along too
        fn(model, inputs[0]).square().sum().backward()
        grads = [p.grad.clone() for p in model.parameters()]
        model.zero_grad()
        model(inputs[0]).square().sum().backward()
        err = max(err, max((g - p.grad).abs().max().item() for g, p in zip(grads, model.parameters())))
print("RESULT", json.dumps({"err": err, "load_s": t1 - t0, "first_call_s": t2 - t1,
                            "torchfuse": dict(torchfuse.counters), "seconds": dict(torchfuse.counters.seconds),
                            "dynamo": {k: dict(v) for k, v in torch_counters.items()}}))
'''


def _child(tmp_path: Path, script: str, *args: str, **env: str) -> dict:
    (tmp_path / "models.py").write_text(MODELS)
    proc = subprocess.run([sys.executable, "-c", script, *args], capture_output=True, text=True, timeout=300,
                          cwd=tmp_path, env=dict(os.environ, TORCHFUSE_CACHE_DIR=str(tmp_path / "cache"),
                                                 PYTHONPATH=os.pathsep.join([str(tmp_path), *sys.path]), **env))
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            sys.stderr.write(proc.stderr[-2000:])
            out = json.loads(line[7:])
            assert out["err"] < 1e-4, out
            return out
    raise AssertionError(proc.stderr[-3000:])


def _save(tmp_path: Path, name: str, options: dict | None = None) -> str:
    path = str(tmp_path / f"{name}.tf")
    _child(tmp_path, SAVE, name, path, json.dumps(options or {}))
    assert os.path.getsize(path) > 0
    return path


def _no_tracing(out: dict) -> None:
    """Neither Dynamo nor AOTAutograd traced anything in the loading process."""
    dynamo = out["dynamo"]
    assert not dynamo.get("frames", {}).get("total"), dynamo          # no frame went through Dynamo
    assert not dynamo.get("stats", {}).get("calls_captured"), dynamo
    assert not dynamo.get("aot_autograd", {}).get("total"), dynamo    # AOTAutograd traced no graph


@pytest.mark.parametrize("name,graphs", [("mlp", 2), ("convnet", 1)])   # forward + backward; inference
def test_saved_program_loads_without_tracing_or_lowering(tmp_path, name, graphs):
    path = _save(tmp_path, name)
    out = _child(tmp_path, LOAD, name, path)
    _no_tracing(out)
    counters = out["torchfuse"]
    # every graph's stored code was linked as it was: torchfuse's stages did not run
    assert counters.get("compiled_graph_loads") == graphs and not counters.get("graphs_compiled"), counters
    assert not any(out["seconds"].get(stage) for stage in ("passes", "lowering", "schedule", "codegen")), out
    assert not counters.get("kernel_builds"), counters               # kernels from the kernel cache
    print(f"{name}: load {out['load_s']:.3f} s, first call after load {1e3 * out['first_call_s']:.1f} ms")
    # loading and the first call: a fraction of a second here; generous for slow CI machines
    assert out["load_s"] + out["first_call_s"] <= 5.0, out


def test_saved_program_without_the_kernel_cache_builds_the_kernels(tmp_path):
    """Moved to a machine without the kernel cache: the stored C++ is built again, nothing traced."""
    path = _save(tmp_path, "convnet")
    shutil.rmtree(tmp_path / "cache")
    out = _child(tmp_path, LOAD, "convnet", path)
    _no_tracing(out)
    counters = out["torchfuse"]
    assert counters.get("kernel_builds") and counters.get("compiled_graph_loads") == 1, counters
    assert not counters.get("graphs_compiled"), counters


def test_saved_program_from_other_torchfuse_source_compiles_the_graphs_again(tmp_path):
    """Stored code made by other torchfuse source is not trusted: torchfuse's stages run on the
    stored aten graphs instead (still no Dynamo or AOTAutograd)."""
    path = _save(tmp_path, "mlp")
    out = _child(tmp_path, LOAD, "mlp", path, FAKE_TORCHFUSE_SOURCE="0" * 32)
    _no_tracing(out)
    counters = out["torchfuse"]
    assert counters.get("graphs_compiled") == 2 and not counters.get("compiled_graph_loads"), counters


def test_saving_without_the_graph_cache_says_why():
    def fn(x):
        return torch.nn.functional.gelu(x) * 2

    compiled = torch.compile(fn, fullgraph=True, backend="torchfuse", options={"graph_cache": False})
    try:
        with pytest.raises(Exception, match="graph_cache"):
            compiled.aot_compile(((torch.randn(4, 4),), {}))
    finally:
        torch._dynamo.reset()


@pytest.mark.parametrize("device", [None, "cpu", "meta"])
def test_wrapper_allocators_pickle_as_the_call_that_made_them(device):
    """A wrapper's allocator constants (closures on CUDA and the default device) are stored by how
    they were made, so a stored wrapper links again instead of compiling its graph again."""
    import io
    import pickle

    from torchfuse.frontend.graph_cache import _CodePickler
    from torchfuse.codegen import wrapper
    dev = None if device is None else torch.device(device)
    calls = []
    real = wrapper._allocator.__wrapped__
    alloc = real(dev)
    buf = io.BytesIO()
    _CodePickler(buf).dump(alloc)
    wrapper._allocator.cache_clear()
    try:
        loaded = pickle.loads(buf.getvalue())
        calls.append(wrapper._allocator.cache_info().misses)
    finally:
        wrapper._allocator.cache_clear()
    out = loaded((2, 3), (1, 2), torch.float16)
    assert out.shape == (2, 3) and out.stride() == (1, 2) and out.dtype == torch.float16
    assert out.device == (dev or torch.empty(0).device)
    assert calls == [1 if alloc is not getattr(torch._C._dynamo.guards, "_empty_strided_cpu", None) else 0]
