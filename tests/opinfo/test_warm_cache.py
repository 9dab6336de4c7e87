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


# index_select: torch_geometric (imported when tests/models/test_library_zoo.py is collected)
# replaces torch.index_select with a Python wrapper, which the OpInfo database then holds: it
# rejects 0-d inputs in eager ("Dimension out of range ... [0, -1]"), so the op keeps one sample,
# and AOTAutograd's cache refuses graphs that call it, so that sample compiles again warm.  The
# op passes where torch_geometric is not imported.
LEAK_SENSITIVE = {"index_select"}


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.xfail(
    reason="leaked eager state from earlier tests (see LEAK_SENSITIVE)", strict=False))
    if n in LEAK_SENSITIVE else n for n in WARM_OPS])
def test_opinfo_warm_cache(name, fresh_cache):
    for op in opinfo_sweep.select_ops([name]):
        r = opinfo_sweep.run_op(op, torch.float32, "cpu", max_samples=2, warm=True)
        assert r.status not in ("mismatch", "crash"), f"{r.op}: {r.status}: {r.detail}"
