"""Scatter lowerings (src/torchfuse/lowering/scatter.py) against eager, on both backends.

Each op becomes an initialising kernel and a scatter kernel that runs over the source domain,
with the source's pointwise producer fused into it: the kernel counts below say so, and no op
may run through ATen.  Sums over colliding indices depend on the order of the adds, so
floating results are compared with tolerances for reordered sums.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import torchfuse

BACKENDS = {"cpp": {}, "triton": {"cpu_backend": "triton"}}
# order-dependent sums: a few roundings of the largest partial sum
SUM_TOL = {torch.float32: (1e-4, 1e-4), torch.float16: (3e-2, 2e-2), torch.bfloat16: (0.25, 5e-2)}
INDEX_DTYPES = (torch.int64, torch.int32)


def _idx(shape, high, dtype=torch.int64, low=0):
    """Random indices with many collisions (more indices than positions)."""
    return torch.randint(low, high, shape).to(dtype)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.int64])
def test_scatter_add_fuses_its_source(tf, backend, dtype):
    x, src = tf.rand((7, 5), dtype), tf.rand((23, 5), dtype)
    index = _idx((23, 5), 7)
    atol, rtol = SUM_TOL.get(dtype, (None, None))
    fn = lambda x, i, s: (torch.scatter_add(x, 0, i, s * 2) + 1,)   # noqa: E731
    e = tf.check(fn, x, index, src, options=BACKENDS[backend], kernels=3, atol=atol, rtol=rtol)
    scatter = [k for k in e.kernels if "mul" in k.nodes]
    assert len(scatter) == 1 and "scatter_add" in scatter[0].nodes, [k.nodes for k in e.kernels]
    if backend == "triton":     # Triton's default acq_rel fences every update: 2.5x slower (H100)
        assert "sem='relaxed'" in scatter[0].source, scatter[0].source


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("index_dtype", INDEX_DTYPES)
def test_index_put_accumulate_and_store(tf, backend, index_dtype):
    x, v = tf.rand((9, 4, 3)), tf.rand((17, 3))
    rows = _idx((17,), 9, index_dtype, low=-9)          # negative indices count from the end
    cols = _idx((17,), 4, index_dtype)

    def fn(x, r, c, v):
        a = torch.index_put(x, (r, c), v.exp(), accumulate=True)
        b = torch.index_put(x * 2, (r[:1], c[:1]), v[:1])      # one index: no colliding stores
        return a, b
    tf.check(fn, x, rows, cols, v, options=BACKENDS[backend], kernels=3, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("backend", BACKENDS)
def test_index_put_non_adjacent_and_broadcast(tf, backend):
    x = tf.rand((5, 6, 7))
    i0, i2 = _idx((4, 1), 5), _idx((1, 3), 7, low=-7)
    v = tf.rand((6,))
    tf.check(lambda x, a, b, v: torch.ops.aten.index_put(x, [a, None, b], v, True) * 1, x, i0, i2, v,
             options=BACKENDS[backend], kernels=2, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("reduce", ["sum", "prod", "amax", "amin", "mean"])
@pytest.mark.parametrize("include_self", [True, False])
def test_scatter_reduce(tf, backend, reduce, include_self):
    x, src = tf.rand((6, 8), low=0.5, high=1.5), tf.rand((6, 19), low=0.5, high=1.5)
    index = _idx((6, 19), 8)
    fn = lambda x, i, s: torch.scatter_reduce(x, 1, i, s + 0, reduce, include_self=include_self)  # noqa: E731
    if backend == "triton" and reduce == "prod":
        e = tf.check(fn, x, index, src, options=BACKENDS[backend], allow_fallbacks={"aten.scatter_reduce.two"},
                     atol=1e-4, rtol=1e-4)
        assert [f.op for f in e.fallbacks] == ["aten.scatter_reduce.two"]     # no atomic multiply
        return
    tf.check(fn, x, index, src, options=BACKENDS[backend], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_amax_amin_are_kernels_and_exact(tf, backend, dtype):
    """16-bit scatter max/min (a GAT's softmax max over each node's edges, its index expanded
    over the heads): exact, in kernels on both backends (Triton has no 16-bit atomic max: an
    fp32 buffer, rounded back without loss), with colliding and negative-free indices."""
    x, s = tf.rand((40, 3), dtype), tf.rand((300, 3), dtype)
    dst = torch.randint(0, 40, (300,))

    def fn(x, s, dst):
        i = dst[:, None].expand(-1, 3)
        return (torch.scatter_reduce(torch.zeros_like(x), 0, i, s.exp(), "amax", include_self=False) + x,
                torch.scatter_reduce(x, 0, i, s * 2, "amin"))
    e = tf.check(fn, x, s, dst, options={"strict": True, **BACKENDS[backend]}, atol=0, rtol=0)
    assert not e.fallbacks, e


@pytest.mark.parametrize("backend", BACKENDS)
def test_scatter_src_value_and_int_amax(tf, backend):
    x = tf.rand((5, 9))
    # a permutation per row: every position is written once, so the stores do not collide
    index = torch.stack([torch.randperm(9)[:6] for _ in range(5)])
    src = tf.rand((5, 6))
    xi, si = tf.rand((5, 16), torch.int32), tf.rand((5, 6), torch.int32)
    many = torch.randint(0, 16, (5, 12))      # more than the one-hot lowering's 8 per row

    def fn(x, i, s, xi, si, many):
        return (torch.scatter(x, 1, i, s.sin()), torch.scatter(xi * 1.5, 1, many, 2.5),
                torch.scatter_reduce(xi, 1, i, si, "amax"), torch.scatter_reduce(xi, 1, many, xi[:, :12], "amin"))
    tf.check(fn, x, index, src, xi, si, many, options=BACKENDS[backend])


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_index_add_and_copy(tf, backend, dtype):
    x, src = tf.rand((4, 10, 3), dtype), tf.rand((4, 15, 3), dtype)
    index = _idx((15,), 10)
    perm = torch.randperm(10)[:7]
    atol, rtol = SUM_TOL[dtype]

    def fn(x, i, s, p):
        return torch.index_add(x, 1, i, s * 3, alpha=2), torch.index_copy(x, 1, p, s[:, :7].neg())
    # (a 16-bit sum accumulates in fp32, and a kernel rounds the output, except on Triton, whose
    # fp16 atomics add as CUDA's index_add does; test_scatter_precision.py)
    kernels = 4 if dtype == torch.float16 and backend == "cpp" else 3
    tf.check(fn, x, index, src, perm, options=BACKENDS[backend], kernels=kernels, atol=atol, rtol=rtol)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("op", ["index_put", "scatter_add", "index_add"])
def test_out_of_range_indices_raise_as_eager_does(tf, backend, op):
    """Eager raises an IndexError/RuntimeError for an index past the dim; so does the kernel's
    check (after writing nothing outside the buffer), and in-range indices still work."""
    fns = {"index_put": lambda x, i, v: torch.index_put(x, (i,), v * 2, accumulate=True),
           "scatter_add": lambda x, i, v: torch.scatter_add(x, 0, i, v * 2),
           "index_add": lambda x, i, v: torch.index_add(x, 0, i, v * 2)}
    x, v = torch.rand(6), torch.rand(6)
    guard = torch.full((64,), 7.0)
    fn = torchfuse.compile(fns[op], options=BACKENDS[backend])
    good = torch.tensor([0, 5, 3, 3, 1, 0])
    torch.testing.assert_close(fn(x, good, v), fns[op](x, good, v))
    bad = torch.tensor([0, 6, 1, 100, 5, 2])
    with pytest.raises((IndexError, RuntimeError)):
        fns[op](x, bad, v)
    with pytest.raises((IndexError, RuntimeError), match="out of bounds"):
        fn(x, bad, v)
    assert (guard == 7).all()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("op", ["index_put_", "scatter_add_"])
def test_out_of_range_index_writes_no_row_in_place(tf, backend, op):
    """A bad index into a tensor written in place (a cache) raises, and its value lands in no
    row: the check hands on index 0, and the store's in_bounds must test the loaded index (it
    tested the check's result and wrote the bad element into row 0)."""
    def fn(cache, i, v):
        if op == "index_put_":
            cache.index_put_((i,), v * 2)
        else:
            cache.scatter_add_(0, i, v * 2)
        return cache.sum(0)
    torch._dynamo.reset()
    f = torch.compile(fn, backend="torchfuse", options=BACKENDS[backend])
    cache = torch.randn(9, 5)
    v = torch.randn(5, 5) if op == "index_put_" else torch.randn(4, 5)
    good = torch.tensor([3, 1, 4, 7, 2]) if op == "index_put_" else _idx((4, 5), 9, low=1)
    want = cache.clone()
    torch.testing.assert_close(f(cache, good, v), fn(want, good, v))
    torch.testing.assert_close(cache, want)
    bad = good.clone()
    bad.view(-1)[1] = 9          # no good index writes row 0
    kind = IndexError if op == "index_put_" else RuntimeError      # eager's kinds
    with pytest.raises(kind):
        fn(cache.clone(), bad, v)
    row0 = cache[0].clone()
    with pytest.raises(kind, match="index 9 is out of bounds"):
        f(cache, bad, v)
    torch.testing.assert_close(cache[0], row0, rtol=0, atol=0)


