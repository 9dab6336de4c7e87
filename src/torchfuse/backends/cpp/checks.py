"""The C++ side of the run-time checks (codegen/checks.py): what a kernel calls to check an index
or a divisor, and how the wrapper learns which check failed (`tf_last_error`)."""
from __future__ import annotations

from typing import Any, Mapping

from ...ir.nodes import Node, walk

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


def precheckable(n: Node, ranges: Mapping[str, Node], produced: set[str],
                 hoisted: set[str] | None = None) -> bool:
    """Is index check `n` one to make before the kernel's loops (emit_precheck)?  Where its index
    depends on fewer loops than the kernel has (a relative-position bias's index matrix, read once
    per window and head; a decode step's position, once), the loops repeat the same check; not
    where it reads a buffer the kernel computes (not stored yet), nor where it depends on exactly
    the loops `hoisted` (those around a pointwise kernel's vector loop, where the Emitter's
    hoist_checks makes it once per value already: an embedding's id, a GNN edge's ends, whose
    separate pass over the ids cost 3% more)."""
    if n.op != "check_index":
        return False
    nodes = list(walk(n))
    used = {x.arg for x in nodes if x.op == "var"}
    return used < set(ranges) and used != hoisted and not any(x.op == "load" and x.arg in produced for x in nodes)


def emit_precheck(em: Any, n: Node, site: int, ranges: Mapping[str, Node], parallel_threshold: int) -> None:
    """Before the kernel's loops: check every value index check `n` takes, in loops over the vars
    it depends on alone, and return at once if one fails (the kernel's loops then never run with
    a bad index, so they use the index unchecked: no compare, no clamp, no reduction per element;
    a relative-position bias + softmax paid 6.7% for the check inside its vector loops)."""
    names = [v for v in ranges if any(x.op == "var" and x.arg == v for x in walk(n))]
    i, size, negative = n.args
    fn = "tf_check_index" if negative.arg else "tf_check_index_nonneg"
    em.line("{")
    em.push()
    if names:
        domain = " * ".join(em.index(ranges[v]) for v in names)
        simd = " simd" if len(names) == 1 else ""
        em.line(f"#pragma omp parallel for{simd} reduction(max:tf_bad{site}) if(parallel: ({domain}) >= {parallel_threshold})")
    for j, v in enumerate(names):
        if j == len(names) - 1 and j > 0:
            em.line(f"#pragma omp simd reduction(max:tf_bad{site})")
        em.line(f"for (int64_t {v} = 0; {v} < {em.index(ranges[v])}; ++{v}) {{")
        em.push()
    em.line(f"{fn}({em.value(i)}, {em.index(size)}, tf_bad{site});")
    for _ in names:
        em.pop()
        em.line("}")
    em.pop()
    em.line("}")
    em.line(f"if (tf_bad{site} != INT64_MIN) {{ tf_err[0] = {site}; tf_err[1] = tf_bad{site}; "
            f"tf_err[2] = {em.index(size)}; return 1; }}")


def emit_prechecks(em: Any, sites: list, ranges: Mapping[str, Node], produced: set[str],
                   hoisted: set[str] | None, parallel_threshold: int) -> None:
    """emit_precheck for each of the kernel's check sites that is `precheckable`, one pass per
    index: a check of the same index against the same size (a GAT's edge targets, read by the
    gather of their softmax sum and by the messages' index_add, each a pass over 800 KB) is made
    once, by the earlier site, whose failure the kernel reports first either way."""
    made: set[tuple] = set()
    for k, (node, _) in enumerate(sites):
        if precheckable(node, ranges, produced, hoisted):
            if node.args not in made:
                emit_precheck(em, node, k, ranges, parallel_threshold)
                made.add(node.args)
            em.prechecked.add(node)
