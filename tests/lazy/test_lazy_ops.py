"""torchfuse.lazy on single ops and small fusions: results equal eager mode (values, dtypes,
shapes and strides), fusible chains become one kernel, only needed values are computed."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from _lazy_helpers import check, run_lazy

import torchfuse
from torchfuse import counters
from torchfuse.lazy import LazyTensor

aten = torch.ops.aten


def r(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    x = torch.randn(shape)
    return torch.where(x.abs() < 1e-3, torch.full_like(x, 0.5), x).to(dtype)


CASES = {
    "pointwise_chain": (lambda x: ((x * 2 + 1).relu() - 0.5).exp().sigmoid() * 3, lambda: (r(5, 7),)),
    "unary_mix": (lambda x: x.abs().sqrt().log1p() + x.sin() * x.cos() - x.tanh().neg(), lambda: (r(9, 4),)),
    "binary_tensors": (lambda x, y: torch.maximum(x, y) / (y.abs() + 1) - torch.minimum(x, y), lambda: (r(6, 5), r(6, 5))),
    "softmax": (lambda x: torch.softmax(x, -1), lambda: (r(4, 33),)),
    "log_softmax_dim0": (lambda x: torch.log_softmax(x, 0), lambda: (r(7, 3),)),
    "layer_norm": (lambda x, w, b: F.layer_norm(x, (8,), w, b), lambda: (r(3, 5, 8), r(8), r(8))),
    "rms_norm_manual": (lambda x, w: x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w, lambda: (r(4, 16), r(16))),
    "reductions": (lambda x: (x.sum(), x.sum(1), x.mean(0, keepdim=True), x.amax(1), x.amin(0), x.var(1), x.prod(1)),
                   lambda: (r(5, 6),)),
    "argmax_max_dim": (lambda x: (x.argmax(1), x.max(1), x.min(0)), lambda: (r(5, 6),)),
    "views_chain": (lambda x: (x * 2).t().reshape(35)[::2] + 1, lambda: (r(5, 7),)),
    "view_outputs": (lambda x: ((x * 2).t(), (x + 1)[1:3], (x * 3).unsqueeze(0).expand(2, 5, 7), (x - 1).view(7, 5)),
                     lambda: (r(5, 7),)),
    "permute_reduce": (lambda x: (x + 1).permute(2, 0, 1).sum(0), lambda: (r(2, 3, 4),)),
    "broadcast": (lambda x, y, b: x * y + b, lambda: (r(5, 7), r(7), r(5, 1))),
    "broadcast_3d": (lambda x, y: (x[:, None, :] - y[None, :, :]).pow(2).sum(-1), lambda: (r(4, 3), r(5, 3))),
    "where_scalar": (lambda x: torch.where(x > 0, x, 0.0) + torch.where(x < -1, -1.0, x), lambda: (r(6, 6),)),
    "cat_split": (lambda x: [t * 2 for t in torch.cat([x * 2, x + 1], 0).split(3, 1)], lambda: (r(4, 6),)),
    "activations": (lambda x: F.gelu(x) + F.silu(x) + F.gelu(x, approximate="tanh") + F.leaky_relu(x, 0.1),
                    lambda: (r(8, 8),)),
    "clamp_hardtanh": (lambda x: x.clamp(-0.5, 0.7) + F.hardtanh(x * 3) + x.clamp_min(0), lambda: (r(5, 5),)),
    "factories": (lambda x: x + torch.arange(7) + torch.ones(5, 7) + torch.full((7,), 2.5), lambda: (r(5, 7),)),
    "clone_and_identity": (lambda x: (x.clone(), x * 1, x + 0), lambda: (r(3, 4),)),
    "transposed_input": (lambda x: (x.exp() + 1, x.sum(0)), lambda: (r(6, 4).t(),)),
    "sliced_input": (lambda x: x * 2 - 1, lambda: (r(9, 26)[1::2, ::3],)),
    "scalar_tensor": (lambda x: (x * 3 + 1).sqrt(), lambda: (r().abs(),)),
    "empty_tensor": (lambda x: (x * 2 + 1, x.sum(1)), lambda: (r(0, 5),)),
    "embedding_gather": (lambda w, i: F.embedding(i, w) * 2, lambda: (r(10, 4), torch.tensor([[1, 3], [9, 0]]))),
}


@pytest.mark.parametrize("name", list(CASES))
def test_op_cases_match_eager(tf, name):
    fn, make = CASES[name]
    args = make()
    check(tf, fn, *args, min_kernels=0 if name == "empty_tensor" else 1)


DTYPES = {
    "fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16, "fp64": torch.float64,
}


@pytest.mark.parametrize("dt", list(DTYPES))
def test_float_dtypes(tf, dt):
    dtype = DTYPES[dt]
    x, y = r(6, 9, dtype=dtype), r(9, dtype=dtype)
    check(tf, lambda a, b: ((a * b + 1).tanh().sum(-1), torch.softmax(a, -1), (a * 2).float()), x, y)


def test_int_dtypes(tf):
    x = torch.randint(-7, 7, (5, 7))
    y = torch.randint(1, 5, (7,), dtype=torch.int32)
    check(tf, lambda a, b: ((a * 3 + b) // 2 % 4, a.sum(1), a.abs().max(), (a.float() * 0.5).to(torch.int32),
                            a.to(torch.int8) * 3, a >> 1), x, y)


def test_bool_dtype(tf):
    x = torch.randint(-5, 5, (5, 7))
    check(tf, lambda a: (((a > 0) & (a < 3)) | (a == -1), (a > 0).sum(), (a > 2).any(1), (a != 0).all(),
                         ~(a > 1), (a > 0).float().mean()), x)


def test_type_promotion_scalars(tf):
    xi, xh = torch.randint(0, 5, (4, 4)), r(4, 4, dtype=torch.float16)
    check(tf, lambda a, h: (a * 2, a * 2.5, a / 2, h * 2.0, h + a, a + True), xi, xh)


def test_six_op_chain_is_one_kernel():
    x = r(64, 64)
    before = counters["kernels_generated"]
    # mul, add, relu, sub, exp, sigmoid
    out, ctx = run_lazy(lambda t: ((t * 1.25 + 0.5).relu() - 0.125).exp().sigmoid(), x)
    assert len(ctx.flushes) == 1
    f = ctx.flushes[0]
    assert f.ops == 6 and f.outputs == 1 and f.kernels == 1, ctx.explain()
    assert counters["kernels_generated"] - before <= 1
    torch.testing.assert_close(out, ((x * 1.25 + 0.5).relu() - 0.125).exp().sigmoid())


def test_results_are_pending_inside_the_block():
    x = r(4, 4)
    with torchfuse.lazy() as ctx:
        y = x.exp() * 2
        assert isinstance(y, LazyTensor) and y._lz_real is None
        assert y.shape == (4, 4) and y.stride() == (4, 1) and y.dtype == torch.float32
        assert not ctx.flushes
    assert y._lz_real is not None and len(ctx.flushes) == 1


def test_only_needed_values_are_flushed():
    x, w = r(4, 4), r(4, 4)
    with torchfuse.lazy(defer_matmuls=False) as ctx:      # the matmul forces its inputs
        a = x * 2 + 1
        b = x.exp() - 3          # not needed by the matmul
        c = a @ w
        assert len(ctx.flushes) == 1 and ctx.flushes[0].ops == 2
        assert ctx.flushes[0].reason.startswith("aten.mm.default")
        assert b._lz_real is None, "an unrelated pending value was computed"
        assert type(c) is torch.Tensor
    torch.testing.assert_close(c, (x * 2 + 1) @ w)
    torch.testing.assert_close(b, x.exp() - 3)


def test_dead_values_are_never_computed():
    x = r(8, 8)
    with torchfuse.lazy() as ctx:
        keep = x.sin() + 1
        for _ in range(5):
            dead = x.cos() * 7       # dropped on the next iteration / by del
        del dead
    assert len(ctx.flushes) == 1
    assert ctx.flushes[0].ops == 2, ctx.explain()
    assert "aten.cos.default" not in ctx.flushes[0].op_names
    torch.testing.assert_close(keep, x.sin() + 1)


def test_intermediates_shared_by_two_outputs():
    x = r(5, 5)
    with torchfuse.lazy() as ctx:
        base = x * 3
        a = base + 1
        b = base.sum(0)
        del base
    assert len(ctx.flushes) == 1 and ctx.flushes[0].outputs == 2 and ctx.flushes[0].ops == 3
    torch.testing.assert_close(a, x * 3 + 1)
    torch.testing.assert_close(b, (x * 3).sum(0))


def test_size_limit_flushes_everything_pending():
    x = r(16)
    with torchfuse.lazy(max_nodes=16) as ctx:
        y = x
        for _ in range(40):
            y = y * 1.01 + 0.01
    ref = x
    for _ in range(40):
        ref = ref * 1.01 + 0.01
    torch.testing.assert_close(y, ref)
    reasons = [f.reason for f in ctx.flushes]
    assert reasons.count("size limit") >= 4, reasons
    assert all(f.ops <= 16 for f in ctx.flushes), ctx.explain()


def test_non_fusible_ops_run_eagerly_on_computed_inputs(tf):
    x, w, b = r(4, 8), r(8, 3), r(3)
    check(tf, lambda a, m, c: (F.linear((a * 2).relu(), m.t(), c).softmax(-1), torch.cumsum(a.exp(), 1),
                               torch.sort(a + 1, 1).values, torch.nonzero(a > 0)), x, w, b)


def test_matmuls_are_deferred_into_the_graph():
    # By default a matmul is recorded too: linear -> gelu -> linear -> residual -> layer norm is
    # one flush, the matmuls run through ATen inside the compiled graph.
    x, w1, b1, w2 = r(6, 8), r(16, 8), r(16), r(8, 16)

    def mlp(a):
        h = F.gelu(F.linear(a * 2, w1, b1))
        return F.layer_norm(a + h @ w2.t(), (8,)), torch.bmm(a[None], w1.t()[None]).relu()

    before = counters["eager_fallbacks"]
    out, ctx = run_lazy(mlp, x)
    assert counters["eager_fallbacks"] == before
    for got, want in zip(out, mlp(x)):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)
    assert len(ctx.flushes) == 1 and ctx.flushes[0].reason == "end of the lazy block", ctx.explain()
    names = ctx.flushes[0].op_names
    assert "aten.addmm.default" in names or "aten.mm.default" in names, names
    # attention is deferred too when it has no dropout (dropout_p > 0 is random: eager)
    q = r(1, 2, 4, 8)
    with torchfuse.lazy() as ctx:
        a = F.scaled_dot_product_attention(q * 1, q, q)
    torch.testing.assert_close(a, F.scaled_dot_product_attention(q, q, q), atol=1e-5, rtol=1e-4)
    assert len(ctx.flushes) == 1 and ctx.flushes[0].reason == "end of the lazy block", ctx.explain()


def test_fallback_ops_option_runs_op_eagerly():
    x = r(4, 4)
    with torchfuse.lazy(options={"fallback_ops": ["aten.exp.default"]}) as ctx:
        y = (x * 2).exp() + 1
    torch.testing.assert_close(y, (x * 2).exp() + 1)
    assert [f.reason for f in ctx.flushes][0].startswith("aten.exp.default is not fusible")


def test_debug_folder_and_explain(tmp_path):
    x = r(6, 6)
    dbg = tmp_path / "dbg"
    with torchfuse.lazy(options={"debug": True, "debug_dir": str(dbg)}, defer_matmuls=False) as ctx:
        y = (x * 2.75).softmax(-1)
        z = y @ x
        w = (z + 1).relu()
    torch.testing.assert_close(w, ((x * 2.75).softmax(-1) @ x + 1).relu())
    text = ctx.explain()
    assert "aten.mm.default is not fusible" in text and "end of the lazy block" in text
    folders = sorted(p.name for p in dbg.iterdir() if p.is_dir())
    compiled = [f.graph for f in ctx.flushes if not f.cache_hit]
    assert compiled and all(g in folders for g in compiled), (folders, compiled)
    assert all(g.endswith("_lazy") for g in compiled)
    log_files = list(dbg.glob("lazy_*.txt"))
    assert len(log_files) == 1 and "flush" in log_files[0].read_text()
    assert ctx.report.kernels and ctx.report.graphs
