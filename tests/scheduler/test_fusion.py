"""The fusion scheduler (src/torchfuse/scheduler/fusion.py): how many kernels common patterns
become, what it refuses and why, and that the fused kernels still compute what eager computes."""
from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import torchfuse

SHAPES = [(32, 100), (7, 13)]


@pytest.mark.parametrize("shape", SHAPES)
def test_pointwise_chain_is_one_kernel(tf, shape):
    n, c = shape
    x, w, b, z = tf.rand((n, c)), tf.rand((c,)), tf.rand((c,)), tf.rand((n, c))
    e = tf.check(lambda x, w, b, z: torch.relu(x * w + b) * z, x, w, b, z, kernels=1)
    assert e.kernels[0].kind == "pointwise"
    assert not e.refused_fusions


def test_pointwise_chain_noncontiguous_inputs(tf):
    x, w, z = tf.rand((100, 32)).t(), tf.rand((100,)), tf.rand((32, 200))[:, ::2]
    tf.check(lambda x, w, z: torch.relu(x * w + 1).sigmoid() * z - z.exp(), x, w, z, kernels=1)


@pytest.mark.parametrize("shape", SHAPES)
def test_softmax_is_one_kernel(tf, shape):
    x = tf.rand(shape)
    e = tf.check(lambda x: torch.softmax(x, -1), x, kernels=1)
    assert e.kernels[0].kind == "reduction"
    tf.check(lambda x: torch.log_softmax(x, -1), x, kernels=1)


def test_softmax_3d_and_noncontiguous(tf):
    x = tf.rand((4, 8, 33))
    tf.check(lambda x: torch.softmax(x, -1), x, kernels=1)
    tf.check(lambda x: torch.softmax(x.transpose(1, 2), -1), x, kernels=1)
    tf.check(lambda x: torch.log_softmax(x[:, ::2], -1) * 2, x, kernels=1)


def test_softmax_low_precision(tf):
    x = tf.rand((16, 50), torch.bfloat16)
    tf.check(lambda x: torch.softmax(x, -1), x, kernels=1)
    tf.check(lambda x: torch.softmax(x.half(), -1, dtype=torch.float32), x, kernels=1)


@pytest.mark.parametrize("shape", SHAPES)
def test_layer_norm_is_one_kernel(tf, shape):
    n, c = shape
    x, w, b = tf.rand((n, c)), tf.rand((c,)), tf.rand((c,))
    tf.check(lambda x, w, b: F.layer_norm(x, (c,), w, b), x, w, b, kernels=1, atol=1e-4, rtol=1e-4)
    tf.check(lambda x: F.layer_norm(x, (c,), eps=1e-3), x, kernels=1, atol=1e-4, rtol=1e-4)


def test_layer_norm_3d(tf):
    x, w, b = tf.rand((2, 5, 24)), tf.rand((24,)), tf.rand((24,))
    tf.check(lambda x, w, b: F.layer_norm(x, (24,), w, b), x, w, b, kernels=1, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("shape", SHAPES)
def test_rms_norm_is_one_kernel(tf, shape):
    n, c = shape
    x, w = tf.rand((n, c)), tf.rand((c,))
    tf.check(lambda x, w: x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w, x, w, kernels=1)


def test_rms_norm_bf16_upcast(tf):
    """The usual LLM form: compute in fp32, cast back to bf16, scale by a bf16 weight."""
    x, w = tf.rand((8, 64), torch.bfloat16), tf.rand((64,), torch.bfloat16)

    def rms(x, w):
        h = x.float()
        return (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)).to(x.dtype) * w
    tf.check(rms, x, w, kernels=1)


def test_cross_entropy_at_most_two_kernels(tf):
    x, t = tf.rand((32, 100)), torch.randint(0, 100, (32,))
    e = tf.check(lambda x, t: F.cross_entropy(x, t), x, t)
    assert len(e.kernels) <= 2, str(e)
    tf.check(lambda x, t: F.cross_entropy(x, t, reduction="none"), x, t, kernels=1)
    tf.check(lambda x, t: F.nll_loss(F.log_softmax(x, -1), t), x, t, min_kernels=1)


