"""C++/OpenMP code generation: one translation unit per graph, one function per kernel.

The outer loop is `omp parallel for`; the innermost loop carries `omp simd` so g++ vectorizes
it.  fp16/bf16 are stored as uint16 and computed in float.  Sizes that Dynamo made symbolic are
function arguments, so a new batch size runs the same compiled library.  No -ffast-math: NaN,
inf and signed zeros behave as in eager.
"""
from __future__ import annotations

import math
from typing import Iterable

import torch

from ...ir.nodes import INDEX, Node, free_syms, loads, to_text, walk
from ...scheduler.loops import LoopPlan, Stage, rows_contiguous, step_of
from ...codegen.checks import check_sites, unchecked_index
from ...codegen.common import ExprEmitter
from .checks import CHECKS, emit_prechecks
from .common import CTYPE, STORAGE, _emit_loops, _store_expr
from .rowcache import RowCache

PRELUDE = r"""
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <omp.h>

static inline float tf_bf16_to_float(uint16_t v) { uint32_t b = (uint32_t)v << 16; float f; std::memcpy(&f, &b, 4); return f; }
static inline uint16_t tf_float_to_bf16(float f) {
  uint32_t b; std::memcpy(&b, &f, 4);
  if ((b & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((b >> 16) | 0x40);   // quiet NaN
  b += 0x7fffu + ((b >> 16) & 1u);                                                // round to nearest even
  return (uint16_t)(b >> 16);
}
static inline float tf_half_to_float(uint16_t h) {
  uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exp = (h >> 10) & 0x1fu, man = h & 0x3ffu, b;
  if (exp == 0) {
    if (man == 0) b = sign;
    else { int e = -1; do { e++; man <<= 1; } while (!(man & 0x400u)); b = sign | ((uint32_t)(112 - e) << 23) | ((man & 0x3ffu) << 13); }
  } else if (exp == 31) b = sign | 0x7f800000u | (man << 13);
  else b = sign | ((exp + 112) << 23) | (man << 13);
  float f; std::memcpy(&f, &b, 4); return f;
}
static inline uint16_t tf_float_to_half(float f) {
  uint32_t b; std::memcpy(&b, &f, 4);
  uint32_t sign = (b >> 16) & 0x8000u; uint32_t a = b & 0x7fffffffu;
  if (a > 0x7f800000u) return (uint16_t)(sign | 0x7e00u);
  if (a >= 0x477ff000u) return (uint16_t)(sign | 0x7c00u);                // overflow -> inf
  if (a < 0x38800000u) {                                                     // subnormal or zero
    float af; std::memcpy(&af, &a, 4);
    return (uint16_t)(sign | (uint32_t)std::nearbyint(af * 16777216.0f));
  }
  uint32_t r = a + 0xc8000fffu + ((a >> 13) & 1u);                           // rebias and round to even
  return (uint16_t)(sign | (r >> 13));
}
static inline float tf_round_half(float f) { return tf_half_to_float(tf_float_to_half(f)); }
static inline float tf_round_bf16(float f) { return tf_bf16_to_float(tf_float_to_bf16(f)); }

template <typename T> static inline T tf_max(T a, T b) { if constexpr (std::is_floating_point<T>::value) { if (a != a) return a; if (b != b) return b; } return a > b ? a : b; }
template <typename T> static inline T tf_min(T a, T b) { if constexpr (std::is_floating_point<T>::value) { if (a != a) return a; if (b != b) return b; } return a < b ? a : b; }
// std::signbit on a float just reinterpreted from bf16 bits makes GCC 12's vectorizer crash (ICE in
// extract_insn); copysign + compare gives the same bit (-0.0 and -NaN included) and vectorizes.
template <typename T> static inline bool tf_signbit(T a) {
  if constexpr (std::is_floating_point<T>::value) return std::copysign(T(1), a) < T(0); else return a < T(0);
}
template <typename T> static inline T tf_sign(T a) { return (T)((T(0) < a) - (a < T(0))); }   // sign(NaN) = 0, as eager
template <typename T> static inline T tf_floordiv(T a, T b) {
  if constexpr (std::is_floating_point<T>::value) {
    if (b == 0) return a / b;
    T m = std::fmod(a, b); T d = (a - m) / b;
    if (m != 0 && ((b < 0) != (m < 0))) d -= 1;
    if (d == 0) return std::copysign(T(0), a / b);
    T f = std::floor(d); if (d - f > T(0.5)) f += 1; return f;
  } else {
    // (a zero divisor is reported by the kernel's check, tf_div_check; -1 wraps INT_MIN as eager
    // does: the hardware division traps on it)
    if (b == 0) return 0;
    if (b == -1) return (T)(0 - (typename std::make_unsigned<T>::type)a);
    T q = a / b; if ((a % b != 0) && ((a < 0) != (b < 0))) q -= 1; return q;
  }
}
template <typename T> static inline T tf_remainder(T a, T b) {
  if constexpr (std::is_floating_point<T>::value) { T m = std::fmod(a, b); if (m != 0 && ((b < 0) != (m < 0))) m += b; return m; }
  else { if (b == 0 || b == -1) return 0; T m = a % b; if (m != 0 && ((b < 0) != (m < 0))) m += b; return m; }
}
template <typename T> static inline T tf_fmod(T a, T b) {
  if constexpr (std::is_floating_point<T>::value) return std::fmod(a, b); else return (b == 0 || b == -1) ? 0 : a % b;
}
template <typename T> static inline T tf_truncdiv(T a, T b) {
  if constexpr (std::is_floating_point<T>::value) return std::trunc(a / b);
  else return b == 0 ? 0 : (b == -1 ? (T)(0 - (typename std::make_unsigned<T>::type)a) : a / b);
}

template <typename T> static inline T tf_pow(T a, T b) {
  if constexpr (std::is_floating_point<T>::value) return std::pow(a, b);
  else { if (b < 0) return a == 1 ? 1 : (a == -1 ? ((b & 1) ? -1 : 1) : 0); T r = 1; while (b) { if (b & 1) r *= a; a *= a; b >>= 1; } return r; }
}
template <typename T> static inline T tf_lshift(T a, T b) { return (b < 0 || b >= (T)(sizeof(T) * 8)) ? 0 : (T)((typename std::make_unsigned<T>::type)a << b); }
template <typename T> static inline T tf_rshift(T a, T b) { return (b < 0 || b >= (T)(sizeof(T) * 8)) ? (a < 0 ? -1 : 0) : (T)(a >> b); }
// A scatter's read-modify-write of one element, safe against other threads updating it (a
// compare-and-swap loop: also for fp16/bf16 storage, prod, max and min, which have no atomic op)
template <typename S, typename F> static inline void tf_atomic_update(S* p, F f) {
  S old; __atomic_load(p, &old, __ATOMIC_RELAXED);
  S want;
  do { want = f(old); } while (!__atomic_compare_exchange(p, &old, &want, true, __ATOMIC_RELAXED, __ATOMIC_RELAXED));
}
static inline float tf_sigmoid(float x) { return 1.0f / (1.0f + std::exp(-x)); }
static inline double tf_sigmoid(double x) { return 1.0 / (1.0 + std::exp(-x)); }

// Branch-free float32 exp/log/tanh/erf that g++ vectorizes inside `omp simd` loops (std::expf
// stays a scalar call without -ffast-math).  Cephes-style range reduction and polynomials,
// within ~2 ulp; NaN, +-inf, overflow and subnormal inputs behave like the C library's.  exp's
// results below FLT_MIN are flushed to +0 (as ATen's exp_u20, which Inductor's softmax uses):
// on x86 every op reading a subnormal takes a ~100-cycle microcode assist, and a softmax over
// an attention mask of -100 (Swin's shifted windows) made mostly subnormals, running 10x slower.
static inline float tf_ldexp2(float p, int32_t n) {
  // p * 2^n, split in two so that 2^n over/underflowing a float exponent still rounds right
  int32_t h = n >> 1;
  float s1 = __builtin_bit_cast(float, (h + 127) << 23), s2 = __builtin_bit_cast(float, (n - h + 127) << 23);
  return p * s1 * s2;
}
static inline float tf_expf(float x) {
  float xc = x < -104.0f ? -104.0f : x;              // (std::fmin/fmax would block vectorization)
  xc = xc > 89.0f ? 89.0f : xc;
  float n = std::nearbyint(xc * 1.44269504088896341f);
  float r = xc - n * 0.693359375f;
  r = r + n * 2.12194440e-4f;
  float p = 1.9875691500E-4f;
  p = p * r + 1.3981999507E-3f; p = p * r + 8.3334519073E-3f; p = p * r + 4.1665795894E-2f;
  p = p * r + 1.6666665459E-1f; p = p * r + 5.0000001201E-1f;
  p = p * r * r + r + 1.0f;
  float y = tf_ldexp2(p, static_cast<int32_t>(n));
  y = x < -87.336544751f ? 0.0f : y;                 // ln(FLT_MIN): no subnormal results
  return x != x ? x : y;
}
static inline float tf_logf(float x) {
  bool sub = x < 1.17549435e-38f;
  float xs = sub ? x * 8388608.0f : x;                       // scale subnormals into range
  int32_t bits = __builtin_bit_cast(int32_t, xs);
  float e = static_cast<float>(((bits >> 23) & 0xff) - 126) - (sub ? 23.0f : 0.0f);
  float m = __builtin_bit_cast(float, (bits & 0x807fffff) | 0x3f000000);   // mantissa in [0.5, 1)
  bool lo = m < 0.707106781186547524f;
  e = lo ? e - 1.0f : e;
  m = lo ? m + m - 1.0f : m - 1.0f;
  float z = m * m;
  float y = 7.0376836292E-2f;
  y = y * m - 1.1514610310E-1f; y = y * m + 1.1676998740E-1f; y = y * m - 1.2420140846E-1f;
  y = y * m + 1.4249322787E-1f; y = y * m - 1.6668057665E-1f; y = y * m + 2.0000714765E-1f;
  y = y * m - 2.4999993993E-1f; y = y * m + 3.3333331174E-1f;
  y = y * m * z;
  y = y - 2.12194440e-4f * e;
  y = y - 0.5f * z;
  float r = m + y + 0.693359375f * e;
  r = x == std::numeric_limits<float>::infinity() ? x : r;
  r = x == 0.0f ? -std::numeric_limits<float>::infinity() : r;
  return (x < 0.0f || x != x) ? std::numeric_limits<float>::quiet_NaN() : r;
}
static inline float tf_tanhf(float x) {
  float a = std::fabs(x);
  float z = x * x;
  float small = -5.70498872745E-3f;
  small = small * z + 2.06390887954E-2f; small = small * z - 5.37397155531E-2f;
  small = small * z + 1.33314422036E-1f; small = small * z - 3.33332819422E-1f;
  small = small * z * x + x;
  float big = 1.0f - 2.0f / (tf_expf(2.0f * (a < 10.0f ? a : 10.0f)) + 1.0f);
  big = std::copysign(big, x);
  return a < 0.625f ? std::copysign(small, x) : (x != x ? x : big);   // copysign: tanh(-0.0) = -0.0
}
static inline float tf_sigmoidf(float x) { return 1.0f / (1.0f + tf_expf(-x)); }
// expm1 without a libm call, so the loop vectorizes (an ELU's scalar std::expm1 took 16 of a GAT
// layer's 36 ms): exp(x) - 1 outside (-1, 1.5) (the cancellation costs under an ulp there), and
// inside its series to x^13 (truncated below 1e-8 relative), as x * (1 + x * p) so that
// -0 stays -0 and a subnormal x returns x.  Both run in every lane; a select picks one.
static inline float tf_expm1f(float x) {
  float p = 1.6059043836e-10f;
  p = p * x + 2.0876756988e-9f; p = p * x + 2.5052108385e-8f; p = p * x + 2.7557319224e-7f; p = p * x + 2.7557319224e-6f; p = p * x + 2.4801587302e-5f;
  p = p * x + 1.9841269841e-4f; p = p * x + 1.3888888889e-3f; p = p * x + 8.3333333333e-3f;
  p = p * x + 4.1666666667e-2f; p = p * x + 1.6666666667e-1f; p = p * x + 0.5f;
  float small = x * (1.0f + x * p);
  float big = tf_expf(x) - 1.0f;
  return x > -1.0f && x < 1.5f ? small : big;      // (NaN: big, which is NaN)
}
// erf: an odd polynomial below 1, a degree-12 one in |x| - 2.5 up to 3.919206 (fit on [1, 4], 1.3
// ulp), then 1 (where erf rounds to 1); NaN goes through.  Abramowitz-Stegun's division and exp
// (1 - poly(t) t exp(-x^2), t = 1 / (1 + p|x|)) cost a GELU 1.5x the time, at up to 3 ulp.
static inline float tf_erff(float x) {
  float a = std::fabs(x);
  float z = x * x;
  float small = 7.853861353153693E-5f;
  small = small * z - 8.010193625184903E-4f; small = small * z + 5.188327685732524E-3f;
  small = small * z - 2.685381193529856E-2f; small = small * z + 1.128358514861418E-1f;
  small = small * z - 3.761262582423300E-1f; small = small * z + 1.128379165726710E0f;
  small = small * x;
  float u = a - 2.5f;
  float p = -8.70944041e-06f;
  p = p * u + 2.14060092e-05f; p = p * u + 5.9413811e-05f; p = p * u - 0.000280871929f;
  p = p * u + 0.000291999429f; p = p * u + 0.000574202684f; p = p * u - 0.00282375421f;
  p = p * u + 0.00610002549f; p = p * u - 0.0086127799f; p = p * u + 0.00835432485f;
  p = p * u - 0.00544707011f; p = p * u + 0.00217797933f; p = p * u + 0.999593079f;
  p = p > 1.0f ? 1.0f : p;
  p = a > 3.919206f ? 1.0f : p;
  return a < 1.0f ? small : std::copysign(p, x);
}

// float32 sin/cos that g++ vectorizes (AVX2 and AVX-512), within 0.53 ulp of the true value
// over the whole float range: |x| is reduced to r in [-pi/4, pi/4] in double, by Cody-Waite below
// 2^20 and by a Payne-Hanek product with 96 bits of 4/pi above (the 62-bit fixed-point step
// follows ARM optimized-routines' sinf); both reductions run in every lane and a select picks
// one, so there is no branch.  Rotary embeddings evaluate these once per element of q and k: the
// scalar libm call was 3-4x slower and kept the whole loop from vectorizing.
static inline double tf_reduce_pio2(float ax, int32_t &quadrant) {   // ax = |x| = r + quadrant * pi/2
  double d = static_cast<double>(ax);
  double n = std::nearbyint(d * 0.63661977236758134308);
  // pi/2's high part has 33 bits, so n * high is exact for n < 2^20
  double r_small = (d - n * 1.57079632673412561417e+00) - n * 6.07710050650619224932e-11;
  uint32_t xi = __builtin_bit_cast(uint32_t, ax);
  uint32_t m = ((xi & 0xffffffu) | 0x800000u) << ((xi >> 23) & 7u);
  // The 96 bits of 4/pi this exponent needs: bits [8k + 8, 8k + 104) of the words (0, 4/pi),
  // k = exponent bits 3-6.  Picked by and-or blends and 32-bit shifts: a table (or a select
  // chain, which g++ turns into one) is a gather, and g++ emits no gather under a mask, which
  // it needs once the caller's select discards some elements (cat, rotate_half).
  uint32_t s = (((xi >> 26) & 15u) << 3) + 8u;
  uint32_t j = s >> 5, o = s & 31u;
  const uint32_t w0 = 0u, w1 = 0xa2f9836eu, w2 = 0x4e441529u, w3 = 0xfc2757d1u, w4 = 0xf534ddc0u,
                 w5 = 0xdb629599u, w6 = 0x3c439041u, w7 = 0u;
  uint32_t e0 = 0u - (j == 0), e1 = 0u - (j == 1), e2 = 0u - (j == 2), e3 = 0u - (j == 3), e4 = 0u - (j == 4);
  uint32_t p0 = (w0 & e0) | (w1 & e1) | (w2 & e2) | (w3 & e3) | (w4 & e4);
  uint32_t p1 = (w1 & e0) | (w2 & e1) | (w3 & e2) | (w4 & e3) | (w5 & e4);
  uint32_t p2 = (w2 & e0) | (w3 & e1) | (w4 & e2) | (w5 & e3) | (w6 & e4);
  uint32_t p3 = (w3 & e0) | (w4 & e1) | (w5 & e2) | (w6 & e3) | (w7 & e4);
  uint32_t t0 = (p0 << o) | ((p1 >> 1) >> (31u - o));
  uint32_t t1 = (p1 << o) | ((p2 >> 1) >> (31u - o));
  uint32_t t2 = (p2 << o) | ((p3 >> 1) >> (31u - o));
  uint64_t r0 = static_cast<uint32_t>(m * t0);
  uint64_t r1 = static_cast<uint64_t>(m) * t1;
  uint64_t r2 = static_cast<uint64_t>(m) * t2;
  uint64_t f = ((r2 >> 32) | (r0 << 32)) + r1;     // |x| * 2/pi mod 4, 62 fraction bits
  uint64_t n_large = (f + (1ull << 61)) >> 62;
  f -= n_large << 62;
  // the signed fraction through two int32 halves: AVX2 has no int64 -> double conversion
  double fd = static_cast<double>(static_cast<int32_t>(f >> 32)) * 4294967296.0
            + static_cast<double>(static_cast<int32_t>(static_cast<uint32_t>(f) >> 1)) * 2.0;
  bool small = ax < 1048576.0f;
  quadrant = small ? static_cast<int32_t>(n) : static_cast<int32_t>(n_large);
  return small ? r_small : fd * 3.4061215800865545e-19;   // pi * 2^-63
}
static inline double tf_sin_poly(double r) {   // Taylor to r^9: below 3e-9 relative on [-pi/4, pi/4]
  double z = r * r;
  double p = 2.7557319223985893e-06;
  p = p * z - 1.9841269841269841e-04; p = p * z + 8.3333333333333333e-03; p = p * z - 1.6666666666666667e-01;
  return r + r * z * p;
}
static inline double tf_cos_poly(double r) {
  double z = r * r;
  double p = -2.7557319223985888e-07;
  p = p * z + 2.4801587301587302e-05; p = p * z - 1.3888888888888889e-03; p = p * z + 4.1666666666666667e-02;
  return 1.0 + z * (p * z - 0.5);
}
static inline float tf_sinf(float x) {
  int32_t q;
  double r = tf_reduce_pio2(std::fabs(x), q);
  double v = (q & 1) ? tf_cos_poly(r) : tf_sin_poly(r);
  float y = static_cast<float>((q & 2) ? -v : v);
  y = std::signbit(x) ? -y : y;                               // sin is odd; keeps sin(-0) = -0
  return x - x != 0.0f ? std::numeric_limits<float>::quiet_NaN() : y;   // +-inf, NaN
}
static inline float tf_cosf(float x) {
  int32_t q;
  double r = tf_reduce_pio2(std::fabs(x), q);
  double v = (q & 1) ? tf_sin_poly(r) : tf_cos_poly(r);
  float y = static_cast<float>(((q + 1) & 2) ? -v : v);
  return x - x != 0.0f ? std::numeric_limits<float>::quiet_NaN() : y;
}

extern "C" void tf_set_num_threads(int n) { if (n > 0) omp_set_num_threads(n); }
"""

