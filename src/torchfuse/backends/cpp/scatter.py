"""C++ for scatter kernels (lowering/scatter.py): `into[offset(i)] (op)= value(i)` over a source
domain, where several points may update one element.  Pointwise members before the scatter (its
prologue, scheduler/fusion.py `_scatter_prologue`) are computed and stored at each point of the
same loops, in the staged vector loops where there are some."""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ...ir.nodes import INDEX, Node, loads, walk
from ...scheduler.loops import LoopPlan
from .common import CTYPE, STORAGE, _emit_loops, _store_expr

if TYPE_CHECKING:
    from .codegen import Emitter


def emit_scatter_kernel(em: Emitter, plan: LoopPlan, total: str, parallel_threshold: int) -> None:
    """The body of a scatter kernel (`kernel.scatter`): a serial variant without atomics, a
    parallel one with per-thread copies (_privatizes) and one with atomic updates (serial when
    the scatter must be deterministic).  With a given thread count, all but the atomic one add
    in a fixed order: run to run, the same bits."""
    # One thread (or too little work to share) needs no atomics: a plain read-modify-write
    # per element runs ~4x faster (a locked compare-and-swap costs ~10 ns here)
    em.line(f"if (omp_get_max_threads() == 1 || ({total}) < {parallel_threshold}) {{")
    em.push()
    _emit_scatter_loops(em, plan, None, atomic=False)
    em.pop()
    if _privatizes(plan.kernel.scatter):
        span = em.index(_span(plan.kernel.scatter.layout))
        em.line(f"}} else if (({span}) <= {SCATTER_PRIVATE_RATIO} * ({total})) {{")
        em.push()
        _emit_private_scatter(em, plan, span)
        em.pop()
    em.line("} else {")
    em.push()
    # deterministic: no atomics, whose adds land in whatever order the threads reach them (the
    # copies above are combined in thread order, so they stay); else the loop runs serially
    deterministic = plan.kernel.scatter.deterministic
    _emit_scatter_loops(em, plan, None if deterministic else "", atomic=not deterministic)
    em.pop()
    em.line("}")


# tf_max / tf_min (prelude.PRELUDE) as selects, without branches, for the scalar read-modify-write
# of a scatter: there the new value wins about a third of the time at random (a GAT's amax over
# each node's incoming edges), and the mispredicted branches made the update loop 2.3x slower
SCATTER_PRELUDE = r"""
template <typename T> static inline T tf_max_sel(T a, T b) {
  T r = a > b ? a : b;
  if constexpr (std::is_floating_point<T>::value) { r = b != b ? b : r; r = a != a ? a : r; }
  return r;
}
template <typename T> static inline T tf_min_sel(T a, T b) {
  T r = a < b ? a : b;
  if constexpr (std::is_floating_point<T>::value) { r = b != b ? b : r; r = a != a ? a : r; }
  return r;
}
"""


# The dtypes each accumulating scatter mode takes ("store" takes every kernel dtype)
SCATTER_DTYPES = {mode: frozenset(CTYPE) - {torch.bool} for mode in ("sum", "prod", "amax", "amin")}


# A parallel scatter-sum into an output at most this many times its domain's size accumulates
# into a private copy per thread, summed at the end: an atomic add (a locked compare-and-swap,
# ~10 ns an element here: 6.4M adds of a GCN layer's messages took 55-80 ms, 20 ms unlocked) cost
# more than zeroing and adding the copies.
SCATTER_PRIVATE_RATIO = 4


def _privatizes(buf) -> bool:
    return buf.scatter == "sum" and buf.dtype not in (torch.float16, torch.bfloat16, torch.bool)


def _span(layout) -> Node:
    """Elements from a buffer's first to one past its last."""
    from ...ir.nodes import const as _const
    span = _const(1)
    for size, stride in zip(layout.sizes, layout.strides):
        span = span + (size - 1) * stride
    return span


