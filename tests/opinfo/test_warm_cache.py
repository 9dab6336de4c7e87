"""Every compiled program behaves the same cold and warm: OpInfo samples compiled once (filling
the graph cache), then again from it (every graph a cache hit, none compiled), match eager both
times.  A sample of the fast subset plus the ops whose cached graphs crashed (an ATen fallback
with effect tokens: linalg.inv's error check)."""
from __future__ import annotations

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


# index_select: after tests/backends/cpp/test_cpp_build.py runs in the same process, eager's
# index_select of a 0-d tensor fails ("Dimension out of range ... [0, -1]": a Python prims kernel
# answers it), so the op keeps one sample, which then compiles again warm.  A leaked global state
# still to be found; the op passes alone and with tests/opinfo.
LEAK_SENSITIVE = {"index_select"}


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.xfail(
    reason="leaked eager state from earlier tests (see LEAK_SENSITIVE)", strict=False))
    if n in LEAK_SENSITIVE else n for n in WARM_OPS])
def test_opinfo_warm_cache(name, fresh_cache):
    for op in opinfo_sweep.select_ops([name]):
        r = opinfo_sweep.run_op(op, torch.float32, "cpu", max_samples=2, warm=True)
        assert r.status not in ("mismatch", "crash"), f"{r.op}: {r.status}: {r.detail}"
