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
from torchfuse.backends.triton import launch as triton_launch, precompile as triton_precompile  # noqa: E402

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


def test_split_reductions_of_a_symbolic_graph_are_planned(monkeypatch):
    """A split reduction over a symbolic length binds its split factor at run time with the
    wrapper's `_split_factor`: planning must evaluate that binding, or the kernels reading it are
    left to compile one by one on first launch (76 of a ResNet-18 training step's 120 kernels
    after its dynamic recompile, on an H200)."""
    planned: list[tuple] = []
    calls: list[str] = []
    monkeypatch.setattr(triton_precompile, "enabled", lambda: True)
    monkeypatch.setattr(triton_precompile, "precompile", lambda launches, workers: planned.extend(launches))
    plan = triton_precompile.plan_launches

    def seen(kernel_calls, scope, dtypes, symbols):
        calls.extend(call for call, _ in kernel_calls)
        return plan(kernel_calls, scope, dtypes, symbols)
    monkeypatch.setattr(triton_precompile, "plan_launches", seen)

    def fn(x):
        return (x * x).sum()
    compiled = torch.compile(fn, backend="torchfuse", dynamic=True,
                             options={"cpu_backend": "triton", "split_min_chunk": 256, "strict": True})
    x = torch.randn(6, 2, 64, 64)
    torch.testing.assert_close(compiled(x), fn(x), rtol=1e-4, atol=1e-3)
    assert any("_part_" in call for call in calls), calls           # the split happened
    names = {launch[0].fn.__name__ for launch in planned}
    # every kernel planned (a row of symbolic length: its persistent and looped variants)
    assert {n.rsplit("_", 1)[0] for n in names} == {c.split("(", 1)[1].split(",")[0].rsplit("_", 1)[0]
                                                    for c in calls}, (names, calls)