_FN = {
    "exp": "std::exp", "exp2": "std::exp2", "expm1": "std::expm1", "log": "std::log", "log2": "std::log2",
    "log10": "std::log10", "log1p": "std::log1p", "sqrt": "std::sqrt", "sin": "std::sin", "cos": "std::cos",
    "tan": "std::tan", "asin": "std::asin", "acos": "std::acos", "atan": "std::atan", "sinh": "std::sinh",
    "cosh": "std::cosh", "tanh": "std::tanh", "asinh": "std::asinh", "acosh": "std::acosh", "atanh": "std::atanh",
    "erf": "std::erf", "erfc": "std::erfc", "lgamma": "std::lgamma", "ceil": "std::ceil", "floor": "std::floor",
    "round": "std::nearbyint", "trunc": "std::trunc", "isnan": "std::isnan", "isinf": "std::isinf",
    "isfinite": "std::isfinite", "signbit": "tf_signbit", "sigmoid": "tf_sigmoid", "sign": "tf_sign",
    "atan2": "std::atan2", "copysign": "std::copysign", "hypot": "std::hypot", "nextafter": "std::nextafter",
    "fmax": "std::fmax", "fmin": "std::fmin", "maximum": "tf_max", "minimum": "tf_min", "clamp_min": "tf_max",
    "clamp_max": "tf_min", "pyfloordiv": "tf_floordiv", "remainder": "tf_remainder", "fmod": "tf_fmod",
    "truncdiv": "tf_truncdiv", "pow": "tf_pow", "lshift": "tf_lshift", "rshift": "tf_rshift",
}
_VEC_F32 = {"exp": "tf_expf", "log": "tf_logf", "tanh": "tf_tanhf", "sigmoid": "tf_sigmoidf", "erf": "tf_erff",
            "sin": "tf_sinf", "cos": "tf_cosf", "expm1": "tf_expm1f"}
