"""Pointwise op lowerings (src/torchfuse/lowering/pointwise.py) and their C++ emission, against eager.

Many ops are checked inside one compiled function (one C++ build) returning a tuple; the test is
parametrized over dtypes and run on several layouts at once (contiguous odd sizes, transposed,
step-sliced, size-1 dims, 0-d, empty).
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import torchfuse

FLOATS = [torch.float32, torch.float64, torch.float16, torch.bfloat16]
INTS = [torch.int32, torch.int64]
NAN, INF = float("nan"), float("inf")


def _on_layouts(ops, xs):
    """fn(*xs) -> every op applied to every input."""
    def fn(*xs):
        return tuple(o(x) for x in xs for o in ops)
    return fn


# ------------------------------------------------------------------------------------------------
# unary float math
# ------------------------------------------------------------------------------------------------

ANY_REAL = [
    torch.exp, torch.exp2, torch.expm1, torch.sin, torch.cos, torch.atan, torch.sinh, torch.cosh,
    torch.tanh, torch.asinh, torch.sigmoid, torch.erf, torch.erfc, torch.abs, torch.neg, torch.sign,
    torch.reciprocal, torch.square, torch.round, torch.floor, torch.ceil, torch.trunc, torch.frac,
    torch.signbit,
]
POSITIVE = [torch.log, torch.log2, torch.log10, torch.log1p, torch.sqrt, torch.rsqrt,
            lambda x: torch.acosh(x + 1), torch.lgamma]
UNIT = [torch.asin, torch.acos, torch.atanh, torch.tan]


@pytest.mark.parametrize("dtype", FLOATS)
def test_unary_any_real(tf, dtype):
    xs = list(tf.layouts(dtype).values())
    tf.check(_on_layouts(ANY_REAL, xs), *xs)


@pytest.mark.parametrize("dtype", FLOATS)
def test_unary_positive_domain(tf, dtype):
    xs = [x.abs() + 0.1 for x in tf.layouts(dtype).values()]
    # lgamma: rtol because fp16/bf16 round the (larger) result
    tf.check(_on_layouts(POSITIVE, xs), *xs)


@pytest.mark.parametrize("dtype", FLOATS)
def test_unary_unit_domain(tf, dtype):
    xs = [x / 4 for x in tf.layouts(dtype).values()]
    tf.check(_on_layouts(UNIT, xs), *xs)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_activations(tf, dtype):
    acts = [
        torch.relu, F.relu6, lambda x: F.gelu(x), lambda x: F.gelu(x, approximate="tanh"), F.silu,
        lambda x: F.leaky_relu(x, 0.1), F.leaky_relu, lambda x: F.elu(x, alpha=0.7), F.elu, F.selu, F.celu,
        F.hardtanh, lambda x: F.hardtanh(x, -0.5, 2.0), F.hardswish, F.hardsigmoid, F.softplus,
        lambda x: F.softplus(x, beta=2.0, threshold=1.0), F.mish, torch.sigmoid, torch.tanh, F.logsigmoid,
        lambda x: F.threshold(x, 0.5, -2.0),
    ]
    xs = list(tf.layouts(dtype, low=-6, high=6).values())
    tf.check(_on_layouts(acts, xs), *xs)


def test_activations_fp16(tf):
    acts = [torch.relu, lambda x: F.gelu(x), lambda x: F.gelu(x, approximate="tanh"), F.silu, F.leaky_relu,
            F.elu, F.hardtanh, F.hardswish, F.hardsigmoid, F.softplus, F.mish]
    x = tf.rand((7, 13), torch.float16, low=-6, high=6)
    tf.check(_on_layouts(acts, [x]), x)


def test_rounding_ties_and_integers(tf):
    """round() is half-to-even; integer inputs to rounding ops are returned unchanged."""
    x = torch.tensor([0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 0.49999997, 3.7, -3.7, 1e8 + 0.5, 2.0 ** 23 + 1])
    i = torch.tensor([-7, 0, 3, 2 ** 40], dtype=torch.int64)
    i32 = torch.tensor([-7, 5, 3], dtype=torch.int32)

    def fn(x, i, i32):
        return (torch.round(x), torch.floor(x), torch.ceil(x), torch.trunc(x), torch.frac(x),
                torch.round(i), torch.floor(i), torch.ceil(i32), torch.trunc(i32), torch.round(x.double()))
    tf.check(fn, x, i, i32, signed_zeros=True)


def test_special_values_unary(tf):
    """NaN / +-inf / -0.0 through unary math; sign of zero must match eager."""
    x = torch.tensor([NAN, INF, -INF, -0.0, 0.0, 1.0, -1.0, 1e-30, -1e30])

    def exact(x):   # sign of zero checked
        return (x.neg(), x.abs(), torch.sign(x), torch.relu(x), x.exp(), x.log(), x.sqrt(), x.rsqrt(),
                x.reciprocal(), x.tanh(), x.sigmoid(), x.floor(), x.ceil(), x.round(), x.trunc(), x.frac(),
                x.isnan(), x.isinf(), x.isfinite(), x.signbit(), x.expm1(), x.log1p(), torch.erf(x),
                torch.atan(x), x * 0, -x * 1, x.square(), torch.nan_to_num(x),
                torch.nan_to_num(x, nan=1.0, posinf=2.0, neginf=-2.0))

    def activations(x):
        return (F.gelu(x), F.gelu(x, approximate="tanh"), F.silu(x), F.softplus(x), F.elu(x), F.mish(x),
                F.hardswish(x), F.leaky_relu(x), torch.erfc(x), torch.sinh(x), torch.cosh(x), torch.asinh(x))

    for x in (x, x.double()):
        tf.check(exact, x, signed_zeros=True)
    tf.check(activations, x)



def test_sin_cos_float32_whole_range(tf):
    """float32 sin/cos are the C++ prelude's own vectorized tf_sinf/tf_cosf: two range reductions
    (below and above 2^20) chosen per element; every magnitude up to float's largest, both signs,
    and values at the switch and at multiples of pi/2 must match eager (itself within 1 ulp)."""
    g = torch.Generator().manual_seed(3)
    mags = torch.logspace(-30, 38.5, 2001, dtype=torch.float64).float()
    near = torch.tensor([2.0 ** 20, 1048575.9, 1048576.1, 2.0, 1.9999999, 1.5707964, 3.1415927, 4.712389,
                         355.0, 103993.0, 3.4028235e38])
    x = torch.cat([mags, near, torch.rand(4001, generator=g) * 200 - 100])
    x = torch.cat([x, -x, torch.tensor([0.0, -0.0, NAN, INF, -INF, 1e-45])])
    tf.check(lambda x: (torch.sin(x), torch.cos(x), torch.sin(x[::3]) * torch.cos(x[1::3])), x,
             signed_zeros=True)


def test_expm1_float32_whole_range(tf):
    """float32 expm1 is the prelude's vectorized tf_expm1f (a series inside (-1, 1.5), exp(x) - 1
    outside): every magnitude from subnormal to overflow, both signs, the switch points, -0
    kept, +-inf and NaN, as eager (its Sleef expm1 is within 1 ulp; ours 1.6); and in an ELU."""
    g = torch.Generator().manual_seed(5)
    mags = torch.logspace(-45, 2, 3001, dtype=torch.float64).float()
    near = torch.tensor([1.0, 0.99999994, 1.0000001, 1.5, 1.4999999, 1.5000001, 88.72, 88.73, 89.0, 104.0, 1e30,
                         3.4028235e38, 1e-45, 1e-38, 1e-7, 5e-4])
    x = torch.cat([mags, near, torch.rand(4001, generator=g) * 8 - 4])
    x = torch.cat([x, -x, torch.tensor([0.0, -0.0, NAN, INF, -INF])])
    tf.check(lambda x: (torch.expm1(x), F.elu(x[::2] * 2), F.selu(x[1::2])), x, signed_zeros=True)


def test_special_values_low_precision(tf):
    x = torch.tensor([NAN, INF, -INF, -0.0, 0.0, 65504.0, 1e5, -1e5, 6e-8, 1e-40])

    def fn(x):
        return (x.half(), x.bfloat16(), (x * 2).half(), x.half().neg(), x.bfloat16().abs(), x.half().float(),
                x.bfloat16().double(), x.half().isinf(), x.bfloat16().isnan(), x.half().to(torch.bfloat16))
    tf.check(fn, x, signed_zeros=True)


def test_isnan_isinf_on_ints_and_bools(tf):
    i, b = tf.rand((5, 3), torch.int32), tf.rand((5, 3), torch.bool)
    tf.check(lambda i, b: (i.isnan(), i.isinf(), i.isfinite(), b.isnan(), b.isfinite(), i.sign(), i.abs(),
                           i.neg(), b.sign(), b.logical_not()), i, b)


# ------------------------------------------------------------------------------------------------
# binary arithmetic
# ------------------------------------------------------------------------------------------------

def _arith(a, b):
    return (a + b, a - b, a * b, torch.add(a, b, alpha=2), torch.sub(a, b, alpha=3), a + 1, 2 - a, a * 3,
            torch.add(a, 5, alpha=2), torch.rsub(a, b), torch.rsub(a, 2, alpha=3))


@pytest.mark.parametrize("dtype", FLOATS + INTS)
def test_add_sub_mul(tf, dtype):
    # fp16/bf16 get whole numbers: eager's strided (non-vectorized) path rounds alpha * b to the
    # low-precision dtype before adding, its contiguous path does not; whole numbers make both exact
    if dtype in (torch.float16, torch.bfloat16):
        vals = lambda *s: tf.rand(s, torch.int64, low=-50, high=50).to(dtype)  # noqa: E731
    else:
        vals = lambda *s: tf.rand(s, dtype, low=-50, high=50)  # noqa: E731
    a, b, at, s = vals(7, 13), vals(13), vals(13, 7).t(), vals()   # contiguous, broadcast, transposed, 0-d
    e = tf.rand((0, 13), dtype)
    fn = lambda a, b, at, s, e: _arith(a, b) + _arith(at, a) + _arith(s, a) + _arith(e, b) + _arith(s, s)  # noqa
    tf.check(fn, a, b, at, s, e)


def test_add_bool_and_alpha_floats(tf):
    p, q = tf.rand((5, 7), torch.bool), tf.rand((5, 7), torch.bool)
    x = tf.rand((5, 7))
    tf.check(lambda p, q, x: (p + q, p * q, torch.add(x, x, alpha=0.25), torch.sub(x, p.float(), alpha=-1.5),
                              p + 1, p * 2.5, x + p), p, q, x)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
def test_div_float_modes(tf, dtype):
    a = tf.rand((7, 13), dtype, low=-20, high=20)
    b = tf.rand((7, 13), dtype, low=-5, high=5)
    a2 = tf.rand((13, 7), dtype, low=-20, high=20).t()

    def fn(a, b, a2):
        out = []
        for x, y in ((a, b), (a2, b), (a, 3.0), (a, -2.5), (b, a2[0])):
            out += [x / y, torch.div(x, y, rounding_mode="trunc"), torch.div(x, y, rounding_mode="floor"),
                    torch.floor_divide(x, y), torch.remainder(x, y), torch.fmod(x, y), x // y, x % y]
        return tuple(out)
    tf.check(fn, a, b, a2)


@pytest.mark.parametrize("dtype", INTS)
def test_div_int_modes(tf, dtype):
    """Integer division with negative operands: floor vs trunc vs true division, remainder vs fmod."""
    a = torch.tensor([7, -7, 7, -7, 6, -6, 0, 1, -1, 100, -100, 5], dtype=dtype).reshape(3, 4)
    b = torch.tensor([2, 2, -2, -2, 3, 3, 5, -3, 3, 7, 7, -5], dtype=dtype).reshape(3, 4)
    r = tf.rand((7, 13), dtype, low=-100, high=100)
    d = tf.rand((7, 13), dtype, low=-9, high=9)

    def fn(a, b, r, d):
        out = []
        for x, y in ((a, b), (r, d), (r, 3), (r, -4), (a.t(), b.t())):
            out += [x / y, torch.div(x, y, rounding_mode="trunc"), torch.div(x, y, rounding_mode="floor"),
                    torch.floor_divide(x, y), torch.remainder(x, y), torch.fmod(x, y), x // y, x % y]
        out += [r / 2.5, r // 2.5, r % 2.5, torch.fmod(r, 2.5)]
        return tuple(out)
    tf.check(fn, a, b, r, d)


def test_division_by_zero_floats(tf):
    a = torch.tensor([1.0, -1.0, 0.0, -0.0, NAN, INF, -INF, 5.5, -5.5])
    z = torch.tensor([0.0, 0.0, 0.0, 0.0, 0.0, 0.0, -0.0, -0.0, -0.0])

    def fn(a, z):
        return (a / z, torch.div(a, z, rounding_mode="trunc"), torch.div(a, z, rounding_mode="floor"),
                torch.remainder(a, z), torch.fmod(a, z), a / INF, torch.remainder(a, INF), torch.fmod(a, -INF),
                torch.div(a, INF, rounding_mode="floor"), a.reciprocal())
    tf.check(fn, a, z, signed_zeros=True)
    tf.check(fn, a.double(), z.double(), signed_zeros=True)


def test_floor_division_signed_zero_and_exactness(tf):
    """floor division results of 0 carry the sign of a/b, as in eager."""
    a = torch.tensor([0.0, -0.0, 0.5, -0.5, 1e-3, 3.0, -3.0, 7.5, -7.5, 1e20, 0.3])
    b = torch.tensor([2.0, 2.0, -3.0, 3.0, -1.0, 1.0, 1.0, 2.5, 2.5, 3.0, 0.1])
    tf.check(lambda a, b: (torch.div(a, b, rounding_mode="floor"), torch.div(a, b, rounding_mode="trunc"),
                           torch.remainder(a, b), torch.fmod(a, b)), a, b, signed_zeros=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
def test_pow_float(tf, dtype):
    a = tf.rand((7, 13), dtype, low=0.1, high=3)
    b = tf.rand((7, 13), dtype, low=-2, high=2)
    n = tf.rand((7, 13), dtype, low=-3, high=3)

    def fn(a, b, n):
        return (a ** b, a ** 2, a ** 3, a ** 0.5, a ** -1, a ** -0.5, a ** 2.5, a ** 0, n ** 2, n ** 3, n ** -2, 2 ** b,
                torch.pow(1.5, b), n ** 1, torch.pow(n, torch.tensor(2.0, dtype=dtype)), n ** b.round())
    tf.check(fn, a, b, n)


@pytest.mark.parametrize("dtype", INTS)
def test_pow_int(tf, dtype):
    a = tf.rand((5, 7), dtype, low=-6, high=6)
    e = torch.randint(0, 6, (5, 7), dtype=dtype)
    tf.check(lambda a, e: (a ** e, a ** 2, a ** 3, a ** 0, 2 ** e, a ** 2.0, a ** 0.5, a.float() ** e,
                           torch.pow(a, e[0])), a, e)


def test_pow_special(tf):
    x = torch.tensor([NAN, INF, -INF, -0.0, 0.0, 1.0, -1.0, 2.0, -2.0, 0.5])
    y = torch.tensor([0.0, -1.0, 0.5, -1.0, -2.0, NAN, INF, -INF, 3.0, -0.5])
    # 3, -1, -2, 0.5, -0.5 are lowered as multiplies/reciprocal/sqrt/rsqrt (as eager's kernels do)
    tf.check(lambda x, y: (x ** y, x ** 2, x ** 0.5, x ** -1, x ** 0, torch.pow(2.0, x), x ** 3, x ** -2,
                           x ** -0.5, x ** 3.0), x, y, signed_zeros=True)


def test_type_promotion(tf):
    i32 = tf.rand((5, 7), torch.int32, low=-9, high=9)
    i64 = tf.rand((5, 7), torch.int64, low=-9, high=9)
    f16 = tf.rand((5, 7), torch.float16)
    bf = tf.rand((5, 7), torch.bfloat16)
    f32 = tf.rand((5, 7), torch.float32)
    f64 = tf.rand((7,), torch.float64)
    b = tf.rand((5, 7), torch.bool)
    s = torch.tensor(2.5, dtype=torch.float64)   # 0-d: does not promote a float tensor

    def fn(i32, i64, f16, bf, f32, f64, b, s):
        return (i32 + i64, i32 * 2.5, i32 / i32, i64 / 4, f16 + f32, f16 * bf, bf + i64, f32 + f64, f32 * s,
                i32 * s, f16 * s, b + i32, b * f16, b & (i32 > 0), i32 + True, f16 + 1e4, bf * 1e-3,
                i64 - i32 * 7, torch.true_divide(i64, 3), f16 // 0.3)
    tf.check(fn, i32, i64, f16, bf, f32, f64, b, s)


# ------------------------------------------------------------------------------------------------
# min/max, clamp, where, masked_fill
# ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", FLOATS + INTS)
def test_maximum_minimum_clamp(tf, dtype):
    a = tf.rand((7, 13), dtype, low=-9, high=9)
    b = tf.rand((13,), dtype, low=-9, high=9)
    lo = tf.rand((7, 1), dtype, low=-5, high=0)
    hi = tf.rand((13,), dtype, low=0, high=5)

    def fn(a, b, lo, hi):
        return (torch.maximum(a, b), torch.minimum(a, b), torch.clamp(a, -2, 3), torch.clamp(a, min=1),
                torch.clamp(a, max=-1), torch.clamp(a, lo, hi), torch.clamp(a, min=lo), torch.clamp(a, max=hi),
                torch.clamp(a, 3, -2), a.clamp_min(0), a.clamp_max(2), torch.max(a, b), torch.min(a.t(), lo.t()))
    tf.check(fn, a, b, lo, hi)


def test_nan_propagation_min_max(tf):
    a = torch.tensor([NAN, 1.0, NAN, -INF, INF, -0.0, 0.0, 2.0])
    b = torch.tensor([1.0, NAN, NAN, INF, -INF, 0.0, -0.0, NAN])

    def fn(a, b):
        return (torch.maximum(a, b), torch.minimum(a, b), torch.fmax(a, b), torch.fmin(a, b),
                torch.clamp(a, -1, 1), torch.clamp(a, min=b), torch.clamp(a, max=b), a.clamp_min(0.5),
                torch.clamp(b, 0.0, 0.0), F.hardtanh(a), torch.relu(a))
    tf.check(fn, a, b)
    tf.check(fn, a.half(), b.half())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.int32, torch.int64, torch.bool])
def test_where_masked_fill(tf, dtype):
    c = tf.rand((7, 13), torch.bool)
    a = tf.rand((7, 13), dtype)
    b = tf.rand((13,), dtype)
    s = tf.rand((), dtype)

    def fn(c, a, b, s):
        return (torch.where(c, a, b), torch.where(c[:1], a, s), torch.where(c, 1, a), torch.where(c, a, 0),
                torch.where(c.t(), a.t(), b[:7]), a.masked_fill(c, 1), a.masked_fill(c[0], s),
                a.masked_fill(~c, True if dtype == torch.bool else 2), torch.where(a != b, a, b),
                torch.where(c, a.float(), b.double()), torch.where(c, 2.5, -1.5))
    tf.check(fn, c, a, b, s)


def test_where_scalar_and_nan(tf):
    x = torch.tensor([[NAN, 1.0, -2.0], [INF, -0.0, 3.0]])
    tf.check(lambda x: (torch.where(x > 0, x, NAN), torch.where(torch.isnan(x), 0.0, x),
                        x.masked_fill(x.isnan(), -INF), torch.where(x < 0, -0.0, x)), x, signed_zeros=True)


# ------------------------------------------------------------------------------------------------
# comparisons, logical, bitwise, shifts
# ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", FLOATS + INTS + [torch.bool])
def test_comparisons(tf, dtype):
    a = tf.rand((7, 13), dtype, low=-3, high=3)
    b = tf.rand((13,), dtype, low=-3, high=3)
    at = tf.rand((13, 7), dtype, low=-3, high=3).t()

    def fn(a, b, at):
        out = []
        for x, y in ((a, b), (at, a), (a, 1), (a, 0.5), (a, a)):
            out += [x == y, x != y, x < y, x <= y, x > y, x >= y]
        out += [torch.eq(a, b), torch.gt(b, a), 2 <= a, 0.5 > a]
        return tuple(out)
    tf.check(fn, a, b, at)


def test_comparisons_nan_inf(tf):
    a = torch.tensor([NAN, NAN, 1.0, INF, -INF, -0.0, 2.0])
    b = torch.tensor([NAN, 1.0, NAN, INF, INF, 0.0, 2.0])
    tf.check(lambda a, b: (a == b, a != b, a < b, a <= b, a > b, a >= b, a == NAN, a != NAN,
                           torch.eq(a.half(), b.half()), a.bfloat16() < b.bfloat16()), a, b)


@pytest.mark.parametrize("dtype", [torch.float32, torch.int32, torch.int64, torch.bool, torch.float16])
def test_logical_ops(tf, dtype):
    a = tf.rand((7, 13), dtype, low=-2, high=2, nonzero=False)   # zeros matter for logical ops
    b = tf.rand((13,), dtype, low=-2, high=2, nonzero=False)
    tf.check(lambda a, b: (torch.logical_and(a, b), torch.logical_or(a, b), torch.logical_xor(a, b),
                           torch.logical_not(a), torch.logical_not(b.float()), torch.logical_and(a, b.bool()),
                           torch.logical_xor(a, b.double()), torch.logical_or(a.t(), b[:7])), a, b)


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64, torch.bool])
def test_bitwise_ops(tf, dtype):
    lo, hi = (-1000, 1000) if dtype != torch.bool else (0, 1)
    a = tf.rand((7, 13), dtype, low=lo, high=hi)
    b = tf.rand((13,), dtype, low=lo, high=hi)

    def fn(a, b):
        out = [a & b, a | b, a ^ b, ~a, torch.bitwise_and(a, b), torch.bitwise_or(a.t(), b[:7]),
               torch.bitwise_xor(a, True if dtype == torch.bool else 5), torch.bitwise_not(b)]
        if dtype != torch.bool:
            out += [a & 0xFF, a | -16, a ^ -1]
        return tuple(out)
    tf.check(fn, a, b)


@pytest.mark.parametrize("dtype", INTS)
def test_shifts(tf, dtype):
    a = tf.rand((7, 13), dtype, low=-10000, high=10000)
    s = torch.randint(0, 12, (7, 13), dtype=dtype)
    big = torch.tensor([1, -1, 2 ** 20, -(2 ** 20), 12345], dtype=dtype)
    sb = torch.tensor([0, 3, 10, 5, 1], dtype=dtype)
    tf.check(lambda a, s, big, sb: (a << s, a >> s, a << 3, a >> 2, torch.bitwise_left_shift(a, s[0]),
                                    torch.bitwise_right_shift(big, sb), big << sb, big >> 31 if dtype == torch.int32
                                    else big >> 63), a, s, big, sb)


# ------------------------------------------------------------------------------------------------
# casts
# ------------------------------------------------------------------------------------------------

ALL_DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int32, torch.int64, torch.int16,
              torch.int8, torch.uint8, torch.bool]


@pytest.mark.parametrize("src", [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int32,
                                 torch.int64, torch.bool])
def test_casts_all_pairs(tf, src):
    """`.to` from `src` to every dtype; values in range of every target (0..100 and negatives for
    signed targets), fractions so that float -> int truncation toward zero is visible."""
    if src == torch.bool:
        x = tf.rand((7, 13), torch.bool)
        xn = x
    elif src.is_floating_point:
        x = tf.rand((7, 13), src, low=0.0, high=100.0)        # non-negative: uint8 target
        xn = tf.rand((13, 7), src, low=-100.0, high=100.0).t()
    else:
        x = tf.rand((7, 13), src, low=1, high=100)
        xn = tf.rand((13, 7), src, low=-100, high=100).t()
    signed = [d for d in ALL_DTYPES if d != torch.uint8]

    def fn(x, xn):
        return tuple(x.to(d) for d in ALL_DTYPES) + tuple(xn.to(d) for d in signed) + \
            tuple((xn.to(d) * 2).to(src) for d in (torch.float32, torch.int64) if src != torch.bool)
    tf.check(fn, x, xn)


def test_cast_rounding_and_wrap(tf):
    """fp32 -> fp16/bf16 rounds to nearest even; overflow to inf; int64 -> int32 wraps."""
    f = torch.tensor([1.0 + 2 ** -11, 1.0 + 3 * 2 ** -11, 65519.0, 65520.0, 1e6, -1e6, 3.0e-5, 1e-8,
                      1.0 + 2 ** -8, 1.0 + 3 * 2 ** -8, 3.4e38, -0.0])
    i = torch.tensor([2 ** 31 + 5, -(2 ** 31) - 5, 2 ** 40 + 7, 300, -129], dtype=torch.int64)
    d = torch.tensor([2.0 ** 60, -2.0 ** 60, 1.5, -1.5, 2.0 ** 31 - 0.5], dtype=torch.float64)
    tf.check(lambda f, i, d: (f.half(), f.bfloat16(), f.double().half(), f.double().bfloat16(), i.int(), i.short(),
                              i.to(torch.int8), i.float(), i.double(), i.half(), d.float(), d.long(),
                              f.half().bfloat16()), f, i, d, signed_zeros=True)


# ------------------------------------------------------------------------------------------------
# lerp, addcmul, addcdiv
# ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
def test_lerp_addcmul_addcdiv(tf, dtype):
    a = tf.rand((7, 13), dtype)
    b = tf.rand((13,), dtype)
    w = tf.rand((7, 1), dtype, low=0, high=1)
    c = tf.rand((7, 13), dtype, low=0.5, high=2)
    tf.check(lambda a, b, w, c: (torch.lerp(a, b, 0.3), torch.lerp(a, b, 0.8), torch.lerp(a, b, w),
                                 torch.lerp(a.t(), b[:7], 1.5), torch.addcmul(a, b, c), torch.addcmul(a, b, c,
                                 value=-0.5),
                                 torch.addcdiv(a, b, c), torch.addcdiv(a, b, c, value=2.0)), a, b, w, c)


def test_misc_binary_math(tf):
    a, b = tf.rand((7, 13)), tf.rand((7, 13))
    tf.check(lambda a, b: (torch.atan2(a, b), torch.copysign(a, b), torch.hypot(a, b), torch.logaddexp(a, b),
                           torch.xlogy(a.abs(), b.abs()), torch.copysign(a, -0.0), torch.copysign(a, 1.0),
                           torch.nextafter(a, b), torch.square(a - b), torch.logit(torch.sigmoid(a)),
                           torch.copysign(a.half(), b.half())), a, b)


def test_copysign_signed_zero(tf):
    a = torch.tensor([1.0, -1.0, 0.0, -0.0, NAN, INF, 2.0, -3.0])
    b = torch.tensor([-0.0, 0.0, -1.0, 1.0, -1.0, -0.0, NAN, -INF])
    tf.check(lambda a, b: (torch.copysign(a, b), torch.copysign(b, a), a.neg(), b.abs(), -b,
                           torch.copysign(a, -1)), a, b, signed_zeros=True)


# ------------------------------------------------------------------------------------------------
# constructors, triu/tril
# ------------------------------------------------------------------------------------------------

def test_constructors(tf):
    x = tf.rand((5, 7))

    def fn(x):
        return (torch.full((3, 4), 2.5), torch.full((3, 4), 7, dtype=torch.int32), torch.zeros(2, 5),
                torch.ones(5, dtype=torch.int64), torch.ones(3, 2, dtype=torch.bool), torch.zeros(0, 3),
                torch.full((), -1.5), torch.full_like(x, 3.0), torch.zeros_like(x, dtype=torch.int32),
                torch.ones_like(x) * x, x.new_full((2, 3), -4), x.new_zeros(4), x.new_ones(2, 2),
                torch.full((2, 2), NAN), torch.full((2,), -INF, dtype=torch.float16),
                torch.full((3,), True), torch.scalar_tensor(3.5), torch.empty(3, 0))
    tf.check(fn, x)


def test_arange(tf):
    x = tf.rand((7,))

    def fn(x):
        return (torch.arange(7), torch.arange(2, 9), torch.arange(1, 20, 3), torch.arange(10, -3, -2),
                torch.arange(0.0, 1.0, 0.1), torch.arange(-1.5, 2.5, 0.5, dtype=torch.float64),
                torch.arange(5, dtype=torch.float16), torch.arange(7, dtype=torch.int32) * 3,
                torch.arange(0, 30, 7, dtype=torch.bfloat16), x + torch.arange(7), torch.arange(0),
                torch.arange(3.0, 0.0, -0.7), torch.linspace(0, 1, 5))
    tf.check(fn, x, allow_fallbacks={"aten.linspace.default"})


@pytest.mark.parametrize("dtype", [torch.float32, torch.int64, torch.bool])
def test_triu_tril(tf, dtype):
    a = tf.rand((6, 9), dtype)
    b = tf.rand((2, 5, 4), dtype)
    tf.check(lambda a, b: (a.triu(), a.tril(), a.triu(2), a.tril(-1), a.triu(-3), a.tril(5), a.t().triu(1),
                           b.triu(), b.tril(1), a.triu(20), a.tril(-20), a[::2, 1:].tril()), a, b)


def test_triu_tril_nan_preserved(tf):
    """triu keeps NaN in the kept triangle and writes zeros (not NaN * 0) elsewhere."""
    a = torch.full((4, 4), NAN)
    a[1, 2] = INF
    tf.check(lambda a: (a.triu(), a.tril(-1)), a)


# ------------------------------------------------------------------------------------------------
# shapes: broadcasting, size-1, 0-d, empty, chains
# ------------------------------------------------------------------------------------------------

def test_broadcast_shapes(tf):
    a = tf.rand((3, 1, 11))
    b = tf.rand((5, 1))
    c = tf.rand(())
    d = tf.rand((1, 1, 1))
    e = tf.rand((3, 0, 11))
    tf.check(lambda a, b, c, d, e: (a + b, a * c, b - d, a * b * c * d, e + a, (a + b).exp() * c, c + d, c * c,
                                    e.sum(1) + a[:, 0]), a, b, c, d, e)


def test_scalar_only_graph(tf):
    c = tf.rand(())
    i = tf.rand((), torch.int64)
    tf.check(lambda c, i: (c * 2 + 1, c.exp(), i + 3, i * c, (c > 0).float(), c.half() * 3), c, i)


def test_long_chain_odd_3d(tf):
    x = tf.rand((3, 5, 11))
    y = tf.rand((11, 5, 3)).permute(2, 1, 0)

    def fn(x, y):
        z = x * y + 1
        z = torch.sigmoid(z) * torch.tanh(x) - y.abs().sqrt()
        z = torch.where(z > 0, z, z * 0.01)
        return z.exp().log1p() / (1 + y * y), z.clamp(-0.1, 0.1)
    tf.check(fn, x, y)


def test_inplace_ops_functionalized(tf):
    x = tf.rand((7, 13))

    def fn(x):
        y = x.clone()
        y.mul_(2).add_(1)
        y[:, 0].zero_()
        y.clamp_(min=-1.0)
        y[2:5] += 10
        return y
    tf.check(fn, x)


def test_input_mutation(tf):
    x = tf.rand((7, 13))
    x_ref = x.clone()

    def fn(x):
        x.mul_(3)
        return x + 1
    e = tf.explain(fn, x)
    expected = fn(x_ref)
    tf.assert_same(e.output, expected)
    tf.assert_same(x, x_ref)
    assert len(e.kernels) >= 1


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_low_precision_scalar_operands(tf, dtype):
    """Eager converts scalars (and 0-d / integer tensors) to fp16/bf16 before comparing them or
    taking remainders: h == 0.1 is true for h = fp16(0.1), and remainder(h, 0.1) divides by fp16(0.1)."""
    h = torch.tensor([0.1, 0.2, 0.3, 1 / 3, 2.1, 100.1, 2048, 9.0, -7.3, 0.7], dtype=dtype)
    i = torch.tensor([1, 2049, 3, 300, 257, -5, 7, 8, 9, 10])
    r = tf.rand((7, 13), dtype, low=-10, high=10)

    def fn(h, i, r):
        return (h < 0.1, h == 0.1, h <= 0.2, h > 1 / 3, h != 2.1, h >= 100.1, h == 2049, h == torch.tensor(0.1),
                h < torch.tensor(1 / 3, dtype=torch.float64), h == i, h > i, torch.eq(h, 0.3), torch.remainder(h, 0.1),
                torch.fmod(h, 0.3), torch.remainder(h, torch.tensor(0.7)), torch.atan2(h, torch.tensor(0.1)),
                torch.where(h == 0.7, 1.0, 0.0), r > 0.1, torch.remainder(r, 0.3), torch.fmod(r.t(), 0.7), r * 0.1,
                r + 0.1, r / 0.3, torch.div(r, 0.3, rounding_mode="floor"))
    tf.check(fn, h, i, r)


def test_int_inputs_to_float_math(tf):
    i = tf.rand((5, 7), torch.int64, low=1, high=9)
    i32 = tf.rand((7,), torch.int32, low=-9, high=9)
    b = tf.rand((5, 7), torch.bool)
    tf.check(lambda i, i32, b: (i.exp(), i.sqrt(), torch.sigmoid(i), i.log(), i32.sin(), torch.erf(i32), i / 2,
                                1 / i, torch.tanh(b), b.float().exp(), torch.sqrt(b), i32.rsqrt(), i.signbit(),
                                i32.abs(), i32.neg(), i32.sign(), torch.atan2(i, i32)), i, i32, b)


def test_pow_int_negative_exponents(tf):
    a = torch.tensor([1, -1, 2, -2, 3, 5, 1, -1, 7])
    e = torch.tensor([-1, -1, -1, -2, -3, 2, -5, -4, 0])
    tf.check(lambda a, e: (a ** e, torch.pow(a, e), torch.pow(a.int(), e.int()), torch.pow(2, e.abs())), a, e)


def test_more_activations_and_losses(tf):
    x, y = tf.rand((6, 8)), tf.rand((6, 8))
    w = torch.tensor([0.25])
    wc = tf.rand((8,))

    def fn(x, y, w, wc):
        return (F.prelu(x, w), F.prelu(x, wc), F.celu(x, 0.5), torch.logit(torch.sigmoid(x), eps=1e-3), F.softsign(x),
                F.tanhshrink(x), F.softshrink(x), F.hardshrink(x, 0.7), F.glu(x, -1), F.mse_loss(x, y),
                F.mse_loss(x, y, reduction="none"), F.l1_loss(x, y), F.smooth_l1_loss(x, y), F.huber_loss(x, y,
                delta=0.5),
                F.binary_cross_entropy(torch.sigmoid(x), torch.sigmoid(y)),
                F.binary_cross_entropy_with_logits(x, torch.sigmoid(y)), torch.xlogy(x.abs(), y.abs()))
    tf.check(fn, x, y, w, wc, atol=1e-5, rtol=1e-4)


def test_batch_norm_inference(tf):
    x = tf.rand((4, 3, 5, 5))
    rm, rv, w, b = tf.rand((3,)), tf.rand((3,), low=0.5, high=2), tf.rand((3,)), tf.rand((3,))

    def fn(x, rm, rv, w, b):
        return (F.batch_norm(x, rm, rv, w, b, training=False, eps=1e-3), F.batch_norm(x[:, :, 0], rm, rv,
        training=False),
                F.batch_norm(x[:, :, 0, 0], rm, rv, w, None, training=False),
                F.batch_norm(x.half(), rm, rv, w, b, training=False), F.relu(F.batch_norm(x, rm, rv, w, b,
                training=False)))
    tf.check(fn, x, rm, rv, w, b)


def test_pointwise_backward(tf):
    """Backward graphs of activations (threshold/sigmoid/tanh backward, gelu/silu/... decompositions)."""
    x = tf.rand((7, 13), low=-4, high=4).requires_grad_()
    y = tf.rand((13,)).requires_grad_()

    def fn(x, y):
        return (torch.relu(x) * y, torch.sigmoid(x), torch.tanh(x * y), F.gelu(x), F.gelu(x, approximate="tanh"),
                F.silu(x), F.mish(x), F.elu(x), F.leaky_relu(x, 0.2), F.hardswish(x), F.hardsigmoid(x),
                F.softplus(x), F.hardtanh(x), torch.where(x > 0, x * y, x.exp()), x.clamp(-1, 1) / y, x.pow(3), x.abs(),
                torch.lerp(x, y, 0.3), x.log_softmax(-1))
    tf.check_grad(fn, x, y, atol=1e-4, rtol=1e-4)


def test_float32_transcendentals_wide_range(tf):
    """exp/log/tanh/sigmoid/erf over their whole float32 range (overflow, underflow to subnormals,
    subnormal inputs, the polynomial/asymptotic switch points, NaN, +-inf, signed zeros)."""
    special = torch.tensor([-0.0, 0.0, 1e-30, -1e-30, 1e-45, -1e-45, 0.625, -0.625, 0.6249999, 1.0, -1.0,
                            0.9999999, 88.7, 89.0, -103.9, -104.0, NAN, INF, -INF])
    x = torch.cat([torch.linspace(-110, 100, 4001), tf.rand((3000,), low=-6, high=6), special])
    pos = torch.cat([torch.logspace(-45, 38, 4000), tf.rand((3000,), low=0, high=10),
                     torch.tensor([1e-45, 1.17549435e-38, 1.1754942e-38, 3.4e38, 0.0, -0.0, 1.0, 2.0, 0.5, 0.70710677,
                                   0.7071068, 1.0000001, 0.99999994, -1.0, NAN, INF, -INF])])

    tf.check(lambda x, pos: (x.exp(), x.tanh(), x.sigmoid(), torch.erf(x), pos.log()), x, pos, signed_zeros=True)
    # eager's GELU of +-inf is NaN in its AVX-512 loop and +-inf in its AVX2 one: not compared
    finite = torch.where(x.isinf(), 0.0, x)
    tf.check(lambda x, finite: (F.gelu(finite), F.silu(x), F.softplus(x), torch.logsumexp(x[:4001], 0)), x, finite)


def test_float32_erf_within_3_ulp(tf):
    """erf (C++: an odd polynomial below 1, another polynomial in |x| - 2.5 up to 3.919206, then
    1) within 3 ulp of the fp64 result everywhere, at the switch points and the signs kept."""
    special = torch.tensor([0.99999994, 1.0, 1.0000001, 2.5, 3.9192059, 3.919206, 3.9192061, 4.0, 6.0, 1e30])
    x = torch.cat([torch.linspace(-5, 5, 40001), special, -special])
    e = tf.check(lambda x: torch.erf(x), x, kernels=1)
    ref = torch.erf(x.double())
    ulp = (ref.float().abs().nextafter(torch.tensor(2.0)) - ref.float().abs()).double()
    err = ((e.output.double() - ref).abs() / ulp).max().item()
    assert err <= 3, err


def test_exp_flushes_results_below_float_min_to_zero():
    """A softmax over an attention mask of -100 (Swin's shifted windows): exp's results below
    FLT_MIN are +0, not subnormals, which slow every op that reads them ~100x on x86 (as
    ATen's exp_u20 does).  Every other value matches eager."""
    x = torch.randn(8, 2, 16, 16)
    mask = torch.where(torch.rand(16, 16) < 0.5, -100.0, 0.0)
    fn = lambda x, mask: (torch.softmax(x + mask, -1), (x - 95).exp(), (x * 3 - 80).exp())  # noqa: E731
    out = torchfuse.compile(fn)(x, mask)
    for got, want in zip(out, fn(x, mask)):
        torch.testing.assert_close(got, want, atol=1.2e-38, rtol=2e-5)
        tiny = (got != 0) & (got.abs() < torch.finfo(torch.float32).tiny)
        assert not tiny.any(), got[tiny]
    assert (fn(x, mask)[1] != 0).any()       # eager's results there are subnormal: the test can fail


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_float8_runs_through_aten_around_fused_kernels(dtype):
    """float8 has no kernel code: the ops touching it (casts in and out, views) run through ATen,
    bit for bit as eager, and the float32 work between them is still one fused kernel."""
    def fn(x, s):
        return (x.to(torch.float32) * s).relu().add(0.5).to(dtype).view(4, 32).t()

    x = (torch.randn(8, 16) * 3).to(dtype)
    e = torchfuse.explain(fn, x, 2.0)
    assert e.output.dtype == dtype and torch.equal(e.output.view(torch.uint8), fn(x, 2.0).view(torch.uint8))
    assert len(e.kernels) == 1, str(e)
    assert all("float8" in f.reason for f in e.fallbacks), [f.reason for f in e.fallbacks]
