"""Every compiled program behaves the same cold and warm: OpInfo samples compiled once (filling
the graph cache), then again from it (every graph a cache hit, none compiled), match eager both
times.  A sample of the fast subset plus the ops whose cached graphs crashed (an ATen fallback
with effect tokens: linalg.inv's error check)."""
from __future__ import annotations

import types

import pytest
import torch

pytest.importorskip("expecttest")
pytest.importorskip("numpy")

from torchfuse.tools import opinfo_sweep  # noqa: E402

# every fourth op of the subset (all kinds: pointwise, reductions, views, indexing), and the ops
# whose entries failed on a hit
WARM_OPS = opinfo_sweep.SUBSET[::4] + ["linalg.inv", "linalg.cholesky", "linalg.ldl_factor", "linalg.tensorinv"]


@pytest.fixture
def fresh_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHFUSE_CACHE_DIR", str(tmp_path / "cache"))
    yield


@pytest.fixture
def builtin_torch_functions(monkeypatch):
    """torch's own functions, where an imported library replaced them with Python wrappers
    (torch_geometric replaces torch.index_select: its wrapper rejects 0-d inputs in eager, and
    AOTAutograd's cache refuses graphs that call it, under Inductor too); this test is about
    torchfuse's cache, not theirs."""
    for name in dir(torch._C._VariableFunctions):
        fn = getattr(torch, name, None)
        if isinstance(fn, types.FunctionType) and fn.__module__.split(".")[0] != "torch":
            monkeypatch.setattr(torch, name, getattr(torch._C._VariableFunctions, name))
    yield


@pytest.mark.parametrize("name", WARM_OPS)
def test_opinfo_warm_cache(name, fresh_cache, builtin_torch_functions):
    for op in opinfo_sweep.select_ops([name]):
        r = opinfo_sweep.run_op(op, torch.float32, "cpu", max_samples=2, warm=True)
        assert r.status not in ("mismatch", "crash"), f"{r.op}: {r.status}: {r.detail}"