_INFIX = {"add": "+", "sub": "-", "mul": "*", "truediv": "/", "eq": "==", "ne": "!=", "lt": "<", "le": "<=",
          "gt": ">", "ge": ">=", "and": "&&", "or": "||", "xor": "!=", "bitand": "&", "bitor": "|", "bitxor": "^"}


def c_literal(value, dtype: torch.dtype) -> str:
    if dtype == torch.bool:
        return "true" if value else "false"
    if dtype.is_floating_point:
        ct = CTYPE[dtype]
        if math.isnan(value):
            return f"std::numeric_limits<{ct}>::quiet_NaN()"
        if math.isinf(value):
            return f"{'-' if value < 0 else ''}std::numeric_limits<{ct}>::infinity()"
        return f"static_cast<{ct}>({float(value)!r})"
    if dtype == INDEX or dtype == torch.int64:
        return f"INT64_C({int(value)})" if abs(int(value)) >= 2 ** 31 else f"(int64_t){int(value)}"
    return f"static_cast<{CTYPE[dtype]}>({int(value)})"


class Emitter(ExprEmitter):
    """Node DAGs as C++ statements (see ExprEmitter for the shared CSE machinery).

    `int32_buffers` are buffers whose every offset fits an int32: a gather from one (an offset
    computed from data loaded per lane, i.e. at an index holding one of `lane_vars`) is indexed
    with int32.  With int64 offsets, g++ gave up vectorizing a loop that mixes 64-bit gather
    lanes with the 32-bit lanes of tf_expf (an attention softmax with a gathered position bias ran
    scalar, 6x slower).  An offset whose loaded part is the same in every lane (a bilinear
    upsample's source row and column, over channels-last channels) stays int64: g++ hoists that
    part and loads the lanes contiguously, where the int32 cast made every load a gather (2x)."""

    def __init__(self, buffers: dict[str, torch.dtype], int32_buffers: frozenset[str] = frozenset(),
                 lane_vars: frozenset[str] = frozenset()):
        super().__init__(buffers)
        self.int32_buffers = int32_buffers
        self.lane_vars = lane_vars
        self.checks: dict[Node, int] = {}       # check node -> its site's number (check_sites)
        self.check_clause = ""                  # the reduction clause of every loop pragma
        self.recorded: set[Node] = set()        # checks already evaluated by an earlier loop
        self.prechecked: set[Node] = set()      # checks made before the loops (checks.emit_precheck)
        self.ranges: dict[str, Node] = {}       # loop var -> its size (indices known in range)
        self.open_vars: list[str] = []          # the vars of the loops now open
        self.produced: set[str] = set()         # buffers the kernel computes (hoist_checks)

    def hoist_checks(self) -> None:
        """Evaluate, before a vector loop opens, the index checks that only depend on the loops
        around it (an embedding row's id): computed inside, the clamp made g++ load every lane's
        element with a gather instead of one contiguous vector (an embedding lookup ran 1.8x
        slower; a check made before the loops, checks.emit_precheck, hoists its wrapped index the
        same way).  Not a check that reads a buffer this kernel computes (not stored yet)."""
        for n in self.checks:
            if n.op != "check_index" or any(n in scope for scope in self.scopes):
                continue
            nodes = walk(n)
            if all(x.arg in self.open_vars for x in nodes if x.op == "var") and \
                    not any(x.op == "load" and x.arg in self.produced for x in nodes):
                self.value(n)

    def literal(self, value, dtype: torch.dtype) -> str:
        return c_literal(value, dtype)

    def declare(self, name: str, expr: str, dtype: torch.dtype | None) -> str:
        return f"const {CTYPE[dtype]} {name} = {expr};"

    def masked(self, mask: str, value: str, dtype: torch.dtype) -> str:
        return f"({mask} ? {value} : {c_literal(0, dtype)})"

    def push(self) -> None:
        super().push()
        self.indent += 1

    def pop(self) -> None:
        super().pop()
        self.indent -= 1

    def _expr(self, n: Node) -> str:
        o, a, dt = n.op, n.args, n.dtype
        if o == "check_index":
            if n not in self.checks or n in self.prechecked:
                return self.index(unchecked_index(n, self.ranges))
            if n in self.recorded:
                # a later stage of the row meets the same indices again: the first one reported
                # them, this one only keeps its loads inside the tensor (a softmax's three passes
                # over a gathered bias checked each index three times: +11%)
                return f"tf_clamp_index({self.value(a[0])}, {self.index(a[1])}, {int(bool(a[2].arg))})"
            self.recorded.add(n)
            fn = "tf_check_index" if a[2].arg else "tf_check_index_nonneg"
            return f"{fn}({self.value(a[0])}, {self.index(a[1])}, tf_bad{self.checks[n]})"
        if o == "checked":          # a value whose index check the load dropped (a dim of one)
            self.value(a[1])
            return self.value(a[0])
        if n in self.checks:       # an integer division by a divisor that may be 0
            b = f"tf_div_check(static_cast<{CTYPE[a[1].dtype]}>({self.value(a[1])}), tf_bad{self.checks[n]})"
            return f"{_FN[o]}(static_cast<{CTYPE[a[0].dtype]}>({self.value(a[0])}), {b})"
        if o == "load":
            offset = self.index(a[0])
            if n.arg in self.int32_buffers and _gathers_per_lane(a[0], self.lane_vars):
                offset = f"static_cast<int32_t>({offset})"
            raw = f"{n.arg}[{offset}]"
            sdt = self.buffers[n.arg]
            if sdt == torch.float16:
                raw = f"tf_half_to_float({raw})"
            elif sdt == torch.bfloat16:
                raw = f"tf_bf16_to_float({raw})"
            if len(a) == 2:
                return f"({self.value(a[1])} ? {raw} : {c_literal(0, dt)})"
            return raw
        if o == "cast":
            x = self.value(a[0]) if a[0].dtype != INDEX or a[0].op not in ("add", "mul", "floordiv", "mod") \
                else self.index(a[0])
            src = a[0].dtype
            if dt == torch.bool:
                return f"({x} != 0)"
            if dt == torch.float16:
                return f"tf_round_half(static_cast<float>({x}))"
            if dt == torch.bfloat16:
                return f"tf_round_bf16(static_cast<float>({x}))"
            if src in (torch.float16, torch.bfloat16, torch.float32, torch.float64) and not dt.is_floating_point:
                return f"static_cast<{CTYPE[dt]}>(static_cast<int64_t>({x}))" if dt != torch.int64 else \
                    f"static_cast<int64_t>({x})"
            return f"static_cast<{CTYPE[dt]}>({x})"
        if o in ("add", "mul", "floordiv", "mod") and dt == INDEX and all(x.dtype == INDEX for x in a) \
                and o in ("floordiv", "mod"):
            return self.index(n)
        if o == "where":
            return f"({self.value(a[0])} ? {self.value(a[1])} : {self.value(a[2])})"
        if o in _INFIX and len(a) == 2:
            if o in ("bitand", "bitor", "bitxor") and dt == torch.bool:
                return f"static_cast<bool>({self.value(a[0])} {_INFIX[o]} {self.value(a[1])})"
            return f"({self.value(a[0])} {_INFIX[o]} {self.value(a[1])})"
        if o in ("add", "mul") and len(a) > 2:
            return "(" + f" {_INFIX[o]} ".join(self.value(x) for x in a) + ")"
        if o == "neg":
            return f"(-{self.value(a[0])})"
        if o == "not":
            return f"(!{self.value(a[0])})"
        if o == "bitnot":
            return f"static_cast<{CTYPE[dt]}>(~{self.value(a[0])})"
        if o == "abs":
            x = self.value(a[0])
            return f"std::abs({x})" if dt.is_floating_point else f"({x} < 0 ? static_cast<{CTYPE[dt]}>(-{x}) : {x})"
        if o == "relu":
            x = self.value(a[0])
            return f"({x} < 0 ? {c_literal(0, dt)} : {x})"
        if o == "rsqrt":
            return f"({c_literal(1, dt)} / std::sqrt({self.value(a[0])}))"
        if o == "reciprocal":
            return f"({c_literal(1, dt)} / {self.value(a[0])})"
        if o == "frac":
            x = self.value(a[0])
            return f"({x} - std::trunc({x}))"
        if o in _VEC_F32 and dt == torch.float32 and a[0].dtype == torch.float32:
            return f"{_VEC_F32[o]}({self.value(a[0])})"
        if o in _FN:
            ct = CTYPE[a[0].dtype] if a else CTYPE[dt]
            args = ", ".join(f"static_cast<{ct}>({self.value(x)})" if o in ("maximum", "minimum", "clamp_min",
                             "clamp_max", "pyfloordiv", "remainder", "fmod", "truncdiv", "pow", "lshift", "rshift")
                             else self.value(x) for x in a)
            return f"{_FN[o]}({args})"
        raise NotImplementedError(f"C++ codegen: no rule for op {o!r} ({to_text(n)})")