def _emit_private_scatter(em: Emitter, plan: LoopPlan, span: str) -> None:
    """Thread 0 adds into the output, every other thread into a zeroed copy of its own, without
    atomics; after the loop (its barrier) the copies are added into the output, in thread order."""
    buf = plan.kernel.scatter
    st = STORAGE[buf.dtype]
    em.line("const int tf_nt = omp_get_max_threads();")
    em.line(f"{st}* tf_priv = static_cast<{st}*>(std::malloc(sizeof({st}) * (tf_nt - 1) * ({span})));")
    em.line("#pragma omp parallel num_threads(tf_nt)")
    em.line("{")
    em.push()
    em.line("const int tf_tid = omp_get_thread_num();")
    em.line(f"{st}* const tf_out = tf_tid == 0 ? {buf.into} : tf_priv + (tf_tid - 1) * ({span});")
    em.line(f"if (tf_tid) std::memset(tf_out, 0, sizeof({st}) * ({span}));")
    em.scatter_ptr = "tf_out"
    _emit_scatter_loops(em, plan, "schedule(static)", atomic=False, pragma="omp for")
    em.scatter_ptr = None
    em.line("#pragma omp for simd schedule(static)")
    em.line(f"for (int64_t i = 0; i < ({span}); ++i) {{")
    em.line(f"  for (int t = 1; t < tf_nt; ++t) {buf.into}[i] += tf_priv[(t - 1) * ({span}) + i];")
    em.line("}")
    em.pop()
    em.line("}")
    em.line("std::free(tf_priv);")


def _split_members(plan: LoopPlan):
    """(the scatter's member, the pointwise members before it): its prologue (scheduler/fusion.py
    `_scatter_prologue`), computed at each point of the same loops and read there."""
    m = next(x for x in plan.members if x.buffer.scatter is not None)
    return m, [x for x in plan.members if x is not m]


def _emit_prologue(em: Emitter, plan: LoopPlan, pro) -> None:
    """The prologue's values at the current point, stored where read elsewhere and bound for
    the scatter's value to read."""
    for p in pro:
        v = em.value(p.body)
        em.bind_local(p.buffer.name, p.store, v)
        if p.buffer.name in plan.stored:
            em.line(f"{p.buffer.name}[{em.index(p.store)}] = {_store_expr(p.buffer.dtype, v)};")


def _emit_scatter_loops(em: Emitter, plan: LoopPlan, para: str | None, atomic: bool,
                        pragma: str = "omp parallel for") -> None:
    m, pro = _split_members(plan)
    rows = plan.outer[-1] if len(plan.outer) > 1 else None
    if pro and rows is not None and all(p.buffer.name in plan.stored for p in pro):
        # over several loops, a prologue runs in vector loops of its own first (the row variants
        # below compute per row what does not change along it, and stage short rows badly: a
        # GATConv's exp over [edges, 4 heads] in the loop of its sum took 3x as long)
        _emit_loops(em, [f"x{j}" for j in range(len(plan.outer))], plan.outer, para,
                    lambda: _emit_prologue(em, plan, pro), pragma=pragma)
        pro = []
    row = _contiguous_row(m, f"x{len(plan.outer) - 1}") if rows is not None and not pro else None
    if row is not None and para is None and not atomic and _costly(_row_invariants(m.body, f"x{len(plan.outer) - 1}")):
        _emit_scatter_contiguous_staged(em, plan, m, *row)
    elif row is not None:
        _emit_scatter_contiguous(em, plan, m, para, atomic, *row, pragma=pragma)
    elif rows is not None and rows.op == "const" and rows.arg <= SCATTER_ROW_MAX:
        _emit_scatter_rows(em, plan, m, pro, para, atomic, pragma=pragma)
    elif para is None and not atomic and plan.outer:
        # (blocks along the last loop: a scatter of one point, `x[0] = v`, has no loop at all)
        _emit_scatter_blocked(em, plan, m, pro)
    else:
        def point() -> None:
            _emit_prologue(em, plan, pro)
            _emit_update(em, m.buffer, em.value(m.body), em.tmp(em.index(m.store), INDEX), atomic)
        _emit_loops(em, [f"x{j}" for j in range(len(plan.outer))], plan.outer, para, point, simd_last=False,
                    pragma=pragma)