@pytest.mark.parametrize("backend", BACKENDS)
def test_empty_index(tf, backend):
    x = tf.rand((5, 4))
    tf.check(lambda x, i, v: (torch.index_put(x, (i,), v, accumulate=True) + 1,
                              torch.index_add(x, 0, i, v) * 2), x, torch.zeros(0, dtype=torch.int64),
             tf.rand((0, 4)), options=BACKENDS[backend])


@pytest.mark.parametrize("backend", BACKENDS)
def test_gradients_are_scatters(tf, backend):
    """x[idx], embedding and gather backward: accumulating scatters, none through ATen."""
    x = tf.rand((9, 4)).requires_grad_()
    w = tf.rand((11, 5)).requires_grad_()
    idx = _idx((20,), 9, low=-9)
    tok = _idx((3, 7), 11)
    g = _idx((9, 6), 4)

    def fn(x, w, idx, tok, g):
        return (x[idx] * 2).sin(), F.embedding(tok, w, padding_idx=2).exp(), torch.gather(x, 1, g).cos()
    tf.check_grad(fn, x, w, idx, tok, g, options=BACKENDS[backend], atol=1e-4, rtol=1e-4)


def test_scatter_add_backward(tf):
    x = tf.rand((7, 5)).requires_grad_()
    src = tf.rand((12, 5)).requires_grad_()
    index = _idx((12, 5), 7)
    tf.check_grad(lambda x, s, i: torch.scatter_add(x.exp(), 0, i, s * s).tanh(), x, src, index, atol=1e-4, rtol=1e-4)