_INDEX_OPS = frozenset({"const", "var", "sym", "add", "mul", "floordiv", "mod"})


def _gathers_per_lane(index: Node, lane_vars: frozenset[str]) -> bool:
    """Does this offset read data (a gather, not loop-variable arithmetic) that differs from lane
    to lane (read at an index holding one of `lane_vars`)?"""
    return any(x.op not in _INDEX_OPS and any(v.op == "var" and v.arg in lane_vars for v in walk(x))
               for x in walk(index))


_RED_INIT = {"sum": 0, "prod": 1, "any": False, "all": True}


def _red_init(op: str, dtype: torch.dtype) -> str:
    if op in _RED_INIT:
        return c_literal(_RED_INIT[op], dtype)
    ct = CTYPE[dtype]
    if op in ("max", "argmax"):
        return f"-std::numeric_limits<{ct}>::infinity()" if dtype.is_floating_point else \
            f"std::numeric_limits<{ct}>::lowest()"
    return f"std::numeric_limits<{ct}>::infinity()" if dtype.is_floating_point else f"std::numeric_limits<{ct}>::max()"


def kernel_source(plan: LoopPlan, buffer_dtypes: dict[str, torch.dtype], parallel_threshold: int,
                  int32_buffers: frozenset[str] = frozenset(),
                  checks: list | None = None, run_checks: bool = True) -> tuple[str, list[str], list[str]]:
    """C++ for one kernel; returns (source, buffer argument names, symbol argument names).
    `int32_buffers`: the buffers every offset of which fits an int32 (see Emitter).  `checks`,
    a list, gets the kernel's run-time check sites (codegen/checks.py): a kernel with any
    returns non-zero when one failed, and `tf_last_error` says which, with what value (none
    without `run_checks`: Config.runtime_checks)."""
    kernel = plan.kernel
    written = [m.buffer.into or m.buffer.name for m in plan.members if m.buffer.name in plan.stored]
    produced = {m.buffer.name for m in plan.members}
    read: list[str] = []
    syms: set[str] = set()
    for m in plan.members:
        for n in _all_nodes(m):
            if n.op == "load" and n.arg not in read and n.arg not in produced:
                read.append(n.arg)
            if n.op == "sym":
                syms.add(n.arg)
    for s in plan.outer + plan.inner:
        syms |= free_syms(s)
    syms_list = sorted(syms)
    params = [f"const {STORAGE[buffer_dtypes[b]]}* __restrict__ {b}" for b in read]
    params += [f"{STORAGE[buffer_dtypes[b]]}* __restrict__ {b}" for b in written]
    params += [f"const int64_t {s}" for s in syms_list]
    short_inner = kernel.kind == "pointwise" and _interleaves_short_inner(plan)
    # the vars a vector loop may run over: the innermost of each loop nest (and the one around a
    # short innermost loop).  A row reduction's outer loop is scalar (its vector loops run over
    # the inner vars), so a gather at an offset loaded per row (an embedding's row) is the same
    # in every lane: an int32 cast there only turns its contiguous loads into gathers (3.5x
    # slower for an embedding + LayerNorm kernel)
    row_kernel = kernel.scatter is None and kernel.kind != "pointwise" and bool(plan.outer) \
        and not column_plan(plan)
    lane_vars = {f"{prefix}{len(dims) - 1}" for prefix, dims in (("x", plan.outer), ("y", plan.inner))
                 if dims and not (prefix == "x" and row_kernel)}
    if short_inner:
        lane_vars.add(f"x{len(plan.outer) - 2}")
    em = Emitter(buffer_dtypes, int32_buffers, frozenset(lane_vars))
    ranges = {f"x{j}": s for j, s in enumerate(plan.outer)} | {f"y{j}": s for j, s in enumerate(plan.inner)}
    sites = check_sites([n for m in plan.members for n in _all_nodes(m)], ranges, run_checks)
    em.checks, em.ranges = {node: k for k, (node, _) in enumerate(sites)}, ranges
    em.produced = produced
    if checks is not None:
        checks.extend(desc for _, desc in sites)
    em.lines.append(f'extern "C" {"int64_t" if sites else "void"} {kernel.name}({", ".join(params)}) {{')
    for k in range(len(sites)):
        em.line(f"int64_t tf_bad{k} = INT64_MIN;")
    outer_vars = [f"x{j}" for j in range(len(plan.outer))]
    hoisted = None          # the loops around a pointwise kernel's vector loop (hoist_checks)
    if kernel.scatter is None and kernel.kind == "pointwise" and plan.outer:
        hoisted = set(outer_vars[:len(outer_vars) - (2 if short_inner and len(outer_vars) > 1 else 1)])
    emit_prechecks(em, sites, ranges, produced, hoisted, parallel_threshold)
    in_loops = [k for k, (node, _) in enumerate(sites) if node not in em.prechecked]
    if in_loops:
        em.check_clause = f" reduction(max:{','.join(f'tf_bad{k}' for k in in_loops)})"
    total = " * ".join(em.index(s) for s in plan.outer + plan.inner) or "1"
    para = f"if(parallel: ({total}) >= {parallel_threshold})"   # the if must not switch off simd

    if kernel.scatter is not None:
        from .scatter import emit_scatter_kernel
        emit_scatter_kernel(em, plan, total, parallel_threshold)
    elif kernel.kind == "pointwise":
        _emit_loops(em, outer_vars, plan.outer, para, lambda: _emit_inner_stage(em, plan, plan.members),
                    short_inner=short_inner)
    elif not plan.outer:
        _emit_outer_body(em, plan, para_inner=para)
    elif column_plan(plan):
        _emit_column_kernel(em, plan, para)
    else:
        _emit_loops(em, outer_vars, plan.outer, para, lambda: _emit_outer_body(em, plan, None), simd_last=False)
    for k in in_loops:
        node = sites[k][0]
        size = em.index(node.args[1]) if node.op == "check_index" else "0"
        em.line(f"if (tf_bad{k} != INT64_MIN) {{ tf_err[0] = {k}; tf_err[1] = tf_bad{k}; tf_err[2] = {size}; return 1; }}")
    if sites:
        em.line("return 0;")
    em.lines.append("}")
    return "\n".join(em.lines), read + written, syms_list


