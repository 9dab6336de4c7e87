"""View and indexing lowerings (src/torchfuse/lowering/views.py) against eager.

Views are checked both on graph inputs / realized buffers (zero-copy strided path) and on
unrealized values (index-remapping closures that fuse into their consumers); every result is
used by a computation so that torchfuse, not AOTAutograd, produces it.
"""
from __future__ import annotations

import os
import re

import pytest
import torch
import torch.nn.functional as F

import torchfuse

NAN = float("nan")


@pytest.mark.parametrize("dtype", [torch.float32, torch.int64, torch.float16, torch.bool])
def test_view_reshape(tf, dtype):
    x = tf.rand((6, 4, 5), dtype)
    xt = tf.rand((5, 4, 6), dtype).permute(2, 1, 0)      # non-contiguous: reshape copies

    def fn(x, xt):
        y = x * 1 if dtype != torch.bool else x | x      # unrealized value
        return (x.view(24, 5) * 1, x.view(6, 20).view(3, 40) * 1, y.view(120), y.view(2, 3, 4, 5).view(8, 15),
                y.reshape(5, 24), x.reshape(-1, 3) * 1, y.view(6, 4, 5, 1).view(1, 120), xt.reshape(24, 5) * 1,
                xt.reshape(-1), y.flatten(1), y.unflatten(2, (5, 1)), x.view(4, 30)[1:3], y.view(3, 2, 20)[:, 1],
                xt.flatten(0, 1) * 1, y.reshape(12, 10).t(), (x.view(120)[::7] * 1), y[0, 0, 0])
    tf.check(fn, x, xt)


def test_merge_then_split(tf):
    """Merging two dims and splitting differently needs div/mod index arithmetic."""
    x = tf.rand((6, 10, 7))
    tf.check(lambda x: ((x + 1).view(60, 7).view(4, 15, 7) * 2, (x * 2).view(6, 70).view(6, 7, 10).exp(),
                        (x + 1).reshape(3, 2, 5, 2, 7).permute(4, 3, 2, 1, 0).reshape(14, 30) + x.view(30, 14).t(),
                        (x.transpose(0, 2) + 1).reshape(7 * 10, 6), (x.transpose(0, 1) * 3).reshape(2, 5,
                        42).sum(1)), x)


@pytest.mark.parametrize("dtype", [torch.float32, torch.int32])
def test_permute_transpose_expand(tf, dtype):
    x = tf.rand((3, 5, 7), dtype)
    b = tf.rand((5, 1), dtype)
    s = tf.rand((), dtype)

    def fn(x, b, s):
        y = x + 1
        return (x.permute(2, 0, 1) + 1, y.permute(1, 2, 0) * 2, x.transpose(0, 2) * 1, y.transpose(-1, -2),
                y[0].t(), x[1].t() + 1, b.expand(5, 4) + 1, (b * 2).expand(3, 5, 6), s.expand(2, 3) * 1,
                b.expand(-1, 9) * 1, x.movedim(0, -1) * 1, y.swapaxes(0, 1), b.t().expand(7, 5) * y[0].t(),
                (s + 1).expand(4), y.mT, x.unsqueeze(1).expand(3, 4, 5, 7) * 1)
    tf.check(fn, x, b, s)


def test_slice_select_squeeze(tf):
    x = tf.rand((9, 8, 7))

    def fn(x):
        y = x * 2
        return (x[1:7:2] + 1, y[:, ::3], y[..., 2:-1], x[::2, 1::3, ::4] * 1, y[-3:], y[:, -1], x[2] + 1,
                y[:, :, -2], x[:, 3, 1:] * 1, y[8, 7, 6], y[0:0], y[5:2], y[:, 100:], x[-100:2] + 1,
                y.unsqueeze(0), y.unsqueeze(-1)[..., 0], y[:, :1].squeeze(1), y[:1, :, :1].squeeze(), y[:1].squeeze(0),
                y[None, :, None, 2], y.narrow(1, 2, 3), y[1::2][::2], y.flip(0))
    tf.check(fn, x)