def test_dynamic_sizes(tf):
    def fn(x, i, v):
        return torch.index_put(x, (i,), v * 2, accumulate=True).relu()
    tf.check_dynamic(fn, [(tf.rand((n, 3)), _idx((m,), n), tf.rand((m, 3))) for n, m in ((5, 9), (8, 17), (11, 4))],
                     atol=1e-4, rtol=1e-4)


def test_deterministic_algorithms_run_float_sums_in_aten(tf):
    """Decided when compiling: Dynamo guards on the flag, so turning it on recompiles the graph,
    which then runs the float sum through ATen (integer sums and plain stores stay kernels) on a
    backend without deterministic scatters (Triton; C++ keeps them: test_scatter_precision.py)."""
    x, v = tf.rand((6, 3)), tf.rand((10, 3))
    i = _idx((10,), 6)
    fn = lambda x, i, v: (torch.index_put(x, (i,), v, accumulate=True) * 2,   # noqa: E731
                          torch.index_put(x.long(), (i,), v.long(), accumulate=True))
    compiled = torchfuse.compile(fn, options={"strict": True, **BACKENDS["triton"]})
    graphs, fallbacks = torchfuse.counters["graphs_compiled"], torchfuse.counters["fallback_ops"]
    tf.assert_same(compiled(x, i, v), fn(x, i, v), atol=1e-5, rtol=1e-5)
    assert torchfuse.counters["fallback_ops"] == fallbacks
    torch.use_deterministic_algorithms(True)
    try:
        tf.assert_same(compiled(x, i, v), fn(x, i, v))
    finally:
        torch.use_deterministic_algorithms(False)
    assert torchfuse.counters["graphs_compiled"] == graphs + 2
    assert torchfuse.counters["fallback_ops"] == fallbacks + 1


# ----------------------------------------------------------------------------------------------
# programs built of scatters: graph layers and mixture-of-experts routing
# ----------------------------------------------------------------------------------------------

def _graph(nodes=37, edges=211):
    return torch.randint(0, nodes, (edges,)), torch.randint(0, nodes, (edges,))