def _contiguous_row(m, last: str) -> tuple[Node | None, Node] | None:
    """(condition, offset at `last` = 0) when the scatter's offset is `where(condition, offset,
    -1)` (or just the offset) with the condition independent of loop `last` and the offset moving
    by one element along it: each row of the domain updates one contiguous row of the output."""
    from ...ir.nodes import const as _const, substitute, var as _var
    store = m.store
    cond, off = (store.args[0], store.args[1]) if store.op == "where" else (None, store)
    if store.op == "where" and not (store.args[2].op == "const" and store.args[2].arg == -1):
        return None
    inside = [x for part in (cond, off) if part is not None for ld in loads(part) for x in walk(ld)]
    if any(x.op == "var" and x.arg == last for x in inside):
        return None
    # the row var only in sums and products (stride_of reads no var inside a // or %)
    if any(x.op not in ("add", "mul") and x.args and any(y.op == "var" and y.arg == last for y in walk(x))
           for x in walk(off)):
        return None
    if cond is not None and any(x.op == "var" and x.arg == last for x in walk(cond)):
        return None
    if _stride_of_row(off, last) != 1:
        return None
    return cond, substitute(off, {_var(last): _const(0)})


def _row_invariants(body: Node, last: str) -> list[Node]:
    """The largest parts of `body` that do not change along loop `last` (an edge's attention
    weight, exp of its score, read by every feature of its message): g++ left them inside the
    vector loop, 64 scalar exps per edge."""
    varies: dict[Node, bool] = {}
    for n in walk(body):
        varies[n] = (n.op == "var" and n.arg == last) or any(varies[a] for a in n.args)
    out: list[Node] = []
    for n in walk(body):
        if varies[n]:
            out += [a for a in n.args if not varies[a] and a.op not in ("const", "var", "sym")
                    and a.dtype != INDEX and a not in out]
    return out


def _stride_of_row(off: Node, last: str):
    from ...scheduler.tiling import stride_of
    return stride_of(off, last)


def _emit_scatter_contiguous(em: Emitter, plan: LoopPlan, m, para: str | None, atomic: bool,
                             cond: Node | None, base: Node, pragma: str = "omp parallel for") -> None:
    """A scatter of contiguous rows (a message per edge, over its features): the row's index,
    check and per-row factors once per row, then a loop along the row, vectorized where it runs
    on one thread (no two elements of a row are the same element)."""
    n = len(plan.outer)
    last, buf = f"x{n - 1}", m.buffer

    def row() -> None:
        ok = em.value(cond) if cond is not None else "true"
        start = em.tmp(em.index(base), INDEX)
        em.line(f"if ({ok}) {{")
        em.push()
        for n in _row_invariants(m.body, last):
            em.value(n)      # evaluated once per row; the loop below reads the temporaries
        if not atomic:
            em.line("#pragma omp simd")
        em.line(f"for (int64_t {last} = 0; {last} < {em.index(plan.outer[-1])}; ++{last}) {{")
        em.push()
        _emit_update(em, buf, em.value(m.body), f"{start} + {last}", atomic, checked=True)
        em.pop()
        em.line("}")
        em.pop()
        em.line("}")
    _emit_loops(em, [f"x{j}" for j in range(n - 1)], plan.outer[:-1], para, row, simd_last=False, pragma=pragma)


# ops whose scalar form costs more than staging a row's factor through a local array (with only
# loads and arithmetic per row, a GCN layer's index_add and an embedding bag ran ~5% slower staged)
_COSTLY_OPS = frozenset({"exp", "exp2", "expm1", "log", "log2", "log1p", "tanh", "sigmoid", "erf", "truediv",
                         "rsqrt", "sqrt", "pow", "sin", "cos"})


def _costly(nodes: list[Node]) -> bool:
    return any(x.op in _COSTLY_OPS for n in nodes for x in walk(n))