def test_slice_of_noncontiguous_input(tf):
    x = tf.rand((10, 12)).t()[1:, ::2]          # an input that is already a strided view
    tf.check(lambda x: (x + 1, x[::3] * 2, x.t()[2:5] - 1, x[:, 1:4].sum(1), x.reshape(-1) * 1), x)


def test_split_chunk_unbind(tf):
    x = tf.rand((7, 10))

    def fn(x):
        y = x * 2
        a, b, c = y.split(3)                  # uneven: 3, 3, 1
        d = torch.split(x, [2, 5, 3], dim=1)
        e = y.chunk(4, dim=1)                 # 3, 3, 3, 1
        u = x.unbind(1)
        v = y.unbind(0)
        return (a + 1, b * c, c.exp(), *[t + 1 for t in d], *[t.sum(1) for t in e], u[0] + u[9], v[6] * 3,
                torch.stack(u[:3], 1) * 1, y.tensor_split(3)[1] + 1)
    tf.check(fn, x)


def test_flip_roll_repeat(tf):
    x = tf.rand((5, 7, 3))

    def fn(x):
        y = x + 1
        return (x.flip(0) * 1, y.flip(1, 2), y.flip(-1), x.roll(2, 0) * 1, y.roll(-3, 1), y.roll(9, 1),
                y.roll((1, -1), (0, 2)), y.roll(-12, -2), x.repeat(2, 1, 3) * 1, y.repeat(2, 1, 1, 2),
                y[0].repeat(3, 1), x.transpose(0, 2).flip(0) * 1)
    tf.check(fn, x)


def test_roll_flattened(tf):
    """roll without dims rolls the flattened tensor."""
    x = tf.rand((5, 7))
    tf.check(lambda x: (x.roll(3) * 1, (x * 2).roll(-8), x.t().roll(4) + 1), x)


def test_cat(tf):
    a = tf.rand((3, 5))
    b = tf.rand((4, 5))
    c = tf.rand((5, 3)).t()
    i = tf.rand((2, 5), torch.int64)
    h = tf.rand((1, 5), torch.float16)
    e = tf.rand((0, 5))
    legacy = torch.empty(0)     # a 1-d empty tensor is skipped by cat, whatever its rank

    def fn(a, b, c, i, h, e, legacy):
        return (torch.cat([a, b]), torch.cat([a, b * 2, c], 0) + 1, torch.cat([a, c], 1), torch.cat([a.t(), c.t()], -1),
                torch.cat([a, i]), torch.cat([h, a]), torch.cat([i, h]), torch.cat([e, a, e]), torch.cat([a,
                legacy, b]),
                torch.cat([e, e]), torch.cat([a]) * 2, torch.cat([a.exp(), b.sum(0, keepdim=True)]),
                torch.cat([a[:, :2], a[:, 3:]], 1), torch.cat([a.unsqueeze(0), c.unsqueeze(0)]).sum(0),
                torch.stack([a, c], 2), torch.cat([(a > 0), (b > 0)]), torch.hstack([a, c]), torch.vstack([a, b, c]))
    tf.check(fn, a, b, c, i, h, e, legacy)


def test_cat_special_values(tf):
    """NaN / inf in one part never leak into another part (masked loads)."""
    a = torch.tensor([[NAN, float("inf")], [1.0, -0.0]])
    b = torch.tensor([[2.0, 3.0]])
    tf.check(lambda a, b: (torch.cat([a, b]) * 1, torch.cat([b.t(), a], 1) + 0,
                           torch.cat([a.log(), b.log()])), a, b, signed_zeros=True)


def test_constant_pad(tf):
    x = tf.rand((3, 5, 7))
    i = tf.rand((4, 6), torch.int32)

    def fn(x, i):
        y = x * 2
        return (F.pad(x, (1, 2)), F.pad(y, (0, 0, 3, 1)), F.pad(y, (2, 2, 2, 2, 1, 1), value=-1.5), F.pad(x, (-1, -2)),
                F.pad(y, (-2, 3, 1, -1)), F.pad(x, (1, 1), value=float("nan")), F.pad(i, (1, 2, 0, 1), value=7),
                F.pad(x.transpose(1, 2), (1, 0)) + 1, F.pad(y, (0, 0, -5, 0)), F.pad(y.exp(), (3, 3)).sum(-1),
                F.pad(y[0], (-7, 0, 0, 0)))
    tf.check(fn, x, i)


