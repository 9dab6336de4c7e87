"""Graph inputs updated by a scatter are written in place (lowering/scatter.py, codegen/wrapper.py).

A static KV cache's decode step writes one position of the cache (`cache[:, :, pos] = k`,
`cache.index_copy_(2, pos, k)`, a slice or select assignment): AOTAutograd makes that a
functional index_put / index_copy / slice_scatter / select_scatter plus a `copy_` of the result
back into the input.  torchfuse's scatter kernel writes only those rows, straight into the
input: no kernel copies the cache, no ATen index_put or copy_ runs.
"""
from __future__ import annotations

import pytest
import torch

import torchfuse

BACKENDS = {"cpp": {}, "triton": {"cpu_backend": "triton"}}


class Decode(torch.nn.Module):
    def __init__(self, kind: str):
        super().__init__()
        self.kind = kind
        self.register_buffer("k", torch.randn(2, 3, 17, 8))
        self.register_buffer("v", torch.randn(2, 3, 17, 8))

    def forward(self, pos, k, v, q):
        if self.kind == "tensor":
            self.k[:, :, pos] = k * 0.5              # the new key's scaling fuses into the write
            self.v.index_copy_(2, pos, v)
        else:
            p = int(pos)                           # a Python int: slice and select assignments
            self.k[:, :, p:p + 1] = k * 0.5
            self.v[:, :, p] = v[:, :, 0]
        att = (q @ self.k.transpose(-1, -2)).softmax(-1)
        return att @ self.v


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind", ["tensor", "slice"])
def test_kv_cache_written_in_place(tf, backend, kind):
    eager, compiled = Decode(kind), Decode(kind)
    compiled.load_state_dict(eager.state_dict())
    k_ptr = compiled.k.data_ptr()
    fn = torchfuse.compile(compiled, options={"strict": True, **BACKENDS[backend]})
    for pos in (5, 11, 16):
        args = [tf.rand((2, 3, 1, 8)) for _ in range(3)]
        p = torch.tensor([pos]) if kind == "tensor" else pos
        tf.assert_same(fn(p, *args), eager(p, *args))
        tf.assert_same((compiled.k, compiled.v), (eager.k, eager.v))
    assert compiled.k.data_ptr() == k_ptr
    p = torch.tensor([3]) if kind == "tensor" else 3
    e = tf.explain(compiled, p, *[tf.rand((2, 3, 1, 8)) for _ in range(3)], options=BACKENDS[backend])
    # two scatters of one row each and the softmax: no kernel copies a cache, and neither the
    # writes nor a copy back run through ATen
    assert len(e.kernels) == 3, e
    assert sorted(f.op for f in e.fallbacks) == ["aten.bmm.default"] * 2, e
    scatters = [k for k in e.kernels if k.kind == "pointwise"]
    assert len(scatters) == 2 and all(w.startswith("buf") for k in scatters for w in k.writes), e


@pytest.mark.parametrize("backend", BACKENDS)
def test_accumulate_into_input_in_place(tf, backend):
    """index_put_ with accumulate into a state buffer (a histogram of routed tokens)."""
    def step(counts, idx, w):
        counts.index_put_((idx,), w.exp(), accumulate=True)
        return counts * 2

    counts_e, counts_c = tf.rand((10,)), None
    counts_c = counts_e.clone()
    idx, w = torch.randint(-10, 10, (40,)), tf.rand((40,))
    e = tf.explain(step, counts_c, idx, w, options=BACKENDS[backend])
    expected = step(counts_e, idx, w)
    tf.assert_same(e.output, expected, atol=1e-4, rtol=1e-4)
    tf.assert_same(counts_c, counts_e, atol=1e-4, rtol=1e-4)
    assert len(e.kernels) == 2 and not e.fallbacks, e       # the scatter, then counts * 2


def test_input_read_elsewhere_is_not_overwritten_early(tf):
    """The input's old value is read after the scatter (functionally): the scatter then writes
    a copy, and the copy back runs at the end."""
    def step(cache, pos, k):
        old = cache.sum(-1)
        cache[pos] = k
        return old, cache * 1

    cache_e = tf.rand((6, 5))
    cache_c = cache_e.clone()
    pos, k = torch.tensor([2, 4]), tf.rand((2, 5))
    e = tf.explain(step, cache_c, pos, k)
    tf.assert_same(e.output, step(cache_e, pos, k))
    tf.assert_same(cache_c, cache_e)