def _all_nodes(m) -> Iterable[Node]:
    yield from walk(m.body)
    yield from walk(m.store)


# An innermost loop shorter than this (an RGB image's 3 channels, going channels-last) gets no
# `omp simd` where the loop around it reads and writes interleaved groups (_interleaves_short_inner):
# that loop does, and g++ unrolls the short one inside it.  Vectorized itself, every 3 elements
# paid a vector loop's entry and remainder (6x slower).
SHORT_INNER_LOOP = 8


def _interleaves_short_inner(plan: LoopPlan) -> bool:
    """Is the innermost loop of this pointwise kernel short (SHORT_INNER_LOOP), and does every
    access step along the loop around it by at most the short loop's length (contiguous, or
    interleaved groups such as channels-last pixels)?  Elsewhere (a strided step: gathers per
    lane) g++ 12 spends seconds vectorizing the loop around, for slower code."""
    if len(plan.outer) < 2 or plan.outer[-1].op != "const" or plan.outer[-1].arg >= SHORT_INNER_LOOP:
        return False
    around = f"x{len(plan.outer) - 2}"
    for m in plan.members:
        for index in [m.store] + [ld.args[0] for ld in loads(m.body)]:
            step = step_of(index, around)
            if not isinstance(step, int) or abs(step) > plan.outer[-1].arg:
                return False
    return True