def test_index_select_gather_embedding(tf):
    x = tf.rand((6, 8))
    idx = torch.tensor([5, 0, 3, 3, 1])
    g = torch.randint(0, 8, (4, 5))
    g6 = torch.randint(0, 8, (6, 5))
    g0 = torch.randint(0, 6, (3, 8))
    w = tf.rand((50, 7))
    tok = torch.randint(0, 50, (3, 4))
    tok[0, 0] = 0

    def fn(x, idx, g, g6, g0, w, tok):
        y = x * 2
        return (x.index_select(0, idx) + 1, y.index_select(1, idx), torch.gather(x, 1, g) * 1, torch.gather(y, 0, g0),
                torch.gather(y.t(), 0, g.t()), F.embedding(tok, w) * 1, F.embedding(tok, w, padding_idx=0),
                F.embedding(tok[0], w * 3), w[tok] + 1, x.t().index_select(0, idx) * 1,
                torch.take_along_dim(y, g6, 1))
    tf.check(fn, x, idx, g, g6, g0, w, tok)


def test_advanced_indexing(tf):
    x = tf.rand((6, 7, 5))
    i = torch.tensor([4, 0, -1, 2])       # negative indices count from the end
    j = torch.tensor([[1, 5], [0, -2]])
    k = torch.tensor([3, 3, 0, 1])

    def fn(x, i, j, k):
        y = x + 1
        return (x[i] * 1, y[:, i], y[..., k], y[i, k], y[i, :, k], y[j], y[:, j], y[i[:2, None], j],
                x[i, k, k] + 1, y[1:, i], y[i][:, ::2], x.transpose(0, 1)[k] * 1, y[:, j, 2], x[i.view(2,
                2)].sum(), y[-1, i])
    tf.check(fn, x, i, j, k)


def test_int_index_dtypes(tf):
    x = tf.rand((9, 4))
    i32 = torch.tensor([8, 1, 0, 4], dtype=torch.int32)
    tf.check(lambda x, i32: (x[i32] * 1, x.index_select(0, i32) + 1, x[i32.long(), 1:]), x, i32)


def test_select_slice_scatter_direct(tf):
    x = tf.rand((6, 7))
    s = tf.rand((7,))
    c = tf.rand((6,))
    p = tf.rand((2, 7))
    q = tf.rand((6, 3))

    def fn(x, s, c, p, q):
        return (torch.select_scatter(x, s, 0, 2), torch.select_scatter(x * 2, c, 1, -1),
        torch.select_scatter(x, s, 0, -6),
                torch.slice_scatter(x, p, 0, 1, 3), torch.slice_scatter(x, p, 0, 1, 5, 2),
                torch.slice_scatter(x * 1, q, 1, 0, 7, 3), torch.slice_scatter(x, q, 1, -3),
                torch.slice_scatter(x, p, 0, 4))
    tf.check(fn, x, s, c, p, q)


def test_scatters_through_autograd(tf):
    """The backward of slicing / selecting / indexing writes gradients into zeros: slice_backward,
    select_backward (slice_scatter / select_scatter after decomposition) and gather backward."""
    x = tf.rand((6, 9)).requires_grad_()
    tf.check_grad(lambda x: (x[1:5:2] * 3, x[:, 2].exp(), x[-1] * x[0], x[:, 1::4].sin(), x.t()[2:4]), x)


def test_view_backward_through_autograd(tf):
    x = tf.rand((4, 6)).requires_grad_()
    w = tf.rand((50, 3)).requires_grad_()
    tok = torch.randint(0, 50, (2, 5))
    tf.check_grad(lambda x, w, tok: ((x.view(2, 12).t() * 2).sum(0), x.permute(1, 0).flip(0) * x.t(),
                                     F.pad(x, (1, 2, -1, 0)).exp(), torch.cat([x, x * 2], 1).tanh(),
                                     F.embedding(tok, w).sum(-1), w[tok[0]] * 2, w.index_select(0, tok[1]).sin(),
                                     torch.gather(x, 1, tok[:, :4] % 6).exp()), x, w, tok,
                  # scatter-adds of the backward (duplicate indices accumulate) run in ATen
                  allow_fallbacks={"aten.embedding_dense_backward.default", "aten.index_put.default",
                                   "aten.index_add.default", "aten.scatter_add.default"})


