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


def test_torch_functions_are_torchs_own():
    """The OpInfo database holds what torch's namespaces hold when it is imported: a library that
    replaces a torch function when imported (torch_geometric wraps torch.index_select and
    torch.select) must not be imported by this process, as tests/models/test_library_zoo.py
    ensures, or the sweeps below would test its wrapper instead of torch's op."""
    own = ("torch", "builtins", "typing", "collections", "typing_extensions")
    foreign = [f"{ns.__name__}.{n}: {f.__module__}" for ns in (torch, torch.nn.functional, torch.Tensor)
               for n in dir(ns) if callable(f := getattr(ns, n, None))
               and isinstance(getattr(f, "__module__", None), str) and f.__module__.split(".")[0] not in own]
    assert not foreign, foreign


@pytest.mark.parametrize("name", WARM_OPS)
def test_opinfo_warm_cache(name, fresh_cache):
    for op in opinfo_sweep.select_ops([name]):
        r = opinfo_sweep.run_op(op, torch.float32, "cpu", max_samples=2, warm=True)
        assert r.status not in ("mismatch", "crash"), f"{r.op}: {r.status}: {r.detail}"