@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_gelu_is_one_kernel(tf, approximate):
    x = tf.rand((32, 100))
    tf.check(lambda x: F.gelu(x, approximate=approximate), x, kernels=1)


def test_matmul_bias_gelu(tf):
    """The matmul runs in ATen; bias add and gelu become one kernel reading its result."""
    x, w, b = tf.rand((32, 100)), tf.rand((100, 64)), tf.rand((64,))
    e = tf.check(lambda x, w, b: F.gelu(x @ w + b), x, w, b, kernels=1, allow_fallbacks={"aten.mm.default"},
                 atol=1e-4, rtol=1e-4)
    assert [f.op for f in e.fallbacks] == ["aten.mm.default"]
    e = tf.check(lambda x, w, b: F.gelu(F.linear(x, w.t(), b)), x, w, b, kernels=1,
                 allow_fallbacks={"aten.addmm.default", "aten.mm.default"}, atol=1e-4, rtol=1e-4)
    assert len(e.fallbacks) == 1


def test_horizontal_fusion_of_independent_consumers(tf):
    x = tf.rand((32, 100))
    e = tf.check(lambda x: (x.sin(), x.cos() * 2, torch.relu(x) + 1), x, kernels=1)
    assert e.kernels[0].kind == "pointwise"
    # reductions over the same rows share one kernel (and one pass over x)
    tf.check(lambda x: (x.sum(-1), x.amax(-1), x.mean(-1), x.var(-1)), x, kernels=1)


def test_no_fuse_option_gives_more_kernels(tf):
    x, w, b, z = tf.rand((32, 100)), tf.rand((100,)), tf.rand((100,)), tf.rand((32, 100))

    def fn(x, w, b, z):
        return torch.relu(x * w + b).exp() * z

    fused = tf.check(fn, x, w, b, z)
    unfused = tf.check(fn, x, w, b, z, options={"fuse": False})
    assert len(fused.kernels) == 1
    assert len(unfused.kernels) > len(fused.kernels)
    assert any("fusion disabled" in r for r in unfused.refused_fusions)
    sm_unfused = tf.check(lambda x: torch.softmax(x, -1), x, options={"fuse": False})
    assert len(sm_unfused.kernels) > 1


def test_max_fusion_size_limit(tf):
    x = tf.rand((32, 100))
    e = tf.check(lambda x: (x.sin(), x.cos(), x.exp()), x, options={"max_fusion_size": 1})
    assert len(e.kernels) == 3
    assert any("kernel size limit" in r for r in e.refused_fusions)


def test_refused_fusion_is_reported_with_a_reason(tf):
    """A column sum over (N, C) loops over C outside and N inside; an elementwise op over (N, C)
    cannot join that loop nest, and the report says why."""
    x = tf.rand((32, 100))
    e = tf.check(lambda x: (x.sum(0), x * 2), x)
    assert len(e.kernels) == 2
    assert e.refused_fusions, str(e)
    text = " ".join(e.refused_fusions)
    assert "not fused" in text and "iteration space" in text, text
    assert "refused fusions" in str(e)


def test_reduction_consumer_of_other_shape_refused(tf):
    x = tf.rand((32, 100))
    e = tf.check(lambda x: x * x.sum(0), x)
    assert len(e.kernels) == 2 and e.refused_fusions


def test_reduction_with_prologue_and_epilogue(tf):
    x, w = tf.rand((16, 40)), tf.rand((40,))
    e = tf.check(lambda x, w: ((x * w).exp().sum(-1, keepdim=True).log() + 1, x / x.abs().sum(-1, keepdim=True)),
                 x, w, kernels=1)
    assert e.kernels[0].kind == "reduction"
    tf.check(lambda x: (x - x.amax(-1, keepdim=True)).exp().sum(-1), x, kernels=1)
    tf.check(lambda x: x / x.sum(), x, kernels=1)


