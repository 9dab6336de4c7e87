"""Indexing ops decomposed into fused gathers and scatters (frontend/index_decompositions.py):
embedding_bag (sum and mean), take, index_fill and put, forward and backward, against eager on
both backends; kernel counts and the ops left in ATen asserted.  Embedding bags decompose only on
backends that ask (Features.embedding_bag_kernels): the C++ backend keeps ATen's, whose CPU
kernel was faster; the tests force the decomposition there to check it too."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import torchfuse

BACKENDS = {"cpp": {}, "triton": {"cpu_backend": "triton"}}


@pytest.fixture
def bag_kernels_on(monkeypatch):
    """Both backends with the embedding-bag decompositions on (off by default: ATen's kernels
    measured faster, on the CPU and on an H100)."""
    import dataclasses

    from torchfuse.backends.cpp import CppBackend
    from torchfuse.backends.triton import TritonBackend
    for cls in (CppBackend, TritonBackend):
        monkeypatch.setattr(cls, "features", dataclasses.replace(cls.features, embedding_bag_kernels=True))


TOL = {torch.float32: (1e-4, 1e-4), torch.bfloat16: (5e-2, 5e-2), torch.float16: (1e-2, 1e-2)}
ROUTING = {"aten.searchsorted.Tensor"}        # each index's bag: a routing op, left to ATen


def _bags(n=41, bags=9, rows=23, index_dtype=torch.int64):
    """Random ids (repeats) and offsets with an empty bag in the middle."""
    idx = torch.randint(0, rows, (n,)).to(index_dtype)
    cuts = torch.sort(torch.randint(1, n, (bags - 2,))).values
    off = torch.cat([torch.zeros(1, dtype=torch.int64), cuts[:3], cuts[2:3], cuts[3:]]).to(index_dtype)
    return idx, off


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("index_dtype", [torch.int64, torch.int32])
@pytest.mark.parametrize("last", [False, True])
def test_embedding_bag_sum_weighted_and_mean_padded(tf, bag_kernels_on, backend, index_dtype, last):
    w = tf.rand((23, 6)).requires_grad_()
    psw = tf.rand((41,)).requires_grad_()
    idx, off = _bags(index_dtype=index_dtype)
    if last:
        off = torch.cat([off, torch.tensor([41], dtype=index_dtype)])

    def fn(w, psw, idx, off):
        s = F.embedding_bag(idx, w * 1.5, off, mode="sum", per_sample_weights=psw, include_last_offset=last)
        m = F.embedding_bag(idx, w, off, mode="mean", padding_idx=4, include_last_offset=last)
        return (s.tanh(), m * 2)
    e = tf.check_grad(fn, w, psw, idx, off, options=BACKENDS[backend], allow_fallbacks=ROUTING, atol=1e-4, rtol=1e-4)
    assert {f.op for f in e.fallbacks} <= ROUTING, e
    assert not any("embedding_bag" in f.op for f in e.fallbacks)
    fwd = [k for k in e.kernels if not k.graph.endswith("_backward")]
    # the positions searchsorted reads; per bag: init + gather-weight-scatter (mean: the count's
    # init + scatter and the division too); tanh; and what the backward saves (bags, counts).  The
    # gathered rows (more than the table's) are gathered again in the backward, not saved
    # (frontend/dynamo.py `_index_select_as_index`)
    assert len(fwd) == 9, e


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_embedding_bag_half_inference(tf, bag_kernels_on, backend, dtype):
    w = tf.rand((23, 8), dtype)
    idx, off = _bags(n=60)
    atol, rtol = TOL[dtype]
    fn = lambda w, i, o: (F.embedding_bag(i, w, o, mode="mean") + 1,)   # noqa: E731
    with torch.no_grad():
        e = tf.check(fn, w, idx, off, options=BACKENDS[backend], atol=atol, rtol=rtol, allow_fallbacks=ROUTING,
                     kernels=6)      # positions; the fp32 sum's and count's init + scatter; epilogue
    assert [f.op for f in e.fallbacks] == ["aten.searchsorted.Tensor"], e


def test_embedding_bag_all_outputs_and_max_stays(tf, bag_kernels_on):
    """The aten op called directly: its four outputs as eager's (bag of each index, bag sizes);
    mode max stays in ATen."""
    w = tf.rand((23, 6))
    idx, off = _bags()
    psw = tf.rand((41,))

    def fn(w, i, o, p):
        a = torch.ops.aten._embedding_bag(w, i, o, False, 1, False, None, False, 3)
        b = torch.ops.aten._embedding_bag(w, i, o, False, 0, False, p)
        return (*a, *b)
    tf.check(fn, w, idx, off, psw, allow_fallbacks=ROUTING, atol=1e-5, rtol=1e-5)
    e = tf.check(lambda w, i, o: F.embedding_bag(i, w, o, mode="max") * 2, w, idx, off,
                 allow_fallbacks={"aten._embedding_bag.default", "aten._embedding_bag_forward_only.default"})
    assert len(e.fallbacks) == 1


def test_embedding_bag_stays_in_aten_on_cpp(tf):
    w = tf.rand((23, 6)).requires_grad_()
    idx, off = _bags()
    e = tf.check_grad(lambda w, i, o: F.embedding_bag(i, w, o, mode="mean").tanh(), w, idx, off,
                      allow_fallbacks={"aten._embedding_bag.default", "aten._embedding_bag_backward.default"},
                      atol=1e-5, rtol=1e-5)
    assert sorted(f.op for f in e.fallbacks) == ["aten._embedding_bag.default", "aten._embedding_bag_backward.default"]


def test_embedding_bag_out_of_range_raises(bag_kernels_on):
    w = torch.rand(10, 4)
    fn = torchfuse.compile(lambda w, i, o: F.embedding_bag(i, w, o) * 2, options=BACKENDS["triton"])
    with pytest.raises((IndexError, RuntimeError)):
        fn(w, torch.tensor([1, 10, 2]), torch.tensor([0, 1]))


@pytest.mark.parametrize("backend", BACKENDS)
def test_take_put_index_fill(tf, backend):
    x = tf.rand((5, 7)).requires_grad_()
    src = tf.rand((9,)).requires_grad_()
    many = torch.randint(-35, 35, (9,))                    # negative and colliding
    unique = torch.randperm(35)[:9] - 17                   # no collisions for a plain store
    taken = torch.randint(-35, 35, (3, 4))
    cols = torch.tensor([0, -2, 3])

    def fn(x, src, many, unique, taken, cols):
        return (torch.take(x * 2, taken).sin(), x.put(many, src * 3, accumulate=True).exp(),
                x.put(unique, src, accumulate=False) + 1, x.index_fill(1, cols, 2.5) * x)
    e = tf.check_grad(fn, x, src, many, unique, taken, cols, options=BACKENDS[backend], atol=1e-4, rtol=1e-4)
    assert not e.fallbacks, e
    # take (a gather, with its sin); per put and the fill: init (fused with the previous epilogue)
    # + scatter; the last product
    assert len([k for k in e.kernels if not k.graph.endswith("_backward")]) == 8, e


@pytest.mark.parametrize("backend", BACKENDS)
def test_empty_indices(tf, backend):
    x = tf.rand((4, 3))
    none = torch.zeros(0, dtype=torch.int64)
    tf.check(lambda x, i, one: (torch.take(x, i) * 2, x.put(i, x[:0, 0], accumulate=True) + 1,
                                x.index_fill(0, i, -1.0) * 3, torch.take(x, one) + 1), x, none, torch.tensor(-5),
             options=BACKENDS[backend])      # (a 0-d index: the stock take read it with .item())
