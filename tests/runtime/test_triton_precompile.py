"""Planning a graph's Triton launches ahead of its first call (triton_precompile.py).

The compile itself needs a GPU (tests/gpu); here the plan is checked under the interpreter:
every kernel of the graph is planned, with the grid, block sizes and warps of the real launch.
"""
from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")    # as the other Triton tests (no kernel runs here)

import pytest  # noqa: E402
import torch  # noqa: E402

import torchfuse  # noqa: E402
from torchfuse.runtime import triton_launch, triton_precompile  # noqa: E402

pytest.importorskip("triton")


def test_planned_launches_match_the_real_ones(monkeypatch):
    planned: list[tuple] = []
    monkeypatch.setattr(triton_precompile, "enabled", lambda: True)     # plan under the interpreter too
    monkeypatch.setattr(triton_precompile, "precompile", lambda launches, workers: planned.extend(launches))
    real: list[tuple] = []
    original = triton_launch._launch

    def recording(kernel, grid, args, constexprs, warps, names=("XBLOCK", "RBLOCK", "BIG")):
        if triton_launch._hook is not None:       # the planning pass: hand it to the planner
            return original(kernel, grid, args, constexprs, warps, names)
        # recorded, not run: the launches are what is compared (outputs are left unwritten)
        real.append((kernel, tuple(grid), tuple(a.dtype if isinstance(a, torch.Tensor) else a for a in args),
                     tuple(constexprs), warps, tuple(names)))
    monkeypatch.setattr(triton_launch, "_launch", recording)

    def fn(x, y, z):
        a = (x * 2.5).softmax(-1)          # a reduction kernel
        b = x.t().contiguous() + y * 3     # a tiled (transposing) kernel
        return a, b, (z + 1.25).sin()      # a pointwise kernel (of its own size: it fuses with neither)
    x, y, z = torch.randn(61, 59), torch.randn(59, 61), torch.randn(37)
    e = torchfuse.explain(fn, x, y, z, options={"cpu_backend": "triton"})
    assert len(e.kernels) == 3
    plans = [(k, tuple(g), tuple(args), tuple(c), w, tuple(n)) for k, g, args, c, w, n in planned]
    assert len(plans) == 3
    assert sorted(set(map(repr, plans))) == sorted(set(map(repr, real)))     # (explain may run it twice)
