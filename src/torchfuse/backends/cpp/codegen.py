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
from .prelude import PRELUDE
from .rowcache import RowCache


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
        elif op == "sum" and dt == torch.float32 and len(plan.inner) > 1:
            # an fp32 sum over several dims (a batch and a map) accumulates in double, as ATen's
            # CPU kernels add their per-image vector partials (at::acc_type<float, false> is
            # double): in float, train-mode batch norm's per-channel sums over a batch of 32 7x7
            # maps came out 4-10x further from fp64 than eager's (weight gradients; bias 4-6x,
            # input 2.4-3x), and 0.3-1.4x with this.  The loop stays vectorized, in double lanes;
            # a one-dim row (softmax, layer norm) keeps its float lanes (in double, an in-cache
            # x.sum(-1) took 26% longer)
            em.line(f"double {acc} = 0.0;")
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
# Rows per partial sum of a floating-point column sum.  One accumulator per column over all n
# rows rounds like a sequential sum, an error growing as n ulps: a [4096, 768].sum(0) (a
# norm-weight gradient over 8x512 tokens) came out 8x further from the fp64 sum than ATen's
# cascade sum.  Rows summed in blocks of COLUMN_SUM_BLOCK, each block added to the total, round
# as n / COLUMN_SUM_BLOCK + COLUMN_SUM_BLOCK: 128 ulps instead of 4096 there.
COLUMN_SUM_BLOCK = 64


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

    # floating sums accumulate a block of rows in `part`, then add it to `acc` (COLUMN_SUM_BLOCK)
    parts = {m.buffer.name: _tile_array(em, m.buffer.name, "part", m.body.dtype) for m, _, _ in accs
             if m.buffer.reduction_op == "sum" and m.body.dtype.is_floating_point}
    rows = f"rows_{accs[0][0].buffer.name}"
    if parts:
        em.line(f"int64_t {rows} = 0;")

    def init() -> None:
        for m, acc, nan in accs:
            em.line(f"{acc}[xi] = {_red_init(m.buffer.reduction_op, m.body.dtype)};")
            if nan:
                em.line(f"{nan}[xi] = 0;")
            if m.buffer.name in parts:
                em.line(f"{parts[m.buffer.name]}[xi] = 0;")

    def accumulate() -> None:
        for m, acc, nan in accs:
            target = f"{parts[m.buffer.name]}[xi]" if m.buffer.name in parts else f"{acc}[xi]"
            _accumulate(em, m.buffer.reduction_op, target, em.value(m.body), nan and f"{nan}[xi]")

    def fold() -> None:
        for m, acc, _ in accs:
            if m.buffer.name in parts:
                em.line(f"{acc}[xi] += {parts[m.buffer.name]}[xi];")
                em.line(f"{parts[m.buffer.name]}[xi] = 0;")

    def row() -> None:
        _emit_lanes(em, n_outer, accumulate)
        if parts:
            em.line(f"if (++{rows} == {COLUMN_SUM_BLOCK}) {{")
            em.push()
            em.line(f"{rows} = 0;")
            _emit_lanes(em, n_outer, fold)
            em.pop()
            em.line("}")

    results = [_tile_array(em, m.buffer.name, "r", m.buffer.dtype) for m, _, _ in accs]

    def finish() -> None:
        if parts:
            fold()
        for (m, acc, nan), res in zip(accs, results):
            a = f"{acc}[xi]"
            if nan:
                a = f"({nan}[xi] ? std::numeric_limits<{CTYPE[m.body.dtype]}>::quiet_NaN() : {a})"
            value = em.tmp(_result_cast(m.buffer.dtype, a), m.buffer.dtype)
            em.line(f"{res}[xi] = {value};")
            _emit_store(em, plan, m, value)

    _emit_lanes(em, n_outer, init)
    _emit_loops(em, inner_vars, plan.inner, None, row, simd_last=False)
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