def test_softmax_backward_kernels(tf):
    x = tf.rand((16, 40)).requires_grad_()
    e = tf.check_grad(lambda x: torch.softmax(x, -1), x)
    assert len(e.kernels) == 2, str(e)      # one forward, one backward


def test_layer_norm_backward_matches(tf):
    x, w, b = tf.rand((8, 24)).requires_grad_(), tf.rand((24,)).requires_grad_(), tf.rand((24,)).requires_grad_()
    e = tf.check_grad(lambda x, w, b: F.layer_norm(x, (24,), w, b), x, w, b, atol=1e-4, rtol=1e-4)
    assert len(e.kernels) <= 4, str(e)


def test_mlp_block_forward_backward(tf):
    x = tf.rand((8, 32)).requires_grad_()
    w1, b1 = tf.rand((64, 32)).requires_grad_(), tf.rand((64,)).requires_grad_()
    w2 = tf.rand((10, 64)).requires_grad_()
    t = torch.randint(0, 10, (8,))

    def fn(x, w1, b1, w2, t):
        h = F.gelu(F.layer_norm(F.linear(x, w1, b1), (64,)))
        return F.cross_entropy(F.linear(h, w2), t)
    tf.check_grad(fn, x, w1, b1, w2, t, atol=1e-4, rtol=1e-4,
                  allow_fallbacks={"aten.addmm.default", "aten.mm.default"})


def test_attention_softmax_is_one_kernel(tf):
    q, k, v = tf.rand((2, 4, 16, 8)), tf.rand((2, 4, 16, 8)), tf.rand((2, 4, 16, 8))
    tf.check(lambda q, k, v: torch.softmax(q @ k.transpose(-1, -2) / 8 ** 0.5, -1) @ v, q, k, v, kernels=1,
             allow_fallbacks={"aten.bmm.default"}, atol=1e-4, rtol=1e-4)


def test_attention_matches(tf):
    q, k, v = tf.rand((2, 4, 16, 8)), tf.rand((2, 4, 16, 8)), tf.rand((2, 4, 16, 8))
    e = tf.check(lambda q, k, v: torch.softmax(q @ k.transpose(-1, -2) / 8 ** 0.5, -1) @ v, q, k, v,
                 allow_fallbacks={"aten.bmm.default"}, atol=1e-4, rtol=1e-4)
    assert len(e.kernels) <= 2


def test_expensive_shared_value_computed_once(tf):
    """A value with several consumers that is too expensive to recompute is stored once and read."""
    x = tf.rand((32, 100))

    def fn(x):
        y = x.exp().sin().cos().tanh().exp().log1p().sigmoid()
        return y + 1, y * 2, y.sum(-1)
    e = tf.check(fn, x)
    assert len(e.kernels) <= 2
    assert sum(src.count("tf_sinf(") for src in (k.source for k in e.kernels)) == 1


def test_kernel_cache_reuse(tf):
    """Recompiling the same graph builds nothing new: the library comes from a cache."""
    x = tf.rand((5, 9))
    fn = lambda x: torch.softmax(x * 3, -1)  # noqa: E731
    tf.check(fn, x)
    builds = torchfuse.counters["kernel_builds"]
    hits = torchfuse.counters.cache_hits
    generated = torchfuse.counters["kernels_generated"]
    tf.check(fn, x)
    assert torchfuse.counters["kernel_builds"] == builds
    assert torchfuse.counters.cache_hits == hits + 1
    assert torchfuse.counters["kernels_generated"] == generated + 1