def test_outputs_that_are_views_of_inputs(tf):
    """Graphs returning inputs or views of them: values, strides and aliasing as in eager."""
    x = tf.rand((5, 7))

    def fn(x):
        return x.t(), x[1:], x, x[:, ::2], x.view(7, 5), x.unsqueeze(0), x[2]
    expected = fn(x)
    e = tf.explain(fn, x)
    tf.assert_same(e.output, expected, check_stride=True)
    for got, exp in zip(e.output, expected):
        assert got.storage_offset() == exp.storage_offset()
        assert got.untyped_storage().data_ptr() == x.untyped_storage().data_ptr(), "view must alias the input"
    assert e.output[2] is x or e.output[2].data_ptr() == x.data_ptr()


def test_outputs_mixing_views_and_compute(tf):
    x = tf.rand((5, 7))

    def fn(x):
        y = x * 2
        return x.t(), y, y.t(), y[1:, ::2], x + 1, y.view(35), x
    e = tf.check(fn, x)
    assert e.output[0].untyped_storage().data_ptr() == x.untyped_storage().data_ptr()
    assert e.output[6].data_ptr() == x.data_ptr()


def test_outputs_that_are_views_of_intermediates(tf):
    """Outputs viewing another (returned) intermediate alias it and keep eager's strides."""
    x = tf.rand((5, 7))

    def fn(x):
        y = x * 2
        return y, y.t(), y[1:, ::2]
    e = tf.check(fn, x, check_stride=True)
    y, yt, ys = e.output
    assert yt.untyped_storage().data_ptr() == y.untyped_storage().data_ptr()
    assert ys.untyped_storage().data_ptr() == y.untyped_storage().data_ptr()


def test_view_of_a_keepdim_reduction_is_no_copy(tf):
    """A bias gradient's `sum(0, keepdim=True).view(-1)`, returned after other kernels: the
    view aliases the reduction's buffer (a size-1 dimension's stride differs between the
    buffer and the fake tensor, and comparing it made the view a copy kernel of its own)."""
    t, a, c = tf.rand((50, 33)), tf.rand((7, 9)), tf.rand((3,))

    def fn(t, a, c):
        return t.sum(0, keepdim=True).view(-1), (a * 2).sum(1), c.exp(), t.amax(1, keepdim=True).view(5, 10)
    tf.check(fn, t, a, c, kernels=4, check_stride=True)


def test_views_of_fallback_results(tf):
    """Views of an ATen result (mm) are zero-copy strided loads in the consumer kernel."""
    a = tf.rand((6, 5))
    b = tf.rand((5, 8))
    tf.check(lambda a, b: ((a @ b).t() + 1, (a @ b)[1::2, 2:].exp(), (a @ b).view(4, 12).sum(0)), a, b,
             allow_fallbacks={"aten.mm.default"})


def test_empty_and_zero_dim_views(tf):
    e = tf.rand((0, 4))
    s = tf.rand(())
    tf.check(lambda e, s: (e.t() + 1, e.view(4, 0) * 2, e.reshape(0, 2, 2) + s, s.view(1, 1) * 3, s.reshape(1) + 1,
                           s.expand(3) * 2, s.unsqueeze(0).repeat(4), torch.cat([e, s.expand(1, 4)])), e, s)


def test_diagonal_and_as_strided(tf):
    x = tf.rand((5, 5))
    tf.check(lambda x: (x.diagonal() + 1, (x * 2).diagonal(1), x.as_strided((2, 2), (1, 5)) * 3,
                        x.diagonal(-2).exp()), x)


def test_flip_of_sliced_repeat(tf):
    x = tf.rand((4,))
    tf.check(lambda x: x.repeat(3)[1:9].flip(0) * 1, x)


