"""The compiled-graph cache of torchfuse.lazy: sizes are not part of its key (a new batch size
reuses the graph compiled with symbolic sizes: nothing is compiled or built), shape guards still
separate what must be separate (size 1, broadcasting), it is LRU-bounded by
`memory_cache_size`, and the recording-plan cache gives the same results as a fresh recording."""
from __future__ import annotations

import torch
import torch.nn.functional as F

import torchfuse
from torchfuse import counters
from torchfuse.lazy import cache

KEYS = ("graphs_compiled", "kernel_builds", "kernels_generated", "lazy_compiles", "lazy_shape_hits",
        "lazy_cache_hits", "lazy_flushes", "eager_fallbacks")


def snap() -> dict[str, int]:
    return {k: counters[k] for k in KEYS}


def delta(before: dict[str, int]) -> dict[str, int]:
    return {k: counters[k] - v for k, v in before.items()}


def block(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    # pointwise, a row reduction, layer norm, a pending view whose size depends on the batch
    h = (x * 0.5 + 1.0).tanh()
    h = torch.softmax(h, -1) + F.layer_norm(x, (x.shape[-1],), w, b)
    return h.view(x.shape[0] * 2, x.shape[1] // 2).sum(-1)


def test_new_batch_sizes_compile_and_build_nothing():
    torch.manual_seed(0)
    w, b = torch.randn(16), torch.randn(16)
    f = torchfuse.lazy(block, options={"strict": True})
    f(torch.randn(3, 16), w, b)                  # compiles (symbolic sizes)
    before = snap()
    for batch in (5, 8, 13, 64, 7):
        x = torch.randn(batch, 16)
        torch.testing.assert_close(f(x, w, b), block(x, w, b), atol=1e-5, rtol=1e-5)
    d = delta(before)
    assert d["graphs_compiled"] == 0 and d["kernel_builds"] == 0 and d["kernels_generated"] == 0, d
    assert d["lazy_compiles"] == 0 and d["lazy_shape_hits"] == 5, d
    # the same size again is a level-1 (exact) hit
    x = torch.randn(8, 16)
    before = snap()
    torch.testing.assert_close(f(x, w, b), block(x, w, b), atol=1e-5, rtol=1e-5)
    assert delta(before)["lazy_cache_hits"] == 1 and delta(before)["lazy_shape_hits"] == 0


def attention_like(x: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    # what a transformer does with the batch and sequence length of its input: view with an
    # inferred dim and a constant head size, arange(seq), slicing by seq, flatten to (b * s)
    b, s, e = x.shape
    h = x.view(b, s, -1, 4).transpose(1, 2)                  # (b, heads, s, 4)
    pos = table[torch.arange(s)] + table[:s].sin()          # (s, e)
    y = (h.transpose(1, 2).reshape(b, s, e) + pos).relu()
    return y.reshape(b * s, e).sum(-1).view(b, s)


def test_new_sequence_lengths_reuse_the_graph():
    torch.manual_seed(0)
    table = torch.randn(64, 12)
    f = torchfuse.lazy(attention_like, options={"strict": True})
    compiles = []
    # 4 is the head size and 12 the width: batch/sequence values equal to them are the
    # coincidences a size-free key must survive (they may miss; they must never be wrong)
    for b, s in [(2, 5), (3, 9), (2, 33), (4, 7), (5, 12), (3, 4), (2, 21), (6, 6), (7, 13)]:
        x = torch.randn(b, s, 12)
        before = snap()
        torch.testing.assert_close(f(x, table), attention_like(x, table), atol=1e-5, rtol=1e-5)
        compiles.append(delta(before)["lazy_compiles"])
    assert compiles[0] == 1 and compiles[1:4] == [0, 0, 0], compiles
    assert sum(compiles) <= 3, compiles


def positions(b: int, s: int) -> torch.Tensor:
    # a graph with no input tensor: its sizes come from Python ints (arange, expand, slice
    # bounds s and s + 1, the index s - 1 of the last position)
    pos = torch.arange(s).unsqueeze(0).expand(b, s)
    mask = torch.ones(b, s + 1)[:, 1:s + 1]
    last = pos.cumsum(-1)[:, s - 1]
    return (pos * 2 + mask).sum(-1) + last


def test_new_lengths_of_a_graph_without_input_tensors():
    f = torchfuse.lazy(positions, options={"strict": True})
    compiles = []
    for s in (5, 9, 13, 20, 31):
        before = snap()
        torch.testing.assert_close(f(2, s), positions(2, s))
        compiles.append(delta(before)["lazy_compiles"])
    assert compiles == [1, 0, 0, 0, 0], compiles


def heads(x: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    # the head size 64 of the view is also a size of the input `k`, so the graph takes it from
    # there (a symbol, not a constant) and infers the head count as 256 // s: new batch sizes
    # and lengths must still reuse the graph (GPT-2's attention between two pipelined parts
    # looks like this; test_nodes.py checks the Max(1, 256 // s) it can produce)
    b, s, _ = x.shape
    q = x.view(b, s, -1, 64).transpose(1, 2)
    return F.scaled_dot_product_attention(q, k, k).transpose(1, 2).reshape(b, s, -1) * 2


def test_view_inferring_a_dim_from_a_symbolic_size():
    f = torchfuse.lazy(heads, options={"strict": True})
    compiles = []
    for b, s in [(2, 5), (3, 7), (5, 9)]:
        x, k = torch.randn(b, s, 256), torch.randn(b, 4, s, 64)
        before = snap()
        torch.testing.assert_close(f(x, k), heads(x, k))
        compiles.append(delta(before)["lazy_compiles"])
    assert compiles == [1, 0, 0], compiles


def test_dynamic_auto_and_off():
    torch.manual_seed(0)
    w, b = torch.randn(16), torch.randn(16)
    auto = torchfuse.lazy(block, dynamic=None)       # static first, symbolic from the 2nd size
    off = torchfuse.lazy(block, dynamic=False)       # every size compiles

    def compiles_per_call(fn, batches):
        compiles = []
        for batch in batches:
            x = torch.randn(batch, 16)
            before = snap()
            torch.testing.assert_close(fn(x, w, b), block(x, w, b), atol=1e-5, rtol=1e-5)
            compiles.append(delta(before)["lazy_compiles"])
        return compiles

    assert compiles_per_call(auto, (3, 5, 8, 13)) == [1, 1, 0, 0]
    cache.clear()
    assert compiles_per_call(off, (3, 5, 3, 8)) == [1, 1, 0, 1]


def test_guards_separate_shapes_that_need_other_code():
    # Traced with a batch > 1; a batch of 1 (a broadcastable size) breaks a guard and compiles
    # afresh; a different broadcast pattern is a different graph.  Every result is right.
    torch.manual_seed(0)

    def f(x, y):
        return (x * y + 1).exp().sum(0)

    g = torchfuse.lazy(f)
    shapes = [((4, 6), (4, 6)), ((9, 6), (9, 6)), ((1, 6), (1, 6)), ((5, 6), (1, 6)), ((5, 6), (6,)),
              ((7, 6), (7, 6)), ((3, 6), (1, 6))]
    for sx, sy in shapes:
        x, y = torch.randn(sx), torch.randn(sy)
        torch.testing.assert_close(g(x, y), f(x, y), atol=1e-5, rtol=1e-5)


def test_changing_scalar_and_dtype_are_separate_graphs():
    x = torch.randn(6, 5)
    f = torchfuse.lazy(lambda x, s: (x * s).relu() + 1)
    for s in (0.5, 2.0, 0.5, 3):
        torch.testing.assert_close(f(x, s), (x * s).relu() + 1)
    xd = x.double()
    torch.testing.assert_close(f(xd, 2.0), (xd * 2.0).relu() + 1)
    assert f(xd, 2.0).dtype == torch.float64


def test_cache_is_lru_bounded_by_memory_cache_size():
    x = torch.randn(4, 8)
    cache.clear()
    opts = {"memory_cache_size": 4}
    for i in range(12):                      # 12 distinct graphs (the scalar is in the key)
        f = torchfuse.lazy(lambda t: (t * (1.0 + i) - 0.5).sigmoid(), options=opts)
        torch.testing.assert_close(f(x), (x * (1.0 + i) - 0.5).sigmoid())
        exact, shapes = cache.cache_sizes()
        assert exact <= 4 and shapes <= 4, (i, exact, shapes)
    # an evicted graph still computes the right values (it is compiled again)
    f = torchfuse.lazy(lambda t: (t * 1.0 - 0.5).sigmoid(), options=opts)
    torch.testing.assert_close(f(x), (x - 0.5).sigmoid())


def test_flush_counters():
    x = torch.randn(3, 3)
    before = snap()
    with torchfuse.lazy() as ctx:
        y = (x + 1).exp()
        y.sum().item()                        # flush 1
        z = y * 2                              # y is computed: z is a new graph
    assert delta(before)["lazy_flushes"] == len(ctx.flushes) == 2
    torch.testing.assert_close(z, (x + 1).exp() * 2)


def test_recording_plans_match_fresh_recording():
    # The same op on the same layouts reuses a recording plan; ops whose arguments differ only
    # in ways the plan key must see (int vs float scalar, -0.0, layout, dtype) get their own.
    a = torch.randn(4, 5)
    cases = [lambda t: t * 2, lambda t: t * 2.0, lambda t: t + (-0.0), lambda t: t + 0.0,
             lambda t: t.t() * 2, lambda t: t.to(torch.float64) * 2, lambda t: (t > 0) * 2,
             lambda t: t.to(torch.int32) * 2, lambda t: t.to(torch.int32) * 2.5]
    for _ in range(2):
        for fn in cases:
            with torchfuse.lazy():
                got = fn(a + 0)
            want = fn(a + 0)
            assert got.dtype == want.dtype and got.stride() == want.stride()
            torch.testing.assert_close(got, want)
            assert torch.equal(torch.signbit(got), torch.signbit(want))
