"""Reduction lowerings (src/torchfuse/lowering/reduce.py, var/std/logsumexp decompositions) against eager.

Every reduction is checked over the last, first and middle dim, several dims, all dims, with and
without keepdim, on contiguous and non-contiguous inputs; one compiled function per dtype.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

NAN, INF = float("nan"), float("inf")
DIMS = [-1, 0, 1, (0, 2), (2, 0), None]


def _float_reductions(x):
    out = []
    for d in DIMS:
        for k in (False, True):
            if d is None:
                out += [x.sum(), x.mean(), x.amax(), x.amin(), x.prod(), x.var(), x.std(), torch.logsumexp(x,
                (0, 1, 2)),
                        x.max(), x.min(), x.argmax(), x.argmin(), x.any(), x.all(), x.norm()]
                break
            out += [x.sum(d, keepdim=k), x.mean(d, keepdim=k), x.amax(d, keepdim=k), x.amin(d, keepdim=k),
                    x.var(d, keepdim=k), x.std(d, keepdim=k), torch.logsumexp(x, d, keepdim=k),
                    x.var(d, correction=0, keepdim=k), x.std(d, unbiased=False, keepdim=k), *torch.var_mean(x,
                    d, keepdim=k),
                    *torch.std_mean(x, d, keepdim=k), x.any(d, keepdim=k) if isinstance(d, int) else x.amax(d),
                    torch.linalg.vector_norm(x, dim=d, keepdim=k)]
            if isinstance(d, int):
                out += [x.prod(d, keepdim=k), *x.max(d, keepdim=k), *x.min(d, keepdim=k), x.argmax(d, keepdim=k),
                        x.argmin(d, keepdim=k), x.all(d, keepdim=k)]
    return tuple(out)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_float_reductions(tf, dtype):
    x = tf.rand((3, 5, 11), dtype, low=-2, high=2)
    tf.check(_float_reductions, x)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_float_reductions_noncontiguous(tf, dtype):
    x = tf.rand((11, 5, 3), dtype, low=-2, high=2).permute(2, 1, 0)
    y = tf.rand((6, 10, 22), dtype, low=-2, high=2)[::2, ::2, ::2]
    tf.check(lambda x, y: _float_reductions(x) + _float_reductions(y), x, y)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_low_precision_reductions(tf, dtype):
    x = tf.rand((3, 5, 11), dtype, low=-2, high=2)
    # prod of 11 values in [-2, 2] / var may round differently in the last bit of fp16 / bf16
    tf.check(_float_reductions, x, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_low_precision_accumulates_in_fp32(tf, dtype):
    """4096 values in [0, 1): an fp16/bf16 accumulator would stall far below the true sum."""
    x = tf.rand((3, 4096), dtype, low=0, high=1)
    xt = tf.rand((4096, 3), dtype, low=0, high=1)
    e = tf.check(lambda x, xt: (x.sum(-1), x.mean(-1), xt.sum(0), x.sum(), x.var(-1), torch.logsumexp(x, -1),
                                x.sum(-1, dtype=torch.float32), F.softmax(x, -1).sum(-1)), x, xt, rtol=1e-2, atol=1e-2)
    exact = x.double().sum(-1)
    torch.testing.assert_close(e.output[0].double(), exact, rtol=4e-3, atol=0)


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64, torch.bool])
def test_int_and_bool_reductions(tf, dtype):
    x = tf.rand((3, 5, 11), dtype, low=-9, high=9)
    xt = tf.rand((11, 5, 3), dtype, low=-9, high=9).permute(2, 1, 0)

    def fn(x, xt):
        out = []
        for v in (x, xt):
            for d in (-1, 0, 1, (0, 2), None):
                if d is None:
                    out += [v.sum(), v.amax(), v.amin(), v.max(), v.min(), v.any(), v.all(),
                            v.sum(dtype=torch.float32), v.mean(dtype=torch.float64)]
                    if v.dtype != torch.bool:
                        out += [v.argmax(), v.argmin()]
                    continue
                out += [v.sum(d), v.sum(d, keepdim=True), v.amax(d), v.amin(d, keepdim=True), v.any(d), v.all(d)
                        if isinstance(d, int) else v.any(d), v.sum(d, dtype=torch.int32)]
                if isinstance(d, int):
                    out += [*v.max(d), *v.min(d, keepdim=True), v.prod(d)]
                    if v.dtype != torch.bool:
                        out += [v.argmax(d), v.argmin(d)]
        return tuple(out)
    tf.check(fn, x, xt)


def test_int_prod_and_sum_no_overflow_in_int32(tf):
    """int32 sums accumulate (and return) int64: 200 * 2**24 does not fit in int32."""
    x = torch.full((4, 200), 2 ** 24, dtype=torch.int32)
    x[1] = -(2 ** 24)
    p = torch.randint(1, 4, (4, 15), dtype=torch.int32)
    tf.check(lambda x, p: (x.sum(-1), x.sum(), p.prod(-1), p.prod(), x.sum(0), (x > 0).sum(-1)), x, p)


def test_argmax_ties_first_index(tf):
    """Ties return the first index, as eager does, for every dim and for the flattened tensor."""
    x = torch.randint(0, 3, (6, 5, 7)).float()
    i = torch.randint(-2, 2, (6, 5, 7), dtype=torch.int64)
    c = torch.ones(4, 9)

    def fn(x, i, c):
        out = []
        for v in (x, i, x.transpose(0, 2)):
            for d in (0, 1, 2, -1):
                out += [v.argmax(d), v.argmin(d), *v.max(d), *v.min(d), v.argmax(d, keepdim=True)]
            out += [v.argmax(), v.argmin()]
        return tuple(out) + (c.argmax(), c.argmin(1), c.max(0)[1], c.argmax(0, keepdim=True))
    tf.check(fn, x, i, c)


def test_nan_rows(tf):
    """NaN propagates through max/min/amax/argmax (the index of the first NaN) and through sums."""
    x = torch.randn(5, 9)
    x[1, 3] = NAN
    x[2, :] = NAN
    x[3, 0] = NAN
    x[3, 7] = NAN
    x[4, 8] = NAN
    big = torch.randn(300, 200)     # large enough for the parallel reduction path
    big[123, 45] = NAN
    m = torch.randn(4, 6)
    m[0] = -INF
    m[1, 2] = INF
    m[2, 0] = INF
    m[2, 1] = -INF

    def fn(x, big, m):
        out = []
        for d in (0, 1):
            out += [x.amax(d), x.amin(d), *x.max(d), *x.min(d), x.argmax(d), x.argmin(d), x.sum(d), x.mean(d),
                    x.var(d), x.prod(d), torch.logsumexp(x, d), F.softmax(x, d), x.nansum(d)]
        out += [x.max(), x.min(), x.amax(), x.argmax(), x.argmin(), big.amax(), big.amin(), big.max(), big.sum(),
                big.argmax(), big.amax(0), big.amax(1), x.t().amax(1)]
        out += [torch.logsumexp(m, 1), torch.logsumexp(m, 0), m.amax(1), m.amin(1), m.sum(1), F.softmax(m, 1),
                F.log_softmax(m, 0)]
        return tuple(out)
    tf.check(fn, x, big, m, allow_fallbacks={"aten.nansum.default"})


def test_large_parallel_reductions(tf):
    """Sizes above the parallel threshold: all-reduce (parallel over the reduced dim) and row-reduce."""
    x = torch.randn(300, 200)
    tf.check(lambda x: (x.sum(), x.mean(), x.amax(), x.amin(), x.prod(-1), x.var(), x.std(0), x.sum(0), x.sum(1),
                        (x > 0).any(), (x > -10).all(), (x > 0).sum(), torch.logsumexp(x, 0), x.abs().sum()), x,
             atol=1e-3, rtol=1e-4)


@pytest.mark.filterwarnings("ignore:.*degrees of freedom:UserWarning")
def test_empty_reductions(tf):
    """Reducing over a size-0 dim: identities (sum 0, prod 1, any False, all True, logsumexp -inf,
    mean/var NaN); reducing a tensor with a size-0 kept dim gives an empty result."""
    e = tf.rand((3, 0, 4))
    ei = torch.zeros((3, 0), dtype=torch.int64)

    def fn(e, ei):
        return (e.sum(1), e.prod(1), e.mean(1), e.any(1), e.all(1), torch.logsumexp(e, 1), e.var(1), e.sum(),
                e.sum(2), e.amax(2), e.amin(2, keepdim=True), e.mean(0), e.sum((0, 1)), e.prod(), ei.sum(1),
                ei.sum(), ei.prod(1), ei.any(), ei.all(1), e.amax(0), e.max(2)[0], e.argmax(2), e.std(1),
                e.sum(1, keepdim=True))
    tf.check(fn, e, ei)


@pytest.mark.filterwarnings("ignore:.*degrees of freedom:UserWarning")
def test_zero_dim_and_size_one(tf):
    s = tf.rand(())
    o = tf.rand((1, 7, 1))

    def fn(s, o):
        return (s.sum(), s.mean(), s.amax(), s.argmax(), s.max(), s.prod(), s.sum(0), s.amax(-1, keepdim=True),
                s.argmax(0), *s.max(0), o.sum(0), o.sum(2), o.sum((0, 2)), o.mean(-1, keepdim=True), o.amax(1),
                o.argmax(1), o.var(1), o.var(0), o.std(2, correction=0), o.logsumexp(0), o.argmax(), *o.min(1))
    tf.check(fn, s, o)


def test_reduction_fused_prologue_epilogue(tf):
    """Pointwise work before and after a reduction, on odd and non-contiguous shapes."""
    x = tf.rand((7, 13))
    xt = tf.rand((13, 7)).t()
    w = tf.rand((13,))

    def fn(x, xt, w):
        s = (x * w + 1).exp().sum(-1, keepdim=True)
        a = (xt * w).amax(0)
        m = (x - x.mean(-1, keepdim=True)) / (x.std(-1, keepdim=True) + 1e-5)
        return s.log() * 2, a.relu(), m * w, (xt.abs().sum(1) / x.abs().sum(1)), torch.log_softmax(xt, 0) + 1
    tf.check(fn, x, xt, w)


def test_reductions_backward(tf):
    """Autograd of reductions: sum/mean/amax/logsumexp/var backward graphs are lowered too."""
    x = tf.rand((5, 9)).requires_grad_()
    tf.check_grad(lambda x: x.sum(1) * 2 + x.mean(0).sum() + x.amax(1) + torch.logsumexp(x, 1) + x.var(1) + x.std(1)
                  + x.prod(1), x, allow_fallbacks={"aten.cumprod.default"})   # prod's backward uses cumprod


def test_reduction_edge_values(tf):
    """any/all treat NaN as true and -0.0 as false; all -inf / +inf rows give index 0; int64 extremes."""
    x = tf.rand((5, 9))
    x[0, 1] = NAN
    z = torch.tensor([[-0.0, 0.0], [1.0, -0.0], [NAN, 0.0]])
    inf_rows = torch.tensor([[-INF] * 4, [INF] * 4, [-INF, INF, -INF, INF]])
    i64 = torch.tensor([[2 ** 62, -(2 ** 62), 2 ** 63 - 1, -(2 ** 63)], [5, 5, -5, -5]])

    def fn(x, z, inf_rows, i64):
        return ((x * NAN).any(1), x.all(1), z.any(1), z.all(1), z.any(0), inf_rows.amax(1), inf_rows.argmax(1),
                inf_rows.argmin(1), inf_rows.amin(1), *inf_rows.max(1), i64.amin(1), i64.amax(1), i64.argmin(1),
                i64.argmax(1), x.sum(1, dtype=torch.float64), x.half().sum(0, dtype=torch.float32),
                x.double().mean(1, dtype=torch.float32))
    tf.check(fn, x, z, inf_rows, i64)


@pytest.mark.parametrize("dtype", [torch.int8, torch.uint8])
def test_small_int_reductions(tf, dtype):
    x = tf.rand((5, 9), dtype, low=1 if dtype == torch.uint8 else -100, high=100)
    tf.check(lambda x: (x.sum(1), x.amax(1), x.amin(0), x.argmax(0), *x.max(1), x.sum(),
    x.prod(0) if dtype == torch.int8
                        else x.any(0)), x)


def test_reductions_dynamic_shapes(tf):
    def fn(x):
        return (x.sum(0), x.sum(), x.amax(1), x.argmax(1), x.var(1), x.mean(0, keepdim=True), torch.softmax(x, 0),
                torch.logsumexp(x, 1), F.layer_norm(x, (x.shape[-1],)), x.min(1)[1])
    tf.check_dynamic(fn, [(tf.rand((5, 7)),), (tf.rand((9, 3)),), (tf.rand((4, 16)),)], atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_safe_softmax_masked_rows_are_zero(tf, dtype):
    """aten._safe_softmax (what SDPA's math path and BERT's attention produce) is decomposed and
    fused: rows that are -inf everywhere give zeros, not NaN; one kernel."""
    x = tf.rand((4, 3, 7, 9), dtype)
    m = torch.zeros(4, 1, 7, 9, dtype=dtype)
    m[0, :, 2, :] = float("-inf")
    m[1, :, :, 3] = float("-inf")
    tf.check(lambda x, m: torch.ops.aten._safe_softmax(x + m, -1), x, m, kernels=1)


def test_channel_statistics_after_a_strided_conv_under_dynamic_shapes(tf):
    """A batch norm's statistics of a channels-last stride-2 conv output, sizes symbolic: the
    output's spatial sizes are (s - 1) // 2 + 1, and the flat row index of the reduction once came
    back through divisions and remainders by them (a gather per element, 2x slower than the static
    graph on a ResNet stage).  The loads are now affine in the loop variables, and the results
    equal eager's for every size."""
    import re

    from torchfuse.config import Config
    from torchfuse.frontend.dynamo import TorchfuseBackend
    from torchfuse.report import Explanation

    torch.manual_seed(0)
    conv = torch.nn.Conv2d(4, 8, 3, stride=2, padding=1).to(memory_format=torch.channels_last)

    def fn(x):
        return torch.var_mean(conv(x), (0, 2, 3), correction=0)

    report = Explanation()
    compiled = torch.compile(fn, backend=TorchfuseBackend(Config.from_options({"strict": True}), report=report),
                             dynamic=True)
    with torch.no_grad():
        for shape in ((2, 4, 9, 9), (3, 4, 12, 10), (1, 4, 7, 16)):
            x = tf.rand(shape).contiguous(memory_format=torch.channels_last)
            tf.assert_same(compiled(x), fn(x), atol=1e-5, rtol=1e-4)
    assert report.kernels
    indices = [m.group(1) for k in report.kernels for m in re.finditer(r"\b(?:in|buf)\w*\[([^\]]*)\]", k.source)]
    assert indices and not [i for i in indices if "/" in i or "%" in i], indices