def _emit_store(em: Emitter, plan: LoopPlan, m, value: str) -> None:
    if m.buffer.name in plan.stored:
        em.line(f"{m.buffer.name}[{em.index(m.store)}] = {_store_expr(m.buffer.dtype, value)};")


def _emit_inner_stage(em: Emitter, plan: LoopPlan, members, rows: RowCache | None = None, k: int = 0) -> None:
    if rows:
        rows.reload(em, k)
    for m in members:
        v = em.value(m.body)
        em.bind_local(m.buffer.name, m.store, v)
        _emit_store(em, plan, m, v)
    if rows:
        rows.store(em, k)


def _emit_outer_body(em: Emitter, plan: LoopPlan, para_inner: str | None) -> None:
    inner_vars = [f"y{j}" for j in range(len(plan.inner))]
    rows = RowCache(plan)
    rows.declare(em)
    for k, stage in enumerate(plan.stages):
        if stage.kind == "outer":
            _emit_inner_stage(em, plan, stage.members)
        elif stage.kind == "inner":
            _emit_loops(em, inner_vars, plan.inner, None,
                        lambda s=stage, k=k: _emit_inner_stage(em, plan, s.members, rows, k))
        else:
            _emit_reduce_stage(em, plan, stage, inner_vars, para_inner, rows, k)


