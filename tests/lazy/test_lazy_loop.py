"""Loops under torchfuse.lazy build their kernels once: the pending graph of a step is looked up
by its structural signature (ops, scalars, dtypes, sizes, strides), so step 2 onwards runs cached
compiled graphs.  A new batch size finds the graph compiled with symbolic sizes through the
size-free level of the cache (see test_lazy_cache.py), so it compiles nothing either."""
from __future__ import annotations

import torch

import torchfuse
from torchfuse import counters


def step(x: torch.Tensor, w: torch.Tensor, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    h = (x * 0.731 + state).tanh()                  # pointwise
    h = h - h.mean(-1, keepdim=True)                # reduction + broadcast
    y = torch.softmax(h @ w, -1)                    # matmul (eager) + softmax (fused)
    new_state = state * 0.9 + y.sum(-1, keepdim=True) * 0.1
    return y, new_state


def test_loop_builds_kernels_once():
    torch.manual_seed(0)
    w = torch.randn(16, 16)
    xs = [torch.randn(8, 16) for _ in range(100)]
    state = torch.zeros(8, 1)
    ref_state = state.clone()
    builds, graphs, nflush = [], [], []
    with torchfuse.lazy(defer_matmuls=False) as ctx:     # two flushes a step: matmul and .item()
        for i, x in enumerate(xs):
            y, state = step(x, w, state)
            loss = y.max().item()                   # a host read every step
            builds.append(counters["kernel_builds"])
            graphs.append(counters["graphs_compiled"])
            nflush.append(len(ctx.flushes))
    for x in xs:
        ry, ref_state = step(x, w, ref_state)
    torch.testing.assert_close(state, ref_state)
    torch.testing.assert_close(y, ry)
    assert abs(loss - ry.max().item()) < 1e-6
    # Step 0 starts from a plain state tensor, step 1 from a computed one: after step 1 nothing
    # is built or compiled any more, every flush is a cache hit.
    assert builds[-1] == builds[1], builds
    assert graphs[-1] == graphs[1], graphs
    later = ctx.flushes[nflush[1]:-1]
    assert len(later) >= 98 * 2 and all(f.cache_hit for f in later), ctx.explain()[:3000]
    assert all(f.kernels >= 1 for f in later)


def test_loop_over_lazy_blocks_and_decorated_function():
    w = torch.randn(16, 16)

    @torchfuse.lazy
    def f(x):
        return (torch.softmax(x * 1.5, -1) @ w).relu() + 0.25

    out = f(torch.randn(4, 16))
    builds = counters["kernel_builds"]
    compiled = counters["graphs_compiled"]
    for _ in range(100):
        x = torch.randn(4, 16)
        torch.testing.assert_close(f(x), (torch.softmax(x * 1.5, -1) @ w).relu() + 0.25)
    assert counters["kernel_builds"] == builds
    assert counters["graphs_compiled"] == compiled
    assert out.shape == (4, 16)


def test_varying_batch_sizes_build_once_per_size():
    torch.manual_seed(0)
    w = torch.randn(12, 12)
    sizes = [2, 3, 5]
    builds, results = [], []
    with torchfuse.lazy() as ctx:
        for i in range(30):
            b = sizes[i % 3]
            x = torch.randn(b, 12)
            y, _ = step(x, w, torch.zeros(b, 1))
            y.sum().item()                          # flush inside the step
            results.append((x, y))
            builds.append((counters["kernel_builds"], counters["graphs_compiled"]))
    for x, y in results:
        torch.testing.assert_close(y, step(x, w, torch.zeros(x.shape[0], 1))[0])
    # after one round of every size, nothing new is built or compiled
    assert builds[-1] == builds[len(sizes) - 1], builds
    assert all(f.cache_hit for f in ctx.flushes[-10:-1]), ctx.explain()


def test_changing_scalar_arguments_are_correct():
    # Scalars are baked into the graph (they are part of the signature): each value is correct.
    x = torch.randn(5)
    with torchfuse.lazy() as ctx:
        outs = [(x * s + 1).exp() for s in (0.5, 1.5, 0.5)]
    for s, o in zip((0.5, 1.5, 0.5), outs):
        torch.testing.assert_close(o, (x * s + 1).exp())
    assert len(ctx.flushes) == 1


def test_long_running_recurrence_in_place_state():
    # An in-place state update every step (functional recording of `add_` on a pending value)
    # and a flush every step through .item().
    x = torch.randn(32)
    acc = torch.zeros(32)
    ref = acc.clone()
    with torchfuse.lazy() as ctx:
        for i in range(50):
            upd = (x * 0.01).sin()
            acc = acc * 0.5
            acc.add_(upd)
            if i % 10 == 9:
                assert abs(acc.sum().item() - acc.clone().sum().item()) < 1e-5
    for i in range(50):
        ref = ref * 0.5 + (x * 0.01).sin()
    torch.testing.assert_close(acc, ref)
    assert sum(not f.cache_hit for f in ctx.flushes) <= 4, ctx.explain()


def mlp_stack(x: torch.Tensor, ws: list[torch.Tensor]) -> torch.Tensor:
    for w in ws:                                    # 6 recorded ops a layer
        h = torch.nn.functional.layer_norm(x, (x.shape[-1],))
        x = x + torch.nn.functional.gelu(h @ w) * 0.5
    return x.sum(-1)


def test_pipelined_flushes_cut_at_the_same_ops_every_step():
    torch.manual_seed(0)
    ws = [torch.randn(32, 32) / 6 for _ in range(12)]
    xs = [torch.randn(4, 32) for _ in range(4)]
    ctx = torchfuse.lazy(pipeline_ops=16)           # CPU: pipelining only when asked for
    flushes, compiles = [], []
    for x in xs:
        before = (len(ctx.flushes), counters["lazy_compiles"])
        with ctx:
            y = mlp_stack(x, ws)
        torch.testing.assert_close(y, mlp_stack(x, ws), atol=1e-5, rtol=1e-5)
        flushes.append(len(ctx.flushes) - before[0])
        compiles.append(counters["lazy_compiles"] - before[1])
    reasons = [f.reason for f in ctx.flushes[-flushes[-1]:]]
    assert flushes[0] >= 4 and len(set(flushes)) == 1, flushes
    assert reasons.count("pipeline") == flushes[-1] - 1 and reasons[-1] == "end of the lazy block", reasons
    assert compiles[1:] == [0, 0, 0], compiles      # every part is a cache hit from step 2 on
    # off by default on CPU: one flush for the whole stack
    with torchfuse.lazy() as one:
        y = mlp_stack(xs[0], ws)
    assert len(one.flushes) == 1