def _emit_scatter_contiguous_staged(em: Emitter, plan: LoopPlan, m, cond: Node | None, base: Node) -> None:
    """_emit_scatter_contiguous on one thread, its rows in blocks: per block, each row's
    condition, start and per-row factors are computed in a vector loop into local arrays (only
    where the condition holds, as before), then the rows are added one by one.  Per row, the
    factors (a GAT edge's exp of its score over its softmax sum) ran scalar, ~10 ns an edge."""
    n = len(plan.outer)
    last, rowv, buf = f"x{n - 1}", f"x{n - 2}", m.buffer
    size = em.index(plan.outer[-2])
    invs = _row_invariants(m.body, last)
    names = [f"tf_inv{k}_{buf.name}" for k in range(len(invs))]
    oks, starts = f"tf_ok_{buf.name}", f"tf_start_{buf.name}"
    blk = SCATTER_BLOCK

    def block() -> None:
        em.line(f"bool {oks}[{blk}]; int64_t {starts}[{blk}];")
        for name, inv in zip(names, invs):
            em.line(f"{CTYPE[inv.dtype]} {name}[{blk}];")
        em.line(f"const int64_t tf_blk_n = std::min<int64_t>({blk}, ({size}) - tf_blk);")
        em.line(f"#pragma omp simd{em.check_clause}")
        em.line("for (int64_t tf_j = 0; tf_j < tf_blk_n; ++tf_j) {")
        em.push()
        em.line(f"const int64_t {rowv} = tf_blk + tf_j;")
        em.open_vars.append(rowv)
        ok = em.value(cond) if cond is not None else "true"
        em.line(f"{oks}[tf_j] = {ok};")
        em.line(f"if ({ok}) {{")
        em.push()
        em.line(f"{starts}[tf_j] = {em.index(base)};")
        for name, inv in zip(names, invs):
            em.line(f"{name}[tf_j] = {em.value(inv)};")
        em.pop()
        em.line("}")
        em.open_vars.pop()
        em.pop()
        em.line("}")
        em.line("for (int64_t tf_j = 0; tf_j < tf_blk_n; ++tf_j) {")
        em.push()
        em.line(f"if ({oks}[tf_j]) {{")
        em.push()
        em.line(f"const int64_t {rowv} = tf_blk + tf_j;")     # the row's offsets (index math) are not staged
        for name, inv in zip(names, invs):
            em.bind(inv, f"{name}[tf_j]")     # the row loop reads the staged factor
        em.line("#pragma omp simd")
        em.line(f"for (int64_t {last} = 0; {last} < {em.index(plan.outer[-1])}; ++{last}) {{")
        em.push()
        _emit_update(em, buf, em.value(m.body), f"{starts}[tf_j] + {last}", False, checked=True)
        em.pop()
        em.line("}")
        em.pop()
        em.line("}")
        em.pop()
        em.line("}")

    def outer() -> None:
        em.line(f"for (int64_t tf_blk = 0; tf_blk < ({size}); tf_blk += {blk}) {{")
        em.push()
        block()
        em.pop()
        em.line("}")
    _emit_loops(em, [f"x{j}" for j in range(n - 2)], plan.outer[:-2], None, outer, simd_last=False)


def _emit_scatter_rows(em: Emitter, plan: LoopPlan, m, pro, para: str | None, atomic: bool,
                       pragma: str = "omp parallel for") -> None:
    """A scatter of rows (a message per edge and feature): per row, the values and offsets are
    computed in a vector loop into local arrays (the row's index and per-row factors are hoisted
    out of it), then applied one by one.  With the update in the same loop, g++ recomputed them
    per element (an atomic orders memory) and vectorized nothing: 10 ns an element."""
    n = len(plan.outer)
    last, size = f"x{n - 1}", plan.outer[-1].arg
    buf = m.buffer
    vals, offs = f"vals_{buf.name}", f"offs_{buf.name}"

    def row() -> None:
        em.line(f"{CTYPE[buf.dtype]} {vals}[{size}]; int64_t {offs}[{size}];")
        em.line("#pragma omp simd")
        em.line(f"for (int64_t {last} = 0; {last} < {size}; ++{last}) {{")
        em.push()
        _emit_prologue(em, plan, pro)
        v, t = em.value(m.body), em.index(m.store)
        em.line(f"{vals}[{last}] = {v};")
        em.line(f"{offs}[{last}] = {t};")
        em.pop()
        em.line("}")
        em.line(f"for (int64_t {last} = 0; {last} < {size}; ++{last}) {{")
        em.push()
        _emit_update(em, buf, f"{vals}[{last}]", f"{offs}[{last}]", atomic)
        em.pop()
        em.line("}")
    _emit_loops(em, [f"x{j}" for j in range(n - 1)], plan.outer[:-1], para, row, simd_last=False, pragma=pragma)