def _emit_reduce_stage(em: Emitter, plan: LoopPlan, stage: Stage, inner_vars: list[str], para: str | None,
                       rows: RowCache | None = None, k: int = 0) -> None:
    accs = []
    clauses = []
    uses_arg = False
    for m in stage.members:
        op, dt = m.buffer.reduction_op, m.body.dtype
        acc = f"acc_{m.buffer.name}"
        if op in ("any", "all"):
            # an int32 flag: g++ does not vectorize an omp simd loop with a bool reduction
            # (nor, then, the row's later loops that read its result)
            em.line(f"int32_t {acc} = {1 if op == 'all' else 0};")
        else:
            em.line(f"{CTYPE[dt]} {acc} = {_red_init(op, dt)};")
        if op in ("argmax", "argmin"):
            em.line(f"int64_t {acc}_i = 0;")
            uses_arg = True
        if op in ("max", "min") and dt.is_floating_point:
            em.line(f"int32_t {acc}_nan = 0;")
            clauses.append(f"reduction(|:{acc}_nan)")
        clauses.append({"sum": f"reduction(+:{acc})", "prod": f"reduction(*:{acc})", "max": f"reduction(max:{acc})",
                        "min": f"reduction(min:{acc})", "any": f"reduction(|:{acc})", "all": f"reduction(&:{acc})"
                        }.get(op, ""))
        accs.append((m, acc))
    clause = "" if uses_arg else " " + " ".join(c for c in clauses if c)

    def body() -> None:
        if rows:
            rows.reload(em, k)
        for m, acc in accs:
            op = m.buffer.reduction_op
            v = em.value(m.body)
            if op not in ("argmax", "argmin"):
                nan = f"{acc}_nan" if op in ("max", "min") and m.body.dtype.is_floating_point else None
                _accumulate(em, op, acc, v, nan)
            else:
                flat = "0"
                for j, size in enumerate(plan.inner):
                    flat = f"({flat} * {em.index(size)} + y{j})"
                cmp = ">" if op == "argmax" else "<"
                nan = f" || ({v} != {v})" if m.body.dtype.is_floating_point else ""
                guard = f"!({acc} != {acc}) && " if m.body.dtype.is_floating_point else ""
                em.line(f"if ({guard}({v} {cmp} {acc}{nan})) {{ {acc} = {v}; {acc}_i = {flat}; }}")
        if rows:
            rows.store(em, k)

    if not plan.inner:
        em.push()
        em.line("{")
        body()
        em.line("}")
        em.pop()
    else:
        _emit_loops(em, inner_vars, plan.inner, para if not uses_arg else None, body, simd_last=not uses_arg,
                    reduction_clause=clause)
    for m, acc in accs:
        op = m.buffer.reduction_op
        if op in ("max", "min") and m.body.dtype.is_floating_point:
            em.line(f"if ({acc}_nan) {acc} = std::numeric_limits<{CTYPE[m.body.dtype]}>::quiet_NaN();")
        result = f"{acc}_i" if op in ("argmax", "argmin") else acc
        value = em.tmp(_result_cast(m.buffer.dtype, result), m.buffer.dtype)
        em.bind_local(m.buffer.name, m.store, value)
        _emit_store(em, plan, m, value)


# Columns per tile of a column reduction: 64 floats are 4 AVX-512 or 8 AVX2 vectors of
# accumulators, and a row's 256 bytes are whole cache lines.
COLUMN_TILE = 64


def column_plan(plan: LoopPlan) -> bool:
    """A reduction whose input is contiguous across rows (x.sum(0), batch-norm statistics of a
    channels-last tensor, a bias gradient) runs with the rows outside and a tile of columns
    inside: one row-per-iteration loop would load one element per cache line, with a stride
    the vectorizer turns into gathers (a [4096, 768].sum(0) took 26x ATen's time)."""
    return rows_contiguous(plan) and not any(
        m.role == "reduce" and m.buffer.reduction_op in ("argmax", "argmin") for m in plan.members)