def test_roll_backward_of_flip(tf):
    """The backward of roll is a roll by -shift; after flip the index is (c - i): checked through
    the roll lowering, which must not produce a negative `%` operand."""
    x = tf.rand((4, 6)).requires_grad_()
    tf.check_grad(lambda x: x.permute(1, 0).flip(0).roll(1, 0) * x.t(), x)
    tf.check(lambda x: (x.roll(-1, 0).flip(0) * 1, x.flip(1).roll(3, 1) * 1, x.roll(-7, 1).flip(1).roll(2, 0) + 1),
             x.detach())


def test_scatter_value(tf):
    """scatter with a scalar value (the one-hot of nll_loss's backward), including an index smaller
    than the input along the other dims and repeated indices."""
    x = tf.rand((5, 7))
    i1 = torch.randint(0, 7, (5, 1))
    i3 = torch.tensor([[0, 6, 0], [2, 2, 2], [1, 3, 5]])
    i0 = torch.randint(0, 5, (2, 7))
    tf.check(lambda x, i1, i3, i0: (torch.scatter(x, 1, i1, -1.5), torch.scatter(x * 2, 1, i3, 0.0),
                                    torch.scatter(x, 0, i0, 9.0), torch.zeros(5, 7).scatter(1, i1, 1.0),
                                    torch.scatter(x.t(), 0, i1.t(), 2.0),
                                    torch.scatter(x.long(), -1, i1, 3)), x, i1, i3, i0)


def test_views_dynamic_shapes(tf):
    """One graph with symbolic sizes serves every shape: views, slices, cat, pad, indexing."""
    def fn(x):
        y = x * 2
        return (y.view(-1) + 1, y.t() * 3, x[1:, ::2] + 1, x[-2:] * 2, x[:, 1] + 1, torch.cat([x, y], 1),
                F.pad(y, (1, 2, 0, 1)), y.flip(0), y.repeat(2, 1), x[:, :1].expand(-1, x.shape[1]) * x,
                x[torch.tensor([0, 1, 0])] * 2, y.triu(1), x + torch.arange(x.shape[1]))
    tf.check_dynamic(fn, [(tf.rand((5, 7)),), (tf.rand((9, 3)),), (tf.rand((4, 16)),)])


def test_graph_returning_an_input_unchanged(tf):
    """An input returned as is (next to computed outputs) is the caller's tensor, not a copy."""
    x, y = tf.rand((4, 6)), tf.rand((6,))
    e = tf.check(lambda x, y: (x, y * 2, y), x, y, check_stride=True)
    assert e.output[0].data_ptr() == x.data_ptr() and e.output[2].data_ptr() == y.data_ptr()
    xt = tf.rand((6, 4)).t()                                   # a non-contiguous input keeps its strides
    e = tf.check(lambda x: (x, x + 1), xt, check_stride=True)
    assert e.output[0].data_ptr() == xt.data_ptr()


def test_flip_of_flattened_transpose(tf):
    x = tf.rand((3, 4, 3))
    tf.check(lambda x: x.transpose(0, -1).reshape(-1).flip(0)[26::2] * 1, x)


def test_negative_slice_start_on_symbolic_size(tf):
    """x[:, -k:] of a dynamic-size dim counts from the end (was read from the start: wrong values)."""
    def fn(x, y):
        z = torch.cat([x, y], 1) * 2
        return z[:, -1:] + 1, z[:, -3:-1].sum(1), x[:, -2:] * 3
    tf.check_dynamic(fn, [(torch.randn(3, n), torch.randn(3, 4)) for n in (5, 9, 17)])


@pytest.mark.parametrize("backend", ["cpp", "triton"])
def test_cat_of_many_parts_runs_through_aten(tf, backend):
    """More parts than the backend fuses (an RNN's stacked hidden states; 4 for C++, whose vector
    loop issues every part's load, 32 for Triton): ATen's cat copies them in one pass instead of
    a kernel testing every part's range per element; up to the limit they stay fused."""
    from torchfuse import backends
    limit = backends.by_name(backend).features.max_fused_cat_parts
    opts = {"cpu_backend": backend}
    xs = [tf.rand((3, 5)) for _ in range(limit + 1)]
    e = tf.check(lambda *xs: torch.stack([x * (k + 1) for k, x in enumerate(xs)], 1) * 2, *xs, min_kernels=1,
                 allow_fallbacks={"aten.cat.default"}, options=opts)
    assert [f.op for f in e.fallbacks] == ["aten.cat.default"]
    e = tf.check(lambda *xs: torch.stack([x * (k + 1) for k, x in enumerate(xs[:limit])], 1), *xs, kernels=1,
                 options=opts)
    assert not e.fallbacks
    tf.check(lambda *xs: torch.cat(xs[:limit], 0).exp(), *xs, kernels=1, options=opts)


