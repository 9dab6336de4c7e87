"""The C++ side of the run-time checks (codegen/checks.py): what a kernel calls to check an index
or a divisor, and how the wrapper learns which check failed (`tf_last_error`)."""

CHECKS = r"""
// Checks whose failure the kernel reports after its loops (see kernel_source): each check site
// keeps the largest failing value in `bad` (INT64_MIN: none), a max-reduction g++ vectorizes.
// An index is wrapped once if negative and, when still out of [0, size), replaced by 0 (never a
// load past the tensor); the index itself is what gets reported.
static inline int64_t tf_check_index(int64_t i, int64_t size, int64_t& bad) {
  int64_t w = i < 0 ? i + size : i;
  bool out = static_cast<uint64_t>(w) >= static_cast<uint64_t>(size);
  int64_t seen = out ? (i == INT64_MIN ? INT64_MIN + 1 : i) : INT64_MIN;
  bad = seen > bad ? seen : bad;
  return out ? 0 : w;
}
static inline int64_t tf_check_index_nonneg(int64_t i, int64_t size, int64_t& bad) {   // (no wrap)
  bool out = static_cast<uint64_t>(i) >= static_cast<uint64_t>(size);
  int64_t seen = out ? (i == INT64_MIN ? INT64_MIN + 1 : i) : INT64_MIN;
  bad = seen > bad ? seen : bad;
  return out ? 0 : i;
}
static inline int64_t tf_clamp_index(int64_t i, int64_t size, int negative) {   // (checked before)
  int64_t w = negative && i < 0 ? i + size : i;
  return static_cast<uint64_t>(w) >= static_cast<uint64_t>(size) ? 0 : w;
}
template <typename T> static inline T tf_div_check(T b, int64_t& bad) {
  int64_t seen = b == 0 ? 1 : INT64_MIN;
  bad = seen > bad ? seen : bad;
  return b;
}
static thread_local int64_t tf_err[3];      // the failed check's site, value and size
extern "C" void tf_last_error(int64_t* out) { out[0] = tf_err[0]; out[1] = tf_err[1]; out[2] = tf_err[2]; }
"""
