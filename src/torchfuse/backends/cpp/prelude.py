"""The C++ every translation unit starts with (codegen.translation_unit): the headers, fp16/bf16
conversions and rounding, and the `tf_*` scalar and vector-friendly math helpers that the kernels'
expressions call (codegen._FN, codegen._VEC_F32)."""
from __future__ import annotations

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
