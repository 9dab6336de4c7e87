"""A scatter of whole rows runs as a 2-D row tile (backends/triton/codegen.py `scatter_tile`): x
along the row, y along the edges, the scatter's index read once per row ([YBLOCK, 1] under
`ymask`) instead of once per element.  Here: which scatters are tiled, and that they compute
what eager computes under Triton's interpreter (odd widths so every tile edge is masked, rows
wider than one tile, negative indices, low precision, a batch dim outside the tile, a
gradient, and an out-of-range index still caught)."""
from __future__ import annotations

import os
import re

import pytest
import torch

os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

TRITON = {"cpu_backend": "triton"}


def _scatter_sources(e) -> list[str]:
    return [k.source for k in e.kernels if "tl.atomic_add" in k.source or "tl.atomic_max" in k.source]


def _row_tiled(source: str) -> bool:
    # the tiled variant, with the index read once per row
    return "_tiled(" in source and re.search(r"\+ yzero, mask=ymask", source) is not None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("width", [16, 47, 256, 300])
def test_gather_relu_index_add_is_row_tiled(tf, dtype, width):
    n, e = 29, 101
    x = tf.rand((n, width), dtype)
    ei = torch.randint(0, n, (2, e))

    def gin(x, ei):
        msg = torch.relu(x).index_select(0, ei[0])
        return torch.zeros(n, width, dtype=x.dtype).index_add_(0, ei[1], msg) + x

    tol = {"atol": 5e-2, "rtol": 5e-2} if dtype == torch.bfloat16 else {}
    got = tf.check(gin, x, ei, options=TRITON, **tol)
    sources = _scatter_sources(got)
    assert len(sources) == 1 and _row_tiled(sources[0]), sources


def test_narrow_rows_stay_flat(tf):
    x, idx = tf.rand((300, 8)), torch.randint(0, 11, (300,))
    got = tf.check(lambda x, i: torch.zeros(11, 8).index_add_(0, i, x), x, idx, options=TRITON)
    sources = _scatter_sources(got)
    assert len(sources) == 1 and "_tiled(" not in sources[0], sources


def test_scatter_add_with_expanded_index_and_edge_weight(tf):
    n, e, f = 31, 97, 40
    x, w = tf.rand((n, f)), tf.rand((e,))
    ei = torch.randint(0, n, (2, e))

    def gcn(x, w, ei):
        msg = x[ei[0]] * w[:, None]
        return torch.zeros_like(x).scatter_add(0, ei[1].view(-1, 1).expand(-1, f), msg)

    sources = _scatter_sources(tf.check(gcn, x, w, ei, options=TRITON))
    assert len(sources) == 1 and _row_tiled(sources[0]), sources
    # the per-edge weight is a row value too
    assert re.search(r"tl\.load\(in\d \+ \(x0\) \+ yzero", sources[0]), sources[0]


def test_accumulating_index_put_with_negative_indices(tf):
    vals, idx = tf.rand((53, 33)), torch.randint(-17, 17, (53,))
    got = tf.check(lambda v, i: torch.ones(17, 33).index_put_((i,), v * 2, accumulate=True), vals, idx,
                   options=TRITON)
    sources = _scatter_sources(got)
    assert len(sources) == 1 and _row_tiled(sources[0]), sources


def test_index_add_along_a_middle_dim(tf):
    # rows along the last dim, edges along dim 1, a batch dim outside the tile
    src, idx = tf.rand((3, 45, 20)), torch.randint(0, 13, (45,))
    got = tf.check(lambda s, i: torch.zeros(3, 13, 20).index_add_(1, i, s.sin()), src, idx, options=TRITON)
    sources = _scatter_sources(got)
    assert len(sources) == 1 and _row_tiled(sources[0]), sources


@pytest.mark.parametrize("heads, channels, joined", [(4, 16, True), (3, 20, True), (8, 64, False)])
def test_heads_join_the_row(tf, heads, channels, joined):
    # a GAT's messages [edges, heads, channels] summed into [nodes, heads, channels]: heads and
    # channels are one contiguous row, covered by x while it fits ROW_TILE_XBLOCK (256)
    n, e = 23, 89
    x, alpha = tf.rand((n, heads, channels)), tf.rand((e, heads))
    ei = torch.randint(0, n, (2, e))

    def gat(x, alpha, ei):
        msg = x.index_select(0, ei[0]) * alpha.unsqueeze(-1)
        return torch.zeros(n, heads, channels).index_add_(0, ei[1], msg)

    sources = _scatter_sources(tf.check(gat, x, alpha, ei, options=TRITON))
    assert len(sources) == 1 and _row_tiled(sources[0]), sources
    assert ("xrow = " in sources[0]) == joined, sources[0]
    if joined:      # no dim left outside the tile
        assert "zindex" not in sources[0], sources[0]


def test_scatter_amax_rows(tf):
    x, idx = tf.rand((70, 24)), torch.randint(0, 9, (70,))
    fn = lambda x, i: torch.full((9, 24), -5.0).scatter_reduce(   # noqa: E731
        0, i.view(-1, 1).expand(-1, 24), x, "amax", include_self=True)
    sources = _scatter_sources(tf.check(fn, x, idx, options=TRITON))
    assert len(sources) == 1 and _row_tiled(sources[0]), sources


def test_embedding_gradient(tf):
    weight = tf.rand((50, 32)).requires_grad_()
    tokens = torch.randint(0, 50, (7, 9))
    got = tf.check_grad(lambda w, t: torch.nn.functional.embedding(t, w).tanh(), weight, tokens, options=TRITON)
    assert any(_row_tiled(s) for s in _scatter_sources(got)), [k.source for k in got.kernels]


def test_out_of_range_index_raises(tf):
    import torch._dynamo
    x, idx = tf.rand((40, 32)), torch.randint(0, 11, (40,))
    idx[17] = 11
    torch._dynamo.reset()
    compiled = torch.compile(lambda x, i: torch.zeros(11, 32).index_add_(0, i, x.exp()), backend="torchfuse",
                             options={**TRITON, "strict": True})
    with pytest.raises(IndexError, match="index 11 is out of bounds"):
        compiled(x, idx)


def test_scatter_kernels_are_never_autotuned(tf, monkeypatch):
    # the autotuner runs each candidate configuration many times: an atomic add would add again
    from types import SimpleNamespace

    from torchfuse.backends.triton import launch
    x, idx = tf.rand((64, 32)), torch.randint(0, 9, (64,))
    got = tf.check(lambda x, i: torch.zeros(9, 32).index_add_(0, i, x.exp()) + 1, x, idx, options=TRITON)
    sources = _scatter_sources(got)
    assert len(sources) == 1 and re.search(r"^poi_\w+_tiled\._tf_no_tune = True$", sources[0], re.M), sources
    others = [k.source for k in got.kernels if k.source not in sources]
    assert others and not any("_tf_no_tune" in s for s in others), others
    monkeypatch.setitem(launch._autotune_modules, "tf_module", True)
    kernel = SimpleNamespace(fn=SimpleNamespace(__module__="tf_module", __name__="k"))
    assert launch._tuning(kernel)
    kernel._tf_no_tune = True
    assert not launch._tuning(kernel)
