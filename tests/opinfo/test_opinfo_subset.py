"""The OpInfo sweep's fast subset (torchfuse.tools.opinfo_sweep.SUBSET, fp32, first 3 samples per
op): every op must match eager; none may crash.  Run the whole database with
`python -m torchfuse.tools.opinfo_sweep --all`."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("expecttest")
pytest.importorskip("numpy")

from torchfuse.tools import opinfo_sweep  # noqa: E402

OPS = opinfo_sweep.select_ops()


@pytest.mark.parametrize("op", OPS, ids=[opinfo_sweep.op_key(o) for o in OPS])
def test_opinfo_subset(op):
    r = opinfo_sweep.run_op(op, torch.float32, "cpu", max_samples=3)
    assert r.status not in ("mismatch", "crash"), f"{r.op}: {r.status}: {r.detail}"
    # the subset is made of ops torchfuse lowers: a new ATen fallback is a regression too
    assert r.status != "fallback", f"{r.op} now falls back to ATen: {r.fallbacks}"


def test_compare_and_tolerance():
    t = torch.tensor([1.0, float("nan")])
    assert opinfo_sweep.compare((t.clone(),), (t,), atol=0, rtol=0) is None
    assert "shape" in opinfo_sweep.compare(t[:1], t, atol=0, rtol=0)
    assert "dtype" in opinfo_sweep.compare(t.double(), t, atol=0, rtol=0)
    assert opinfo_sweep.compare(t + 1, t, atol=1e-5, rtol=1e-5) is not None
    assert opinfo_sweep.compare(torch.ones(3), torch.zeros(3), atol=0, rtol=0, values=False) is None
    add = opinfo_sweep.select_ops(["add"])[0]
    assert opinfo_sweep.tolerance(add, torch.float32) >= opinfo_sweep.DEFAULT_TOL[torch.float32]


def test_table_totals():
    rs = [opinfo_sweep.OpResult("a", "float32", "lowered"), opinfo_sweep.OpResult("b", "float32", "fallback",
                                                                                  fallbacks=["aten.mm: no lowering"])]
    table = opinfo_sweep.format_table(rs)
    assert "| b | float32 | fallback |" in table and "lowered 1, fallback 1, mismatch 0, crash 0" in table