# rows up to this long are staged in local arrays (_emit_scatter_rows)
SCATTER_ROW_MAX = 1024

# elements per block of a serial scatter's staged values (_emit_scatter_blocked)
SCATTER_BLOCK = 64


def _emit_scatter_blocked(em: Emitter, plan: LoopPlan, m, pro) -> None:
    """A serial scatter along a long (or symbolic) last loop, in blocks: per block, the values and
    offsets are computed in a vector loop into local arrays, then applied one by one.  In one
    scalar loop with the update, everything fused into the scatter ran scalar: a GAT layer's
    per-edge score, leaky_relu and exp cost ~6 ns an edge per scatter (Inductor stages them the
    same way)."""
    n = len(plan.outer)
    last, buf = f"x{n - 1}", m.buffer
    vals, offs = f"vals_{buf.name}", f"offs_{buf.name}"
    size = em.index(plan.outer[-1])

    def block() -> None:
        em.line(f"{CTYPE[buf.dtype]} {vals}[{SCATTER_BLOCK}]; int64_t {offs}[{SCATTER_BLOCK}];")
        em.line(f"const int64_t tf_blk_n = std::min<int64_t>({SCATTER_BLOCK}, ({size}) - tf_blk);")
        em.line(f"#pragma omp simd{em.check_clause}")
        em.line("for (int64_t tf_j = 0; tf_j < tf_blk_n; ++tf_j) {")
        em.push()
        em.line(f"const int64_t {last} = tf_blk + tf_j;")
        em.open_vars.append(last)
        _emit_prologue(em, plan, pro)
        v, t = em.value(m.body), em.index(m.store)
        em.line(f"{vals}[tf_j] = {v};")
        em.line(f"{offs}[tf_j] = {t};")
        em.open_vars.pop()
        em.pop()
        em.line("}")
        em.line("for (int64_t tf_j = 0; tf_j < tf_blk_n; ++tf_j) {")
        em.push()
        _emit_update(em, buf, f"{vals}[tf_j]", f"{offs}[tf_j]", False)
        em.pop()
        em.line("}")

    def outer() -> None:
        em.line(f"for (int64_t tf_blk = 0; tf_blk < ({size}); tf_blk += {SCATTER_BLOCK}) {{")
        em.push()
        block()
        em.pop()
        em.line("}")
    _emit_loops(em, [f"x{j}" for j in range(n - 1)], plan.outer[:-1], None, outer, simd_last=False)


def _emit_update(em: Emitter, buf, v: str, t: str, atomic: bool, checked: bool = False) -> None:
    """`into[t] (op)= v`, skipped where the offset is negative (an index out of range).
    Accumulation is atomic: `omp atomic` where the storage type has an atomic add, else a
    compare-and-swap loop (fp16/bf16 round each add, as eager's CPU scatter_add does in the
    tensor's dtype)."""
    dtype = buf.dtype
    ptr, st = getattr(em, "scatter_ptr", None) or buf.into, STORAGE[dtype]
    if not checked:
        em.line(f"if ({t} >= 0) {{")
        em.push()
    if buf.scatter == "store":
        em.line(f"{ptr}[{t}] = {_store_expr(dtype, v)};")
    elif buf.scatter == "sum" and dtype not in (torch.float16, torch.bfloat16, torch.bool):
        if atomic:
            em.line("#pragma omp atomic")
        em.line(f"{ptr}[{t}] += static_cast<{st}>({v});")
    else:
        ct = CTYPE[dtype]
        old = "tf_half_to_float(o)" if dtype == torch.float16 else "tf_bf16_to_float(o)" \
            if dtype == torch.bfloat16 else "o"
        new = {"sum": f"{old} + {v}", "prod": f"{old} * {v}", "amax": f"tf_max_sel<{ct}>({old}, {v})",
               "amin": f"tf_min_sel<{ct}>({old}, {v})"}[buf.scatter]
        if atomic:
            em.line(f"tf_atomic_update({ptr} + {t}, [&]({st} o) {{ return {_store_expr(dtype, new)}; }});")
        else:
            em.line(f"{{ const {st} o = {ptr}[{t}]; {ptr}[{t}] = {_store_expr(dtype, new)}; }}")
    if not checked:
        em.pop()
        em.line("}")