def _emit_column_kernel(em: Emitter, plan: LoopPlan, para: str) -> None:
    """Outer dims but the last, and tiles of COLUMN_TILE of the last, in parallel; inside a tile
    every stage loops over its rows with the tile's columns as the vector loop (`xi`).  A
    per-column value (an accumulator, a mean) lives in an array indexed by `xi`."""
    n = len(plan.outer)
    cols = em.index(plan.outer[-1])
    collapse = f" collapse({n})" if n > 1 else ""
    em.line(f"#pragma omp parallel for{collapse}{em.check_clause} {para}")
    for j in range(n - 1):
        em.line(f"for (int64_t x{j} = 0; x{j} < {em.index(plan.outer[j])}; ++x{j}) {{")
        em.push()
    em.line(f"for (int64_t xb = 0; xb < {cols}; xb += {COLUMN_TILE}) {{")
    em.push()
    em.line(f"const int64_t xn = {cols} - xb < {COLUMN_TILE} ? {cols} - xb : {COLUMN_TILE};")
    inner_vars = [f"y{j}" for j in range(len(plan.inner))]
    for stage in plan.stages:
        if stage.kind == "outer":
            arrays = [_tile_array(em, m.buffer.name, "v", m.buffer.dtype) for m in stage.members]

            def outer_lane(members=stage.members, arrays=arrays) -> None:
                for m, arr in zip(members, arrays):
                    v = em.value(m.body)
                    em.line(f"{arr}[xi] = {v};")
                    _emit_store(em, plan, m, v)
            _emit_lanes(em, n, outer_lane)
            for m, arr in zip(stage.members, arrays):
                em.bind_local(m.buffer.name, m.store, f"{arr}[xi]")
        elif stage.kind == "inner":
            _emit_loops(em, inner_vars, plan.inner, None, lambda s=stage: _emit_lanes(
                em, n, lambda: _emit_inner_stage(em, plan, s.members)), simd_last=False)
        else:
            _emit_column_reduce(em, plan, stage, inner_vars, n)
    for _ in range(n):
        em.pop()
        em.line("}")


def _tile_array(em: Emitter, buffer: str, prefix: str, dtype: torch.dtype) -> str:
    name = f"{prefix}_{buffer}"
    em.line(f"alignas(64) {CTYPE[dtype]} {name}[{COLUMN_TILE}];")
    return name


def _emit_lanes(em: Emitter, n_outer: int, body) -> None:
    """One vector loop over the tile's columns; the last outer var is the column."""
    em.line(f"#pragma omp simd{em.check_clause}")
    em.line("for (int64_t xi = 0; xi < xn; ++xi) {")
    em.push()
    em.line(f"const int64_t x{n_outer - 1} = xb + xi;")
    body()
    em.pop()
    em.line("}")


def _emit_column_reduce(em: Emitter, plan: LoopPlan, stage: Stage, inner_vars: list[str], n_outer: int) -> None:
    accs = []
    for m in stage.members:
        op, dt = m.buffer.reduction_op, m.body.dtype
        acc = _tile_array(em, m.buffer.name, "acc", dt)
        nan = _tile_array(em, m.buffer.name, "nan", torch.int32) if op in ("max", "min") and dt.is_floating_point \
            else None
        accs.append((m, acc, nan))

    def init() -> None:
        for m, acc, nan in accs:
            em.line(f"{acc}[xi] = {_red_init(m.buffer.reduction_op, m.body.dtype)};")
            if nan:
                em.line(f"{nan}[xi] = 0;")

    def accumulate() -> None:
        for m, acc, nan in accs:
            _accumulate(em, m.buffer.reduction_op, f"{acc}[xi]", em.value(m.body), nan and f"{nan}[xi]")

    results = [_tile_array(em, m.buffer.name, "r", m.buffer.dtype) for m, _, _ in accs]

    def finish() -> None:
        for (m, acc, nan), res in zip(accs, results):
            a = f"{acc}[xi]"
            if nan:
                a = f"({nan}[xi] ? std::numeric_limits<{CTYPE[m.body.dtype]}>::quiet_NaN() : {a})"
            value = em.tmp(_result_cast(m.buffer.dtype, a), m.buffer.dtype)
            em.line(f"{res}[xi] = {value};")
            _emit_store(em, plan, m, value)

    _emit_lanes(em, n_outer, init)
    _emit_loops(em, inner_vars, plan.inner, None, lambda: _emit_lanes(em, n_outer, accumulate), simd_last=False)
    _emit_lanes(em, n_outer, finish)
    for (m, _, _), res in zip(accs, results):
        em.bind_local(m.buffer.name, m.store, f"{res}[xi]")


def _accumulate(em: Emitter, op: str, acc: str, v: str, nan: str | None) -> None:
    """acc op= v; `nan` (max/min of floats) records a NaN, which the comparison would skip."""
    if op == "sum":
        em.line(f"{acc} += {v};")
    elif op == "prod":
        em.line(f"{acc} *= {v};")
    elif op in ("max", "min"):
        em.line(f"{acc} = {v} {'>' if op == 'max' else '<'} {acc} ? {v} : {acc};")
        if nan:
            em.line(f"{nan} |= static_cast<int32_t>({v} != {v});")
    elif op == "any":
        em.line(f"{acc} |= static_cast<int32_t>({v} != 0);")
    else:
        em.line(f"{acc} &= static_cast<int32_t>({v} != 0);")


def _result_cast(dtype: torch.dtype, result: str) -> str:
    """An accumulator as the reduction's output dtype; fp16/bf16 round now, as the stored value will."""
    if dtype == torch.bool:
        return f"({result} != 0)"
    if dtype in (torch.float16, torch.bfloat16):
        return f"tf_round_{'half' if dtype == torch.float16 else 'bf16'}(static_cast<float>({result}))"
    return f"static_cast<{CTYPE[dtype]}>({result})"


def translation_unit(kernel_sources: list[str]) -> str:
    from .scatter import SCATTER_PRELUDE
    return PRELUDE + CHECKS + SCATTER_PRELUDE + "\n\n" + "\n\n".join(kernel_sources) + "\n"