def test_cat_stores_an_expensive_part_first(tf):
    """Each element of a fused cat evaluates every part's expression: past a budget, an
    expensive part (an RNN's last cell next to the stored states before it) is computed once
    into a buffer, and the cat kernel only loads it.  Where the cat must be in memory anyway
    (returned), that buffer is the part's slice of the cat (lowering/cat_slots.py): the other
    parts are computed into theirs in the same kernel, and no kernel copies anything."""
    xs = [tf.rand((3, 5)) for _ in range(4)]

    def parts(*xs):
        last = torch.sigmoid(xs[-1]) * torch.tanh(xs[-1] * 2) + torch.sigmoid(xs[-1] + 1) * torch.tanh(xs[-1])
        return [x.exp() for x in xs[:-1]] + [last]

    e = tf.check(lambda *xs: torch.stack(parts(*xs), 1) * 2, *xs, kernels=2)
    cat_kernel = next(k for k in e.kernels if "cat" in k.nodes or "stack" in " ".join(k.nodes))
    body = cat_kernel.source.split("{", 1)[1]          # (the kernel's name lists the ops it joins)
    assert "tanh" not in body, cat_kernel.source
    returned = tf.check(lambda *xs: torch.stack(parts(*xs), 1), *xs, kernels=1)
    assert len(returned.kernels[0].writes) == 4, returned      # each part into its slice
    cheap = tf.check(lambda a, b: torch.cat([a.sigmoid(), b.tanh()], 0), xs[0], xs[1], kernels=1)
    assert not cheap.fallbacks


@pytest.mark.parametrize("backend", ["cpp", "triton"])
def test_cat_stores_an_upsample_channels_last(backend):
    """A U-Net decoder step on the CPU, where torchfuse runs the convolutions channels-last: a
    bilinear upsample of a convolution's output concatenated with another's.  The upsample, too
    costly to recompute in the cat's kernel, is stored first, channels-last like its input (its
    node, NCHW like the user's model, said otherwise: a transposed write, then a transposed read
    by the cat; U-Net inference ran at 0.73x Inductor on the CPU)."""
    if backend == "triton":
        pytest.importorskip("triton")
        os.environ.setdefault("TRITON_INTERPRET", "1")
    torch.manual_seed(0)
    x, skip = torch.randn(2, 8, 5, 6), torch.randn(2, 4, 10, 12)
    w1, w2, w3 = torch.randn(8, 8, 3, 3) / 8, torch.randn(4, 4, 3, 3) / 6, torch.randn(3, 12, 3, 3) / 10

    def fn(x, skip):
        up = F.interpolate(torch.relu(F.conv2d(x, w1, padding=1)), scale_factor=2, mode="bilinear",
                           align_corners=False)
        return F.conv2d(torch.cat([torch.relu(F.conv2d(skip, w2, padding=1)), up], 1), w3, padding=1)

    options = {"cpu_backend": "triton"} if backend == "triton" else {}
    with torch.no_grad():
        e = torchfuse.explain(fn, x, skip, options=options)
        torch.testing.assert_close(e.output, fn(x, skip), rtol=1e-4, atol=1e-4)
    stored = [(k, w.split()[0]) for k in e.kernels for w in k.writes if w.split()[1].startswith("(add")]
    assert len(stored) == 1, [k.writes for k in e.kernels]
    kernel, name = stored[0]
    stores = [line for line in kernel.source.splitlines()
              if re.search(rf"\b{name}\b *(\[|\+)", line) and ("store" in line or "] =" in line)]
    assert stores
    # the loop variables' strides: channels-last [2, 8, 10, 12] is (960, 1, 96, 8), NCHW (960, 120, 12, 1)
    for line in stores:
        assert sorted(int(m) for m in re.findall(r"\* (?:\(int64_t\))?(\d+)\)", line)) == [8, 96, 960], line