def test_torch_compile_entry_point(tf):
    """The registered backend name works through torch.compile and recompiles for new shapes."""
    fn = torch.compile(lambda x, w: F.layer_norm(x, (x.shape[-1],)) * w, backend="torchfuse")
    for shape in ((4, 16), (6, 16), (3, 7)):
        x, w = tf.rand(shape), tf.rand(shape[-1:])
        tf.assert_same(fn(x, w), F.layer_norm(x, (shape[-1],)) * w, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("reduction_first", [False, True])
def test_unrelated_buffer_of_another_layout_stays_out_of_a_reduction(tf, reduction_first):
    """Equal sizes, different layouts, no shared data: a channels-last [16, 64, 28, 28] map and
    a per-channel sum over a channels-last [16, 256, 14, 14] one (a ResNet backward's batch-norm
    gradients of two layers).  Their loops tile each other only with the 64 channels split
    across the sum's rows and reduced dims, so fusing them wrote one uncoalesced: two kernels,
    and the refusal says why."""
    a = tf.rand((16, 64, 28, 28)).to(memory_format=torch.channels_last)
    b = tf.rand((16, 256, 14, 14)).to(memory_format=torch.channels_last)

    def fn(a, b):
        s = (b * 3).sum((0, 2, 3))
        y = a * 2 + 1
        return (s, y) if reduction_first else (y, s)

    e = tf.check(fn, a, b, kernels=2, check_stride=True, atol=1e-4, rtol=1e-4)
    assert any("uncoalesced" in r for r in e.refused_fusions), e.refused_fusions


def test_reduction_reading_another_layout_still_fuses(tf):
    """A member that shares data with the reduction (batch norm's input gradient next to its
    per-channel sums, a softmax written contiguous from a transposed read) stays in its kernel.
    Here the input gradient's [N, C, H, W] loops are a permutation of the sums' [C] x [N, H, W],
    and it is written along the loop the sums read g along: it joins them as their epilogue."""
    x = tf.rand((4, 16, 9, 7)).to(memory_format=torch.channels_last)
    g = tf.rand((4, 16, 9, 7))

    def bn_backward_like(x, g):
        mean = x.mean((0, 2, 3), keepdim=True)
        s = (g * (x - mean)).sum((0, 2, 3), keepdim=True)
        return g - (x - mean) * s

    e = tf.check(bn_backward_like, x, g, atol=1e-5, rtol=1e-4)
    assert len(e.kernels) == 1 and not e.refused_fusions, e


@pytest.mark.parametrize("n", [64, 48])
def test_reductions_reading_each_other_transposed_stay_apart(tf, n):
    """An RMSNorm backward over [tokens, hidden] with tokens == hidden: the weight gradient sums
    g * x * rstd over rows, the input gradient's row sums g * w * x over the row.  Same loop
    sizes, the same g and x, but read across each other, and each with a broadcast vector (rstd,
    w) along its reduced loop: fused, every load of one of them was a gather and neither
    vectorized.  Two kernels, and the refusal says why."""
    g, x, w, rstd = tf.rand((n, n)), tf.rand((n, n)), tf.rand((n,)), tf.rand((n,))

    def fn(g, x, w, rstd):
        return (g * x * rstd[:, None]).sum(0), (g * w * x).sum(1)

    e = tf.check(fn, g, x, w, rstd, kernels=2, atol=1e-4, rtol=1e-4)
    assert any("uncoalesced" in r for r in e.refused_fusions), e.refused_fusions


def _strided_stores(source: str) -> list[str]:
    """The stores of a C++ kernel whose index moves by more than one element along its innermost
    loop (the vectorized one)."""
    loops = re.findall(r"for \(int64_t (\w+) = ", source)
    if not loops:
        return []
    return [m.group(1) for m in re.finditer(r"\n\s+\w+\[(.*?)\] = ", source) if f"({loops[-1]} * " in m.group(1)]


def test_pointwise_kernel_keeps_every_store_contiguous(tf):
    """A Llama MLP's backward: the SiLU gradient is written by rows, and again in the order the
    weight gradient's transposed operand reads it, with no element shared between the two
    walks. Fused into one loop nest, one member was stored with a stride (0.30 ms a call on 2
    cores); each kernel now walks its own stores contiguously, and gradients equal eager's."""
    sys.path.insert(0, str(Path(__file__).parents[2] / "benchmarks"))
    from zoo_models import BY_NAME
    zm = BY_NAME["llama"]
    model, inputs = zm.make("tiny", "cpu", torch.float32)
    model.train()

    def step(*inputs):
        loss = zm.loss(model(*inputs), inputs)
        loss.backward()
        return loss

    e = torchfuse.explain(step, *inputs)
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    torch.testing.assert_close(e.output, step(*inputs))
    for g, p in zip(grads, model.parameters()):
        torch.testing.assert_close(g, p.grad, atol=1e-5, rtol=1e-4)
    pointwise = [k for k in e.kernels if k.name.split(".")[-1].startswith("poi")]
    assert pointwise and not [k.name for k in pointwise if _strided_stores(k.source)]


def test_norm_gradient_of_a_permuted_input_stays_out_of_the_column_sums(tf):
    """ConvNeXt's layer norm over the channels of a channels-last map (permuted to NHWC): its
    backward's weight and bias gradients are column sums over [N*H*W] x [C], its input gradient
    is written per element.  Both read the same gradient, but the input gradient's logical dims
    are NCHW: in the column sums' kernel it was re-tiled with its contiguous channels split
    across kernel loops, sharing only the per-row rstd with them (1.15 ms per call on an H100,
    15x a kernel of its own), and a column sum with a per-element member cannot be split.  It
    joins the row sums over [N, H, W] x [C] it reads, in their order (two kernels, three before
    that placement), never the column sums."""
    x = tf.rand((4, 16, 10, 10)).to(memory_format=torch.channels_last).requires_grad_()
    w, b = tf.rand((16,)).requires_grad_(), tf.rand((16,)).requires_grad_()

    def fn(x, w, b):
        return F.layer_norm(x.permute(0, 2, 3, 1), (16,), w, b, eps=1e-6).permute(0, 3, 1, 2)

    e = tf.check_grad(fn, x, w, b, atol=1e-4, rtol=1e-4)
    backward = [k for k in e.kernels if k.graph.endswith("_backward")]
    assert len(backward) == 2, [k.name for k in backward]     # row sums + input gradient, column sums
    row_sums, column_sums = backward
    assert row_sums.kind == column_sums.kind == "reduction"
    assert [w.split()[1] for w in row_sums.writes] == ["(permute_3)"], row_sums.writes   # the input gradient
    assert len(column_sums.writes) == 2 and "permute_3" not in column_sums.nodes, column_sums


def test_transposed_gradient_stays_out_of_the_column_sums_it_shares_an_input_with(tf):
    """Swin's patch embedding: a layer norm over the channels of a convolution's output read
    as [batch, H*W, channels] (a transposed view of the NCHW map).  The backward's weight and bias
    gradients are column sums over [tokens] x [channels]; the input gradient, read back by the
    convolution's backward, is written NCHW.  In the column sums' kernel it was re-tiled with its
    channels split across the kernel's loops: it read the operands it shares with the sums at
    other elements, each with a stride of 96 (0.86 ms per step on an H100).  It gets a kernel
    of its own."""
    b, c, h, w = 4, 96, 14, 14
    g, x, scale = tf.rand((b, h * w, c)), tf.rand((b, c, h, w)), tf.rand((c,))

    def fn(g, x, scale):
        xt = x.flatten(2).transpose(1, 2)
        dx = (g * scale + xt).transpose(1, 2).reshape(x.shape)
        return (g * xt).sum((0, 1)), g.sum((0, 1)), dx

    e = tf.check(fn, g, x, scale, kernels=2, atol=1e-3, rtol=1e-4)
    sums = next(k for k in e.kernels if k.name.split(".")[-1].startswith("red"))
    assert len(sums.writes) == 2, sums


@pytest.mark.parametrize("stored", [False, True])
@pytest.mark.parametrize("backend", ["cpp", "triton"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hw", [(6, 6), (5, 7)])
def test_norm_over_a_permuted_view_is_one_kernel(tf, dtype, hw, backend, stored):
    """ConvNeXt's LayerNorm2d after a residual add: permute a channels-last [N, C, H, W] map to
    [N, H, W, C], normalize over C, permute back.  The normalized output's loops are [N, C, H, W],
    the statistics' rows x reduced [N, H, W] x [C]: a permutation, not a reshape, of them.  It
    was a kernel of its own that read the rows back (and, at ConvNeXt's sizes, an fp32 copy of
    the sum stored across the rows for it: 0.44 ms per call where Inductor's one kernel takes
    0.05); it is placed in the statistics' order, one kernel.  With H == W the reads of the
    statistics decide which of the two equal dims goes where.  `stored`: the permuted sum is
    stored for its three readers (as on CUDA, where the unfused bias add makes it costlier):
    in its own node's layout, along C.  Stored channels-last, because its inputs are (the
    matmul output's [N*H*W, C] does not count), its dims put H at stride 1, the kernel read
    it across memory, and the normalization could not join it: two kernels."""
    h, w = hw
    x = tf.rand((3, 24, h, w), dtype).to(memory_format=torch.channels_last)
    y = tf.rand((3 * h * w, 24), dtype)        # a linear layer's output
    weight, bias = tf.rand((24,), dtype), tf.rand((24,), dtype)

    def fn(x, y, weight, bias):
        s = x + (y * 0.5).view(3, h, w, 24).permute(0, 3, 1, 2)
        return F.layer_norm(s.permute(0, 2, 3, 1), (24,), weight, bias, eps=1e-6).permute(0, 3, 1, 2)

    tol = 1e-4 if dtype == torch.float32 else 2e-2
    options = {"cpu_backend": backend, **({"inline_max_cost": 0} if stored else {})}
    e = tf.check(fn, x, y, weight, bias, kernels=1, check_stride=True, atol=tol, rtol=tol, options=options)
    assert not e.refused_fusions, e.refused_fusions


def _score_and_max(a, b, src, dst):
    """A per-edge score the graph returns (so it is stored) and its scatter amax per node."""
    e = F.leaky_relu(a[src] + b[dst], 0.2)
    return e, torch.full((a.shape[0],), float("-inf")).scatter_reduce(0, dst, e, "amax", include_self=True)


@pytest.mark.parametrize("backend", ["cpp", "triton"])
def test_scatter_takes_the_kernel_of_what_it_reads_as_prologue(tf, backend):
    """The score's kernel computes the amax in the same loop (its output's initial value runs
    first): two kernels, where the score, the fill and the scatter took three."""
    a, b = tf.rand((37,)), tf.rand((37,))
    src, dst = torch.randint(-37, 37, (300,)), torch.randint(0, 37, (300,))
    options = {"cpu_backend": "triton"} if backend == "triton" else {}
    e = tf.check(_score_and_max, a, b, src, dst, options=options, kernels=2)
    assert "where" in e.kernels[1].nodes and "scatter_reduce" in e.kernels[1].nodes, [k.nodes for k in e.kernels]


def test_scatter_reading_its_producer_elsewhere_is_no_prologue(tf):
    """Read at another point (flipped), the score (stored: returned, and costly) must be complete
    before the scatter starts."""
    a, b = tf.rand((37,)), tf.rand((37,))
    src, dst = torch.randint(-37, 37, (300,)), torch.randint(0, 37, (300,))

    def fn(a, b, src, dst):
        e = (a[src] + b[dst]).sin().exp()
        return e, torch.zeros(37).index_add(0, dst, e.flip(0))
    e = tf.check(fn, a, b, src, dst, kernels=3, atol=1e-5, rtol=1e-5)
    assert any("reads" in r and "but it is written at" in r for r in e.refused_fusions), e.refused_fusions