def gcn_layer(x, src, dst, w):
    """Symmetric-normalized graph convolution: degree by scatter, message by gather, sum by
    index_add, then the normalized self loop."""
    h = x @ w
    deg = torch.zeros(x.shape[0]).scatter_add_(0, dst, torch.ones(dst.shape[0])) + 1
    norm = deg.rsqrt()
    msg = h[src] * (norm[src] * norm[dst])[:, None]
    out = torch.zeros_like(h).index_add_(0, dst, msg)
    return F.relu(out + h / deg[:, None])


def gat_layer(x, src, dst, w, a_s, a_d):
    """Graph attention: per-edge scores, a softmax over each node's incoming edges (scatter max,
    scatter sum) and the weighted sum of messages."""
    n = x.shape[0]
    h = x @ w
    e = F.leaky_relu((h * a_s).sum(-1)[src] + (h * a_d).sum(-1)[dst], 0.2)
    m = torch.full((n,), float("-inf"), dtype=x.dtype).scatter_reduce(0, dst, e, "amax", include_self=True)
    p = (e - m[dst]).exp()
    s = torch.zeros(n, dtype=x.dtype).scatter_add(0, dst, p)
    alpha = p / (s[dst] + 1e-16)
    return F.elu(torch.zeros_like(h).index_add_(0, dst, h[src] * alpha[:, None]))


def moe_block(x, wg, w1, w2):
    """Top-2 routing: topk and argsort stay in ATen; the gathers by routing index, the expert
    epilogues and the weighted combine (index_add) are kernels."""
    probs = (x @ wg).softmax(-1)
    topv, topi = probs.topk(2, -1)
    topv = topv / topv.sum(-1, keepdim=True)
    flat = topi.reshape(-1)
    order = flat.argsort()
    tok = order // 2
    e_sorted = flat[order]
    h = F.silu(torch.bmm(x[tok].unsqueeze(1), w1[e_sorted])).squeeze(1)
    y = torch.bmm(h.unsqueeze(1), w2[e_sorted]).squeeze(1) * topv.reshape(-1)[order][:, None]
    return torch.zeros_like(x).index_add_(0, tok, y)


@pytest.mark.parametrize("backend", BACKENDS)
def test_gnn_layers_fuse_around_scatters(tf, backend):
    x, w = tf.rand((37, 16)), tf.rand((16, 16), low=-0.3, high=0.3)
    src, dst = _graph()
    # degree (init + scatter), messages (init + gather-multiply-scatter), the epilogue
    e = tf.check(gcn_layer, x, src, dst, w, options=BACKENDS[backend], kernels=5,
                 allow_fallbacks={"aten.mm.default"}, atol=1e-4, rtol=1e-4)
    assert [f.op for f in e.fallbacks] == ["aten.mm.default"]
    # one kernel initialises all three outputs next to the score sums; max, sum, messages; elu
    tf.check(gat_layer, x, src, dst, w, tf.rand((16,)), tf.rand((16,)), options=BACKENDS[backend], kernels=5,
             allow_fallbacks={"aten.mm.default"}, atol=1e-4, rtol=1e-4)


def test_moe_routing_fuses_around_aten_routing(tf):
    x = tf.rand((20, 16))
    e = tf.check(moe_block, x, tf.rand((16, 4)), tf.rand((4, 16, 32), low=-0.3, high=0.3),
                 tf.rand((4, 32, 16), low=-0.3, high=0.3), kernels=7, atol=1e-4, rtol=1e-4,
                 allow_fallbacks={"aten.mm.default", "aten.topk.default", "aten.sort.default", "aten.bmm.default"})
    assert not {f.op for f in e.fallbacks} & {"aten.index_add.default", "aten.index_put.default",
                                              "aten.scatter_add.default", "aten.index.Tensor"}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.int32])
def test_cpp_parallel_scatters(tf, dtype):
    """The C++ kernels' parallel variants (run on small sizes with parallel_threshold 1): per-thread
    copies for a sum into a small output, atomics for a sum into a large one and for max."""
    opts = {"parallel_threshold": 1}
    x, src = tf.rand((13, 8), dtype), tf.rand((300, 8), dtype)
    idx = _idx((300,), 13)
    big, few = tf.rand((4000,), dtype), _idx((50,), 4000)
    atol, rtol = SUM_TOL.get(dtype, (None, None))

    def fn(x, s, i, big, few, v):
        return (torch.index_add(x, 0, i, s * 2),                                   # private copies
                torch.index_put(big, (few,), v, accumulate=True),                  # atomics
                torch.scatter_reduce(x, 0, i[:, None].expand(-1, 8), s, "amax"))   # compare-and-swap
    tf.check(fn, x, src, idx, big, few, tf.rand((50,), dtype), options=opts, atol=atol, rtol=rtol)


