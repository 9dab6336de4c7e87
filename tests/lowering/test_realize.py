"""When the lowering stores a value instead of recomputing it in each reader (lowering/realize.py): a
residual sum read by a layer norm's statistics, its normalization and, past the next matmuls,
the next residual add is stored once, by the statistics kernel; a value read by one loop's
kernels only (silu's x * sigmoid(x)) is not; a gradient summed over many layers is stored as it
goes."""
from __future__ import annotations

import os
import re

import pytest
import torch
import torch.nn.functional as F

import torchfuse
from tests.scheduler.test_collectives import group  # noqa: F401  (a fixture: a gloo world of one)

N, C = 64, 32


def _residual_stack(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    for _ in range(3):
        h = F.layer_norm(x, (C,))
        x = x + torch.relu(h @ w1) @ w2
    return F.layer_norm(x, (C,))


def test_residual_read_across_matmuls_is_stored_once():
    torch.manual_seed(0)
    w1, w2 = torch.randn(C, 4 * C) / 6, torch.randn(4 * C, C) / 11
    x = torch.randn(N, C)
    with torch.no_grad():
        e = torchfuse.explain(lambda t: _residual_stack(t, w1, w2), x, options={"cublas_devices": ("cpu", "cuda")})
    torch.testing.assert_close(e.output, _residual_stack(x, w1, w2), rtol=1e-4, atol=1e-4)
    # the two middle residuals (x1 + f(x1), x2 + f(x2)) are written by the statistics kernels
    # that read them first; the last one is read only by the final norm's kernel
    stored = [w for k in e.kernels for w in k.writes if re.search(r"\(add_\d+\)", w)]
    assert len(stored) == 2, [k.writes for k in e.kernels]
    # recomputed instead, the chain x0 + f(x0) + f(x1) + ... keeps every [64, 32] term alive:
    # 56 KiB planned peak against 48 (the 32 KiB hidden, the stored residual, one f output)
    peak = float(re.search(r"planned peak ([0-9.]+) KiB", e.memory[0]).group(1))
    assert peak == 48.0, e.memory


def test_value_read_in_one_loop_is_recomputed_not_stored():
    """silu(a + b): both readers of the sum (sigmoid and the product) are in one kernel."""
    a, b = torch.randn(33, 17), torch.randn(33, 17)

    def fn(a, b):
        s = a + b
        return s * torch.sigmoid(s), (s * 2).sum(1)

    e = torchfuse.explain(fn, a, b)
    ref = fn(a, b)
    torch.testing.assert_close(e.output[0], ref[0])
    torch.testing.assert_close(e.output[1], ref[1])
    assert not any("(add)" in w for k in e.kernels for w in k.writes), [k.writes for k in e.kernels]


# -- an attention bias computed by a kernel is written with aligned strides ----------------------

_seen_bias_strides: list[tuple[int, ...]] = []


@torch.library.custom_op("torchfuse_test::biased_attention", mutates_args=())
def _biased_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    _seen_bias_strides.append(bias.stride())
    return F.scaled_dot_product_attention(q, k, v, attn_mask=bias)


@_biased_attention.register_fake
def _(q, k, v, bias):
    return torch.empty_like(q)


def _windowed_attention(q, k, v, position_bias, shift_mask):
    # Swin's pattern: a [heads, L, L] position bias added to a [windows, L, L] shift mask
    bias = (position_bias.unsqueeze(0) + shift_mask.unsqueeze(1)).repeat(q.shape[0] // shift_mask.shape[0], 1, 1, 1)
    return torch.ops.torchfuse_test.biased_attention(q, k, v, bias)


def test_attention_bias_is_written_with_aligned_strides(monkeypatch):
    """The CUDA attention kernels refuse a bias whose strides (but the last) are not multiples
    of 8 elements; a [.., 49, 49] bias computed by a kernel is written padded to 56 per row."""
    from torchfuse.lowering import values as lowering
    from torchfuse.lowering.values import aligned_bias_layout
    from torchfuse.ir.nodes import const
    monkeypatch.setitem(lowering.ATTENTION_BIAS_ARG, torch.ops.torchfuse_test.biased_attention.default,
                        (3, "bias"))
    torch.manual_seed(0)
    q, k, v = (torch.randn(8, 3, 49, 16) for _ in range(3))
    position_bias, shift_mask = torch.randn(3, 49, 49), torch.randn(4, 49, 49)
    _seen_bias_strides.clear()
    e = torchfuse.explain(_windowed_attention, q, k, v, position_bias, shift_mask)
    torch.testing.assert_close(e.output, _windowed_attention(q, k, v, position_bias, shift_mask))
    assert _seen_bias_strides[0] == (3 * 49 * 56, 49 * 56, 56, 1), _seen_bias_strides
    assert len(e.kernels) == 1 and len(e.fallbacks) == 1
    # sizes already aligned keep their dense strides; other widths round up per row
    assert aligned_bias_layout([const(2), const(4), const(64)]).strides == (const(256), const(64), const(1))
    assert aligned_bias_layout([const(5), const(3), const(10)]).strides == (const(48), const(16), const(1))


def _shifted_window_bias(q, table, index):
    # Swin's shifted-window bias as its graph has it: a gathered position bias plus a mask the
    # graph computes from constants, padded and sliced back as SDPA does for the CUDA kernels
    ids = torch.arange(4 * 49 * 49).view(4, 49, 49)
    mask = torch.where(ids % 5 == (ids // 49) % 3, 0.0, -100.0)
    position = table[index].view(49, 49, -1).permute(2, 0, 1).contiguous().unsqueeze(0)
    bias = position + mask.unsqueeze(1).unsqueeze(0).expand(2, -1, -1, -1, -1).reshape(-1, 1, 49, 49)
    padded = F.pad(bias, (0, 7))[..., :49]
    return torch.ops.torchfuse_test.biased_attention(q, q, q, padded), padded


def test_attention_bias_also_returned_is_stored_once_in_its_strides(monkeypatch):
    """A bias the graph also returns (a training forward saves it for the attention backward)
    is written once, in the padded strides the graph returns it with, and the attention reads
    that buffer.  It had been stored dense for its two readers: a second, aligned buffer for
    the attention, and the output's strides unlike eager's, so the backward copied it into them
    again (Swin training: five 56-64 MiB copies, its step's peak)."""
    from torchfuse.lowering import values as lowering
    monkeypatch.setitem(lowering.ATTENTION_BIAS_ARG, torch.ops.torchfuse_test.biased_attention.default,
                        (3, "bias"))
    torch.manual_seed(0)
    q, table, index = torch.randn(8, 3, 49, 16), torch.randn(169, 3), torch.randint(0, 169, (2401,))
    _seen_bias_strides.clear()
    e = torchfuse.explain(_shifted_window_bias, q, table, index)
    ref = _shifted_window_bias(q, table, index)
    torch.testing.assert_close(e.output, ref)
    assert e.output[1].stride() == ref[1].stride() == (3 * 49 * 56, 49 * 56, 56, 1)
    assert _seen_bias_strides[0] == (3 * 49 * 56, 49 * 56, 56, 1), _seen_bias_strides
    assert [len(k.writes) for k in e.kernels] == [1], [k.writes for k in e.kernels]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int32])
def test_stored_value_also_returned_keeps_eager_strides(tf, dtype):
    """A value stored for its readers (here: costlier than inline_max_cost to recompute in two
    kernels) that the graph also returns, as a view with gaps between rows, is written in the
    view's strides: the one buffer serves the readers and the output."""
    x = tf.rand((3, 5, 6), dtype)

    def fn(x):
        y = F.pad(x * x + 1, (0, 2))[..., :6]
        return y, y.sum(0), y.amax(2)

    e = tf.check(fn, x, options={"inline_max_cost": 0}, check_stride=True)
    assert fn(x)[0].stride() == (40, 8, 1)
    assert sum(len(k.writes) for k in e.kernels) == 3, [k.writes for k in e.kernels]


def _layers_over_a_position_bias(scores, table, bucket, mask):
    # T5's pattern: an embedding lookup [S, S, H] permuted to [1, H, S, S] plus a [B, 1, 1, S]
    # mask, which eager lays out [B, H, S, S] with the heads at stride 1, added to every
    # layer's scores before its softmax
    bias = table[bucket].permute(2, 0, 1).unsqueeze(0) + torch.where(mask, 0.0, -1e9).to(table.dtype)[:, None, None, :]
    out = scores
    for _ in range(3):
        out = torch.softmax(out * 2 + bias, -1) @ scores
    return out


@pytest.mark.parametrize("backend", ["cpp", "triton"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_value_from_smaller_inputs_is_stored_row_major(backend, dtype):
    """A value computed from smaller (gathered, broadcast) inputs only, read by kernels only, is
    stored row-major, not in the strides eager's TensorIterator gave it from a permuted input:
    there is no input layout to follow, and each layer's softmax reads it along its rows (at a
    stride of H elements before: 1.5x Inductor's time per layer in T5's training step)."""
    if backend == "triton":
        pytest.importorskip("triton")
        os.environ.setdefault("TRITON_INTERPRET", "1")
    torch.manual_seed(0)
    B, H, S = 2, 3, 16
    scores, table = torch.randn(B, H, S, S, dtype=dtype), torch.randn(32, H, dtype=dtype)
    bucket, mask = torch.randint(0, 32, (S, S)), torch.rand(B, S) > 0.2
    options = {"inline_max_cost": 0, **({"cpu_backend": "triton"} if backend == "triton" else {})}
    e = torchfuse.explain(_layers_over_a_position_bias, scores, table, bucket, mask, options=options)
    ref = _layers_over_a_position_bias(scores, table, bucket, mask)
    # (bf16: three rounded layers; a bias read in the wrong layout is off by O(1))
    tol = 1e-5 if dtype == torch.float32 else 0.1
    torch.testing.assert_close(e.output, ref, rtol=tol, atol=tol)
    name = next(w.split()[0] for k in e.kernels for w in k.writes if w.endswith("(add)"))
    stores = [line for k in e.kernels for line in k.source.splitlines()
              if re.search(rf"\b{name}\b *(\[|\+)", line) and ("store" in line or "] =" in line)]
    assert stores and all(re.search(r"\+ y0\)", line) for line in stores), stores


def test_attention_bias_with_symbolic_sizes_is_copied_aligned(monkeypatch):
    """A dense [B, 1, S, S] mask with a symbolic S has strides S*S and S, aligned for some S
    only (GPT-2 at sequence 77 failed on CUDA): it is copied into an aligned buffer, one copy
    for every attention call reading it."""
    from torchfuse.lowering import values as lowering
    monkeypatch.setitem(lowering.ATTENTION_BIAS_ARG, torch.ops.torchfuse_test.biased_attention.default,
                        (3, "bias"))

    def two_layers(q, mask):
        h = torch.ops.torchfuse_test.biased_attention(q, q, q, mask)
        return torch.ops.torchfuse_test.biased_attention(h * 2, q, q, mask)

    torch._dynamo.reset()
    compiled = torch.compile(two_layers, backend="torchfuse", dynamic=True)
    torch.manual_seed(0)
    for s in (12, 7, 9):
        q, mask = torch.randn(2, 3, s, 16), torch.randn(2, 1, s, s)
        _seen_bias_strides.clear()
        torch.testing.assert_close(compiled(q, mask), two_layers(q, mask))
        row = (s + 7) // 8 * 8
        assert _seen_bias_strides[:2] == [(s * row, s * row, row, 1)] * 2, (s, _seen_bias_strides)


def test_attention_bias_broadcast_over_heads_is_stored_once(monkeypatch):
    """A decoder's [B, 1, S, S] mask, made additive and expanded to every head, as SDPA passes it
    to the CUDA kernels: stored [B, 1, S, S] (rows aligned) and read with stride 0 over the
    heads, not written dense for every head (Mistral: 1 GiB where its values take 32 MiB), also
    when every layer reads it and its expression is too costly to recompute in each."""
    from torchfuse.lowering import values as lowering
    monkeypatch.setitem(lowering.ATTENTION_BIAS_ARG, torch.ops.torchfuse_test.biased_attention.default,
                        (3, "bias"))
    b, h, s = 2, 4, 12

    def masked(q, keep, pos):
        # sliding-window causal mask from position ids, and a padding mask
        qpos, kpos = pos[:, :, None], pos[:, None, :]
        allowed = (qpos >= kpos) & (qpos - kpos < s // 2) & keep[:, None, :] & (kpos >= 0) & (qpos < 2 * s)
        bias = torch.where(allowed, 0.0, float("-inf"))[:, None].expand(b, h, s, s)
        x = torch.ops.torchfuse_test.biased_attention(q, q, q, bias)
        return torch.ops.torchfuse_test.biased_attention(x * 2, q, q, bias)

    torch.manual_seed(0)
    q, keep = torch.randn(b, h, s, 16), torch.rand(b, s) > 0.3
    keep[:, 0] = True                 # every query sees at least one key
    pos = torch.arange(s).expand(b, s) + torch.randint(0, 3, (b, 1))
    expected = masked(q, keep, pos)
    _seen_bias_strides.clear()
    e = torchfuse.explain(masked, q, keep, pos)
    torch.testing.assert_close(e.output, expected)
    assert _seen_bias_strides == [(s * 16, 0, 16, 1)] * 2, _seen_bias_strides


def _shared_bias_chain(h: torch.Tensor, b: torch.Tensor, *ws: torch.Tensor) -> torch.Tensor:
    for w in ws:
        h = torch.tanh((h + b) @ w)
    return h.sum()


def test_gradient_summed_over_layers_is_stored_as_it_goes():
    """A tensor every layer reads (T5's attention bias) gets one gradient per layer, each from a
    matmul in that layer's backward; autograd sums them in a chain of adds, each read by the next
    past the next layer's matmuls.  Inlined, the chain was one kernel at the end reading all 8
    gradients, each alive until then; stored as it goes, at most four are alive at once."""
    torch.manual_seed(0)
    layers, n = 8, 32
    h = torch.randn(2, n, n, requires_grad=True)
    b = torch.randn(2, n, n, requires_grad=True)
    ws = [(torch.randn(n, n) / 6).requires_grad_() for _ in range(layers)]
    e = torchfuse.explain(_shared_bias_chain, h, b, *ws)
    backward = next(m for m in e.memory if "backward" in m)
    # 8 KiB per [2, 32, 32] gradient: 104 KiB at the fused sum's peak, 72 when the partial sum
    # is stored once more than three terms are pending, by the kernel that runs there (a
    # layer's tanh backward); the rest of the chain sums into the last kernel as before
    peak = float(re.search(r"planned peak ([0-9.]+) KiB", backward).group(1))
    assert peak == 72.0, e.memory
    kernels = [k.name for k in e.kernels if "backward" in k.name]
    assert len(kernels) == layers, kernels                        # no kernel of its own
    assert sum("add" in k for k in kernels) == 1, kernels
    compiled = torch.compile(_shared_bias_chain, backend="torchfuse")
    compiled(h, b, *ws).backward()
    got = [t.grad.clone() for t in (h, b, *ws)]
    for t in (h, b, *ws):
        t.grad = None
    _shared_bias_chain(h, b, *ws).backward()
    for g, t in zip(got, (h, b, *ws)):
        torch.testing.assert_close(g, t.grad, rtol=1e-4, atol=1e-4)


# -- values read by one expression; values computed from channels-last inputs ---------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("align_corners", [True, False])
def test_bilinear_upsample_is_one_kernel(tf, dtype, align_corners):
    """The decomposition's row interpolation `top` is read twice by the column interpolation,
    `top + (bottom - top) * w`: one expression, computed once in one kernel.  It was stored (its
    expression costs more than inline_max_cost), NCHW as its node says, from a channels-last
    input: a second kernel and a transposed write (4x Inductor's time on a U-Net's decoder)."""
    x = tf.rand((2, 6, 5, 7), dtype).to(memory_format=torch.channels_last)

    def fn(x):
        return F.interpolate(torch.relu(x), scale_factor=2, mode="bilinear", align_corners=align_corners) * 1.5

    tf.check(fn, x, kernels=1, check_stride=True)


_seen_strides: list[tuple[int, ...]] = []


@torch.library.custom_op("torchfuse_test::record_strides", mutates_args=())
def _record_strides(x: torch.Tensor) -> torch.Tensor:
    _seen_strides.append(x.stride())
    return x.sum(1)


@_record_strides.register_fake
def _(x):
    return x.sum(1)


def test_value_from_channels_last_inputs_is_stored_channels_last(tf):
    """A gather of a channels-last tensor is NCHW by its node (index ops return contiguous
    tensors); stored for two readers, it is written channels-last, as its input is laid out."""
    x = tf.rand((2, 8, 5, 6)).to(memory_format=torch.channels_last)
    hi, wi = torch.tensor([0, 0, 1, 2, 3, 4, 4, 2]), torch.tensor([5, 4, 3, 2, 1, 0, 0])

    def fn(x):
        g = x[:, :, hi][:, :, :, wi]
        y = torch.tanh(g) * torch.sigmoid(g) + torch.exp(g)
        return torch.ops.torchfuse_test.record_strides(y), y.amax(1), y * 3

    _seen_strides.clear()
    tf.check(fn, x, allow_fallbacks=["torchfuse_test.record_strides.default"], check_stride=True)
    assert _seen_strides[-1] == (448, 1, 56, 8), _seen_strides


# -- a transcendental its readers broadcast is evaluated once per element (CPU) ------------------

def _rotary(q: torch.Tensor, k: torch.Tensor, angles: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    cos, sin = angles.cos()[None, None], angles.sin()[None, None]

    def rotate_half(x):
        return torch.cat([-x[..., 16:], x[..., :16]], -1)

    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


def test_transcendental_broadcast_by_its_readers_is_evaluated_once_per_element():
    """Rotary embeddings with grouped-query heads: the [seq, head_dim] sin and cos tables are
    read by q (8 heads) and k (4 heads) of 2 sequences.  Inlined, each q and k element evaluated
    both; stored, one kernel evaluates them over the table and the q and k kernels read them."""
    torch.manual_seed(0)
    q, k, angles = torch.randn(2, 8, 64, 32), torch.randn(2, 4, 64, 32), torch.randn(64, 32) * 3
    e = torchfuse.explain(_rotary, q, k, angles)
    for out, ref in zip(e.output, _rotary(q, k, angles)):
        torch.testing.assert_close(out, ref)
    evaluating = [kern.name for kern in e.kernels if "tf_sinf(" in kern.source or "tf_cosf(" in kern.source]
    assert len(evaluating) == 1, [(kern.name, kern.writes) for kern in e.kernels]
    assert len(e.kernels) == 3, [kern.name for kern in e.kernels]


def test_transcendental_read_element_for_element_stays_inlined():
    """Readers of the same size gain nothing from a stored copy: sin(x) feeds two outputs of
    x's shape (two kernels would each read x once either way), and one kernel computes both."""
    x, y = torch.randn(64, 512), torch.randn(64, 512)

    def fn(x, y):
        s = torch.sin(x)
        return s * y, s + y

    e = torchfuse.explain(fn, x, y)
    for out, ref in zip(e.output, fn(x, y)):
        torch.testing.assert_close(out, ref)
    assert len(e.kernels) == 1, [(kern.name, kern.writes) for kern in e.kernels]


# -- a value several scatters would each compute is stored once --------------------------------

def _kernels_computing(e, op: str) -> list[str]:
    return [kern.name for kern in e.kernels if op in kern.nodes]


@pytest.mark.parametrize("backend,dtype", [("cpp", torch.float32), ("cpp", torch.bfloat16),
                                           ("triton", torch.float32)])
def test_edge_score_read_by_three_scatters_is_computed_once(tf, backend, dtype):
    """A GAT layer: the edge score leaky_relu(a[src] + b[dst]) is read by the scatter amax, the
    scatter sum of exp(score - max[dst]) and the weighted messages' index_add, the exp by the
    last two.  Each is stored by the loop of the first scatter reading it (the amax's, the sum's),
    and the others read it: still five kernels, and the score's and the exp's ops in one each
    (inlined: in three and two).  Colliding indices, negative source indices (gathers only)."""
    from tests.lowering.test_scatter import gat_layer
    torch.manual_seed(0)
    nodes, edges = 37, 300
    x, w = tf.rand((nodes, 16), dtype), tf.rand((16, 16), dtype, low=-0.3, high=0.3)
    src, dst = torch.randint(-nodes, nodes, (edges,)), torch.randint(0, nodes, (edges,))
    tol = (5e-2, 5e-2) if dtype == torch.bfloat16 else (1e-4, 1e-4)
    options = {"cpu_backend": "triton"} if backend == "triton" else {}
    e = tf.check(gat_layer, x, src, dst, w, tf.rand((16,), dtype), tf.rand((16,), dtype), options=options,
                 kernels=5, allow_fallbacks={"aten.mm.default"}, atol=tol[0], rtol=tol[1])
    assert len(_kernels_computing(e, "where")) == 1, [(k.name, k.nodes) for k in e.kernels]   # (leaky_relu)
    assert len(_kernels_computing(e, "exp")) == 1, [(k.name, k.nodes) for k in e.kernels]
    if dtype == torch.bfloat16:
        return        # (its bf16 roundings make the score costly enough to be stored anyway)
    reasons = [r for r in e.refused_fusions if "not inlined into its readers" in r]
    assert len(reasons) == 2 and "3 of them scatters" in reasons[0] and "2 of them scatters" in reasons[1], reasons


def _edge_weighted_sum(x, a, b, src, dst):
    """A weight per edge, read by two index_adds: its sum per node and the weighted messages'."""
    wt = (a[src] * b[dst]).relu()
    s = torch.zeros(x.shape[0], dtype=x.dtype).index_add(0, dst, wt)
    return torch.zeros_like(x).index_add(0, dst, x[src] * wt[:, None]) / (s[:, None] + 1)


@pytest.mark.parametrize("backend", ["cpp", "triton"])
@pytest.mark.parametrize("index_dtype", [torch.int64, torch.int32])
def test_edge_weight_read_by_two_index_adds_is_computed_once(tf, backend, index_dtype):
    torch.manual_seed(0)
    nodes, edges = 23, 150
    x, a, b = tf.rand((nodes, 8)), tf.rand((nodes,)), tf.rand((nodes,))
    src = torch.randint(-nodes, nodes, (edges,)).to(index_dtype)
    dst = torch.randint(0, nodes, (edges,)).to(index_dtype)
    options = {"cpu_backend": "triton"} if backend == "triton" else {}
    e = tf.check(_edge_weighted_sum, x, a, b, src, dst, options=options, atol=1e-4, rtol=1e-4)
    assert len(_kernels_computing(e, "relu")) == 1, [(k.name, k.nodes) for k in e.kernels]


def test_cheap_value_read_by_two_scatters_stays_inlined(tf):
    """v * 2 costs less to compute in each of the two scatters than to store and read back."""
    x, v = tf.rand((11,)), tf.rand((40,))
    i = torch.randint(0, 11, (40,))
    e = tf.check(lambda x, v, i: (torch.scatter_add(x, 0, i, v * 2), torch.zeros(11).index_add(0, i, v * 2)),
                 x, v, i, atol=1e-5, rtol=1e-5)
    assert len(_kernels_computing(e, "mul")) == 2, [(k.name, k.nodes) for k in e.kernels]
    assert not any("not inlined" in r for r in e.refused_fusions), e.refused_fusions


def test_gat_layer_gradients_with_stored_scores(tf):
    from tests.lowering.test_scatter import gat_layer
    torch.manual_seed(0)
    nodes, edges = 29, 200
    x = tf.rand((nodes, 12)).requires_grad_()
    w = tf.rand((12, 12), low=-0.3, high=0.3).requires_grad_()
    a_s, a_d = tf.rand((12,)).requires_grad_(), tf.rand((12,)).requires_grad_()
    src, dst = torch.randint(-nodes, nodes, (edges,)), torch.randint(0, nodes, (edges,))
    e = tf.check_grad(gat_layer, x, src, dst, w, a_s, a_d, allow_fallbacks={"aten.mm.default"}, atol=1e-4, rtol=1e-4)
    assert len([k for k in e.kernels if not k.graph.endswith("_backward") and "where" in k.nodes]) == 1, \
        [(k.name, k.nodes) for k in e.kernels]


def _gathered_rows_summed_and_scattered(g, x, alpha, src, dst):
    # a GAT layer's backward: the output gradient gathered by target node ([edges, heads,
    # channels]), summed with the source features (the attention gradient) and, weighted,
    # index_added into the source nodes (the features' gradient)
    gathered = g.index_select(0, dst)
    att = (gathered * x.index_select(0, src)).sum(-1)
    return att, torch.zeros_like(x).index_add(0, src, gathered * alpha.unsqueeze(-1))


@pytest.mark.parametrize("gpu, width, stored", [(True, 32, False), (True, 3, True), (False, 32, True)],
                         ids=["gpu-rows", "gpu-narrow", "cpu"])
def test_gathered_rows_read_by_a_scatter_and_a_sum(tf, monkeypatch, gpu, width, stored):
    """On a GPU a gather of whole rows (32 x 4 bytes here) read by two kernels is gathered again
    by each rather than stored (`realize.gathers_rows`): the same bytes read, no copy written.
    Narrow rows, and the CPU (where a gather costs more than a streaming read), store it."""
    from torchfuse.lowering import realize
    monkeypatch.setattr(realize, "on_gpu", lambda lowering: gpu)
    nodes, edges, heads = 17, 40000 // (3 * width), 3      # (stored only from 32768 elements)
    g, x = tf.rand((nodes, heads, width)), tf.rand((nodes, heads, width))
    alpha = tf.rand((edges, heads))
    src, dst = torch.randint(0, nodes, (edges,)), torch.randint(0, nodes, (edges,))
    e = tf.check(_gathered_rows_summed_and_scattered, g, x, alpha, src, dst, options={"cpu_backend": "triton"},
                 atol=1e-4, rtol=1e-4)
    gathered = [k for k in e.kernels if any("index_select" in w for w in k.writes)]
    assert bool(gathered) == stored, [(k.name, k.writes) for k in e.kernels]


def _gathered_gradient_matmuls(g: torch.Tensor, w: torch.Tensor, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    # a sequence-parallel linear layer's backward: the all-gathered gradient (ranks stacked on
    # dim 0) re-concatenated along the sequence, read by the input-gradient matmul and,
    # transposed, by the weight-gradient matmul (traced first, as autograd does)
    full = torch.cat(g.split(g.shape[0] // 2), 1)
    flat = full.view(-1, full.shape[-1])
    weight_grad = flat.t() @ h
    return flat @ w, weight_grad


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_value_read_by_two_matmuls_through_views_is_stored_once(dtype):
    torch.manual_seed(0)
    g = torch.randn(4, 7, 13).to(dtype)
    w, h = torch.randn(13, 5).to(dtype), torch.randn(28, 9).to(dtype)
    with torch.no_grad():
        e = torchfuse.explain(_gathered_gradient_matmuls, g, w, h)
    ref = _gathered_gradient_matmuls(g, w, h)
    tol = dict(rtol=2e-2, atol=2e-2) if dtype == torch.bfloat16 else {}
    torch.testing.assert_close(e.output[0], ref[0], **tol)
    torch.testing.assert_close(e.output[1], ref[1], **tol)
    # one kernel writes the concatenation; both matmuls read views of it (each stored its own
    # copy before: a second kernel wrote it transposed)
    assert len(e.kernels) == 1, [(k.name, k.writes) for k in e.kernels]
    assert sorted(f.op for f in e.fallbacks) == ["aten.mm.default"] * 2, e.fallbacks


def _rms_norm(x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    r = torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6)
    return (x.float() * r).to(x.dtype) * w, r


def _two_rms_norms_saving_rsqrt(x: torch.Tensor, w: torch.Tensor, m: torch.Tensor, group: str) -> tuple[torch.Tensor, ...]:
    # two tensor-parallel blocks' forward as the partitioner leaves it: each RMSNorm's rsqrt is
    # read by its normalization and returned (saved for the backward); an MLP reads the
    # normalized rows, its partial sums are all-reduced and added to the residual
    c10d = torch.ops._c10d_functional
    saved = []
    for _ in range(2):
        h, r = _rms_norm(x, w)
        saved.append(r)
        h = h @ m
        h = torch.tanh((F.silu(h) * h) @ m)
        x = x + c10d.wait_tensor(c10d.all_reduce(h @ m, "sum", group))
    return (x, *saved)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_returned_value_read_by_a_kernel_is_stored_by_that_kernel(group, dtype):
    torch.manual_seed(0)
    x, w = torch.randn(3, 11, 37).to(dtype), torch.rand(37).to(dtype) + 0.5
    m = (torch.randn(37, 37) / 6).to(dtype)
    with torch.no_grad():
        e = torchfuse.explain(_two_rms_norms_saving_rsqrt, x, w, m, group)
        ref = _two_rms_norms_saving_rsqrt(x, w, m, group)
    tol = dict(rtol=3e-2, atol=3e-2) if dtype == torch.bfloat16 else {}
    for got, want in zip(e.output, ref):
        torch.testing.assert_close(got, want, **tol)
    # each row-sum kernel writes the rsqrt it computes for its normalization (stored at the
    # graph's output instead, both were computed again by a kernel of their own at the end,
    # too far from the row sums to join them): per block a norm, SwiGLU and tanh kernel, the
    # first residual add in the second norm's kernel, the last one in a kernel of its own
    assert len(e.kernels) == 7, [(k.name, k.writes) for k in e.kernels]
    writers = [k.name for k in e.kernels for x in k.writes if "(rsqrt" in x]
    assert len(writers) == 2 and all(n.startswith("red_") for n in writers), [(k.name, k.writes) for k in e.kernels]


def _pyg_attention(a, b, x, edge_index):
    """torch_geometric's GAT aggregation as its graph has it: self loops appended to the edge
    index, per-edge scores over heads, the destination index expanded to [edges, heads] for each
    scatter (`broadcast` in its `utils/_scatter.py`), a segment softmax (scatter amax without
    self, scatter sum) and the weighted messages' scatter sum."""
    loops = torch.arange(a.shape[0]).view(1, -1).repeat(2, 1)
    full = torch.cat([edge_index, loops], dim=1)
    src, dst = full[0], full[1]
    e = F.leaky_relu(a.index_select(0, src) + b.index_select(0, dst), 0.2)
    idx = dst.view(-1, 1).expand_as(e)
    m = e.new_zeros(a.shape).scatter_reduce_(0, idx, e.detach(), "amax", include_self=False)
    p = (e - m.index_select(0, dst)).exp()
    s = p.new_zeros(a.shape).scatter_add_(0, idx, p) + 1e-16
    msg = (p / s.index_select(0, dst)).unsqueeze(-1) * x.index_select(0, src)
    return x.new_zeros(x.shape).scatter_add_(0, dst.view(-1, 1, 1).expand_as(msg), msg)


@pytest.mark.parametrize("backend", ["cpp", "triton"])
def test_expanded_scatter_index_is_not_stored(tf, backend):
    """The index expanded over heads (a select of the concatenated edge index: 5 ops an element)
    is recomputed by each scatter from the [edges] index, not stored at [edges, heads] (int64:
    8 bytes an element, written once and read by two scatters); the amax's pass marking the
    destinations it touches (include_self=False) joins the loop that stores the scores."""
    torch.manual_seed(0)
    nodes, edges, heads = 31, 257, 3
    a, b, x = tf.rand((nodes, heads)), tf.rand((nodes, heads)), tf.rand((nodes, heads, 5))
    edge_index = torch.stack([torch.randint(0, nodes, (edges,)), torch.randint(0, nodes // 2, (edges,))])
    options = {"cpu_backend": "triton"} if backend == "triton" else {}
    e = tf.check(_pyg_attention, a, b, x, edge_index, options=options, atol=1e-5, rtol=1e-4)
    assert not any("expand" in r for r in e.refused_fusions), e.refused_fusions
    scores = [k for k in e.kernels if any("(where)" in w for w in k.writes)]
    assert len(scores) == 1 and any("(scatter_reduce)" in w for w in scores[0].writes), \
        [(k.name, k.writes) for k in e.kernels]


def _gin_layer_input(h: torch.Tensor, w: torch.Tensor, b: torch.Tensor, src: torch.Tensor,
                     dst: torch.Tensor) -> torch.Tensor:
    # a GIN layer's aggregation of the previous layer's activation: its gather-scatter and its
    # (1 + eps) * x term both read x
    x = torch.relu(h @ w + b)
    return torch.zeros_like(x).index_add(0, dst, x[src]) + 1.5 * x


@pytest.mark.parametrize("gpu", [True, False], ids=["gpu", "cpu"])
def test_cheap_activation_read_by_a_scatter_is_recomputed_on_a_gpu(tf, monkeypatch, gpu):
    """On a GPU relu(h @ w + b), read by a gather-scatter and an elementwise kernel, is computed
    in each (`realize.reads_as_stored`: each loads the matmul's output where it would load the
    stored activation); on the CPU the scatter's second evaluation costs more than storing it."""
    from torchfuse.lowering import realize
    monkeypatch.setattr(realize, "on_gpu", lambda lowering: gpu)
    nodes, width, edges = 300, 128, 1000            # (stored only from 32768 elements)
    h, w, b = tf.rand((nodes, 64)), tf.rand((64, width), low=-0.2, high=0.2), tf.rand((width,))
    src, dst = torch.randint(0, nodes, (edges,)), torch.randint(0, nodes, (edges,))
    e = tf.check(_gin_layer_input, h, w, b, src, dst, atol=1e-4, rtol=1e-4, allow_fallbacks={"aten.mm.default"},
                 options={"cpu_backend": "triton", "cublas_devices": ("cpu",)})
    stored = [k for k in e.kernels if any("relu" in w for w in k.writes)]
    assert bool(stored) != gpu, [(k.name, k.writes) for k in e.kernels]