IN_REDUCTIONS = {"scatters_in_reductions": True}


@pytest.mark.parametrize("joined", [True, False])
def test_scatters_join_reductions_by_default(tf, joined):
    """On by default (GAT training measured faster on an H200); off: the scatter keeps a kernel
    of its own, two kernels and the zeros."""
    nodes, edges = 37, 211
    g, x = tf.rand((nodes, 4, 24)), tf.rand((nodes, 4, 24))
    src, dst = torch.randint(0, nodes, (edges,)), torch.randint(0, nodes, (edges,))
    options = BACKENDS["triton"] if joined else {**BACKENDS["triton"], "scatters_in_reductions": False}
    tf.check(gat_message_grads, g, x, tf.rand((edges, 4)), src, dst, nodes, options=options,
             kernels=2 if joined else 3, atol=1e-4, rtol=1e-4)


def gat_message_grads(g, x, alpha, src, dst, nodes: int):
    """A GAT layer's backward at its messages: the attention gradient (row sums of the gathered
    output gradient times the gathered features) and the feature gradient (the gathered output
    gradient times the attention, added into the source nodes)."""
    gd = g[dst]
    score_grad = (gd * x[src]).sum(-1)
    feat_grad = torch.zeros(nodes, *g.shape[1:], dtype=g.dtype).index_add(0, src, gd * alpha[..., None])
    return score_grad, feat_grad


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("edges", [211, 0])
def test_scatter_joins_the_reduction_it_shares_loads_with(tf, backend, dtype, edges):
    """With `scatters_in_reductions`, Triton (Features.scatter_in_reductions) runs the feature
    gradient's index_add inside the attention gradient's row sums, one pass over the gathered
    rows: the zeros and that kernel (a bf16 sum adds into an fp32 buffer: and its rounding).
    C++ runs the scatter in a kernel of its own."""
    nodes = 37
    g, x = tf.rand((nodes, 4, 24), dtype), tf.rand((nodes, 4, 24), dtype)
    src, dst = torch.randint(0, nodes, (edges,)), torch.randint(0, nodes, (edges,))
    alpha = tf.rand((edges, 4), dtype)
    atol, rtol = SUM_TOL[dtype]
    fused = backend == "triton" and edges > 0      # (no edges: no rows, nothing to gain)
    kernels = (2 if fused else 3) + (dtype == torch.bfloat16)
    e = tf.check(gat_message_grads, g, x, alpha, src, dst, nodes, options={**IN_REDUCTIONS, **BACKENDS[backend]},
                 kernels=kernels, atol=atol, rtol=rtol)
    hosts = [k for k in e.kernels if "sum" in k.name and "index_add" in k.name]
    assert len(hosts) == (1 if fused else 0), "\n".join(k.name for k in e.kernels)


@pytest.mark.parametrize("backend", BACKENDS)
def test_gat_layer_gradients_with_fused_scatters(tf, backend):
    """The whole GAT layer through autograd: its backward's scatters in reduction kernels
    (Triton) give eager's gradients."""
    x, w = tf.rand((37, 16)), tf.rand((16, 16), low=-0.3, high=0.3)
    src, dst = _graph()
    a_s, a_d = tf.rand((16,)), tf.rand((16,))
    for t in (x, w, a_s, a_d):
        t.requires_grad_(True)
    tf.check_grad(gat_layer, x, src, dst, w, a_s, a_d, options={**IN_REDUCTIONS, **BACKENDS[backend]},
                  allow_fallbacks={"aten.mm.default"}, atol=1e-4, rtol=1e-4)


def test_scatter_stays_out_of_a_reduction_of_few_rows(tf):
    """Two long rows (a reduction the split pass parallelises into partials) keep their
    scatter in a kernel of its own: a kernel with a scatter is never split."""
    x, idx = tf.rand((2, 4096)), torch.randint(0, 50, (2, 4096))

    def fn(x, idx):
        return x.sum(-1), torch.zeros(2, 50).scatter_add(1, idx, x * 2)
    e = tf.check(fn, x, idx, options={**IN_REDUCTIONS, **BACKENDS["triton"]}, atol=1e-3, rtol=1e-4)
    assert not any("scatter" in k.name and "sum" in k.name for k in e.kernels), [k.name for k in e.kernels]
