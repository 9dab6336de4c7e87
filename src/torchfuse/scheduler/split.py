"""Split (two-stage) reductions: few long rows reduced by enough programs to fill the machine.

A reduction kernel runs one program (Triton) or one OpenMP iteration (C++) per row, so x.sum(),
a [8, 8M] row sum or the column sums of an [8M, 8] tensor use 1-8 SMs/threads.  This pass
rewrites such a kernel, after fusion and before loop planning, into

  K1 `<k>_part`  outer [S, rows], inner [C]:  part[s, row] = red_{c < C} body(row, r = s*C + c)
                 (r < R is a mask unless S divides R); per-element prologue members stay here
  K2 `<k>`       outer [rows], inner [S]:     out[row] = red_{s < S} part[s, row], then the
                 per-row epilogue members (mean's division, ...)
  K3 `<k>_post`  a pointwise kernel over [rows + reduced dims] for the per-element members that
                 read the result (x - x.sum()); in the row loop they ran on one program too.

Partials are stored in the accumulator dtype (fp32 for fp16/bf16, int64 for integer sums), and
max/min combine with the same NaN-propagating operator, so results match eager.  Supported:
sum, prod, max, min, any, all (mean/norm are sums with an epilogue).  Not split (logged):
argmax/argmin (the partial would need the index as well), chains where one reduction reads
another (variance, softmax), and symbolic row counts.

S is a compile-time constant for static sizes (a divisor of R when one is close, so the body
needs no mask), or, when R is symbolic, a symbol the wrapper computes from the run-time sizes
(`Kernel.bindings`): no guard is added, and S is 1 when R turns out to be short.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable

import torch

from ..ir.buffers import ComputedBuffer, Layout, LoweredGraph, contiguous_strides
from ..ir.nodes import (Node, cast, const, floordiv, load, loads, map_nodes, mod, op, substitute, sym, var,
                        walk, where)
from .fusion import Kernel, Member, Schedule
from .loops import reads_columns
from .tiling import step_of, stride_of

log = logging.getLogger("torchfuse.split")

SPLIT_OPS = ("sum", "prod", "max", "min", "any", "all")
MAX_SPLIT = 1024        # partials per row: the second kernel then reduces a short row in registers


@dataclass(frozen=True)
class SplitParams:
    target: int          # programs / loop iterations wanted in K1 (about 2x SMs, 4x threads)
    min_chunk: int       # fewest reduced elements per partial
    min_numel: int       # rows * R below this is not worth a second kernel
    # Reductions whose body gathers (a load indexed by another load: a cross entropy's target
    # logits, one per row) are latency-bound, not bandwidth-bound: one program walking 32768
    # gathers took 80 us on an H100.  They split at fewer elements, into shorter chunks.
    gather_chunk: int = 0       # 0: min_chunk
    gather_min_numel: int = 0   # 0: min_numel
    # Column-like data is reduced in tiles of this many rows per program (Triton's column plan,
    # C++'s COLUMN_TILE): the program count is rows / column_tile, not rows
    column_tile: int = 1
    column_chunk: int = 1024    # fewest reduced elements per partial of a tiled column reduction
    column_fewest: int = 4      # fewest partials worth a second kernel for column tiles

    @staticmethod
    def make(target: int, chunk: int, numel: int, *, gather_chunk: int = 0, gather_numel: int = 0,
             column_tile: int = 1, column_fewest: int = 2, column_chunk_divisor: int = 4,
             min_chunk: int = 0) -> "SplitParams":
        """A backend's numbers (backends/*/: split_params); `min_chunk` (Config.split_min_chunk)
        overrides the chunk size (tests use it to split small tensors)."""
        if min_chunk:
            chunk, numel = min_chunk, 2 * min_chunk
            gather_chunk, gather_numel = min(gather_chunk or chunk, chunk), min(gather_numel or numel, numel)
        # a column tile partial reads several elements per reduced element: shorter chunks
        column_chunk = max(1, chunk // column_chunk_divisor)
        return SplitParams(target, chunk, numel, gather_chunk, gather_numel, column_tile, column_chunk, column_fewest)

    @staticmethod
    def on_cpu(num_threads: int, min_chunk: int = 0, column_tile: int = 1) -> "SplitParams":
        """A CPU's numbers: 4 chunks per thread balance the load; OpenMP start-up wants >= ~64K
        elements each.  `column_tile`: rows of column-like data one partial reduces together."""
        return SplitParams.make(4 * max(1, num_threads), 1 << 16, 1 << 20, column_tile=column_tile,
                                column_chunk_divisor=column_tile if column_tile > 1 else 4, min_chunk=min_chunk)


def split_factor(rows: int, length: int, target: int, min_chunk: int) -> int:
    """Partials per row: enough that rows * S reaches `target`, each at least `min_chunk` long.
    Also evaluated by the generated wrapper at run time when the reduced length is symbolic."""
    return max(1, min(MAX_SPLIT, -(-target // max(rows, 1)), length // max(min_chunk, 1)))


def _product(sizes: tuple[Node, ...]) -> Node:
    out = const(1)
    for s in sizes:
        out = out * s
    return out


def _identity(red_op: str, dtype: torch.dtype) -> Node:
    """The neutral element, which masked-off positions of the last chunk contribute."""
    if red_op in ("any", "all"):
        return const(red_op == "all", dtype)
    if red_op in ("sum", "prod"):
        return const(0 if red_op == "sum" else 1, dtype)
    if dtype == torch.bool:
        return const(red_op == "min", dtype)
    if dtype.is_floating_point:
        return const(float("-inf") if red_op == "max" else float("inf"), dtype)
    info = torch.iinfo(dtype)
    return const(info.min if red_op == "max" else info.max, dtype)


def _reads(m: Member, names: set[str]) -> set[str]:
    return {ld.arg for ld in loads(m.body)} & names


@dataclass(frozen=True)
class _VarianceChain:
    """S = sum(x) and V = sum((x - a) * (x - a)), a being a per-row value read from S (a mean):
    the one reduction chain that splits, through shifted sums (see _Splitter._split_variance)."""
    total: Member
    squares: Member
    x: Node
    a: Node


def _variance_chain(red: list[Member], pre_names: set[str], everything: set[str]) -> _VarianceChain | None:
    chained = [m for m in red if _reads(m, everything) - pre_names]
    if len(chained) != 1:
        return None
    v = chained[0]
    d = v.body
    if v.buffer.reduction_op != "sum" or d.dtype != torch.float32 or d.op != "mul" or d.args[0] != d.args[1] \
            or d.args[0].op != "sub":
        return None
    x, a = d.args[0].args
    total = next((m for m in red if m is not v and m.buffer.reduction_op == "sum" and m.body == x), None)
    if total is None or _reads(v, everything) - pre_names != {total.buffer.name}:
        return None
    if any(n.op == "var" and n.arg.startswith("y") for n in walk(a)) or _reads(total, everything) - pre_names:
        return None
    return _VarianceChain(total, v, x, a)


def _classify(kernel: Kernel) -> tuple[list[Member], list[Member], list[Member], list[Member],
                                       _VarianceChain | None] | str:
    """(pre, reduce, outer, post, variance chain) members, or why the kernel cannot be split."""
    everything = {m.buffer.name for m in kernel.members}
    red = [m for m in kernel.members if m.role == "reduce"]
    outer = [m for m in kernel.members if m.role == "outer"]
    pre: list[Member] = []        # per-element members that read no per-row result
    post: list[Member] = []       # per-element members that do (x - x.sum())
    pre_names: set[str] = set()
    for m in kernel.members:
        if m.role == "inner":
            independent = not (_reads(m, everything) - pre_names)
            (pre if independent else post).append(m)
            if independent:
                pre_names.add(m.buffer.name)
    chain = _variance_chain(red, pre_names, everything)
    for m in red:
        if m.buffer.reduction_op not in SPLIT_OPS:
            return f"{m.buffer.reduction_op} needs the index of each partial (not split)"
        bad = _reads(m, everything) - pre_names
        if bad and (chain is None or m is not chain.squares):
            return f"{m.buffer.name} reads {sorted(bad)} of the same kernel (a reduction chain needs all rows first)"
    return pre, red, outer, post, chain


def _inner_order(kernel: Kernel, red: list[Member]) -> list[int]:
    """Reduced dims from slowest to fastest in memory (by the first load that walks them), so the
    flat reduced index is contiguous for x.t().sum() too."""
    n = len(kernel.inner)
    for m in red:
        for ld in loads(m.body):
            strides = [stride_of(ld.args[0], f"y{j}") for j in range(n)]
            if any(strides):
                return sorted(range(n), key=lambda j: -strides[j])
    return list(range(n))


def _column_like(kernel: Kernel, red: list[Member]) -> bool:
    """Column-like data: the code generator's test (loops.reads_columns), so the programs
    counted here are the column tiles it makes (a weight gradient's `(g[:, :, None] * x).sum(0)`
    first loads g, broadcast across the columns: judged by that load, its 256 rows of 100000
    counted as 256 programs, and the 4 column tiles the GPU ran were not split)."""
    return bool(kernel.outer) and bool(kernel.inner) and reads_columns(len(kernel.outer), len(kernel.inner), red)


def _gathers(red: list[Member]) -> bool:
    """Does a reduction body load through an index that is itself loaded?"""
    return any(loads(ld.args[0]) for m in red for ld in loads(m.body))


class _Splitter:
    def __init__(self, program: LoweredGraph, readers: dict[str, set[str]], params: SplitParams):
        self.program, self.readers, self.params = program, readers, params

    def _sizing(self, kernel: Kernel, red: list[Member]) -> tuple[int, int, int, bool]:
        """(programs the rows alone give, fewest elements per partial, fewest elements worth
        splitting, whether programs are column tiles) for this kernel's static row count."""
        p, rows = self.params, _product(kernel.outer).arg
        tiled = p.column_tile > 1 and _column_like(kernel, red)
        programs = -(-rows // p.column_tile) if tiled else rows
        if _gathers(red):
            return programs, p.gather_chunk or p.min_chunk, p.gather_min_numel or p.min_numel, tiled
        return programs, p.column_chunk if tiled else p.min_chunk, p.min_numel, tiled

    def why_not(self, kernel: Kernel) -> str:
        """Empty when `kernel` should be split, else the reason (for the log)."""
        if kernel.kind != "reduction":
            return "not a reduction"
        if kernel.scatter is not None:
            return "runs a scatter (its per-element updates are not split into partials)"
        rows, length = _product(kernel.outer), _product(kernel.inner)
        if rows.op != "const":
            return f"symbolic row count {rows} (could be large; rows already fill the machine then)"
        red = [m for m in kernel.members if m.role == "reduce"]
        programs, chunk, min_numel, tiled = self._sizing(kernel, red)
        if rows.arg == 0 or programs * 2 > self.params.target:
            return f"{rows.arg} rows already fill the {self.params.target} programs"
        fewest = self.params.column_fewest if tiled else 2
        if length.op == "const":
            if rows.arg * length.arg < min_numel:
                return f"{rows.arg}x{length.arg} elements are too few to pay for a second kernel"
            if split_factor(programs, length.arg, self.params.target, chunk) < fewest:
                return f"rows of {length.arg} are shorter than {fewest} chunks of {chunk}"
        return ""

    def split(self, kernel: Kernel) -> list[Kernel] | str:
        classes = _classify(kernel)
        if isinstance(classes, str):
            return classes
        pre, red, outer, post, chain = classes
        shift_x = None
        if chain is not None:
            # each chunk's shift k (x at its first element) is read by every lane of the chunk:
            # computed from the kernel's inputs, never loaded back from a value this kernel stores
            shift_x = _from_inputs(chain.x, {m.buffer.name: m for m in kernel.members})
            if isinstance(shift_x, str):
                return f"the variance's shift {shift_x}"
        p = self.params
        rows, length = _product(kernel.outer), _product(kernel.inner)
        bindings: list[tuple[str, str]] = []
        # Column-like data (contiguous across rows, e.g. [8M, 8].sum(0)): a program reads
        # column_tile rows of its chunk (the Triton launcher tiles several rows), so fewer
        # partials fill the machine (C++: S alone does)
        programs, min_chunk, _, tiled = self._sizing(kernel, red)
        per_row = programs if tiled else 1 if _column_like(kernel, red) else rows.arg
        if length.op == "const":
            s = split_factor(per_row, length.arg, p.target, min_chunk)
            # a divisor of R near s avoids the bounds mask (and keeps C++ inner loops vectorized)
            divisor = next((d for d in range(s, (s + 1) // 2 - 1, -1) if length.arg % d == 0), None)
            s = divisor or s
            split, chunk, masked = const(s), const(-(-length.arg // s)), divisor is None
        else:
            from ..ir.nodes import py_index
            split, chunk, masked = sym(f"{kernel.name}_split"), sym(f"{kernel.name}_chunk"), True
            r = py_index(length)
            bindings = [(split.arg, f"_split_factor({per_row}, {r}, {p.target}, {min_chunk})"),
                        (chunk.arg, f"-(-({r}) // {split.arg})")]
        if masked:
            # K1's last chunk runs past R, and stores are not masked: a per-element member that
            # must be stored moves to K3 (it reads no per-row value), unless a reduction uses it
            stored = [m for m in pre if self._stored(kernel, m, post)]
            pre = [m for m in pre if m not in stored]
            # (a member a reduction reads is stored too: plan_loops keeps values across loops in memory)
            k1_reads = {ld.arg for m in red + pre for ld in loads(m.body)}
            if any(m.buffer.name in k1_reads for m in stored) or any(m.buffer.name in k1_reads for m in pre):
                return "a stored per-element prologue would need a masked store (R not divisible)"
            post = stored + post
        n = len(kernel.outer)
        ranges = {"x0": split, "y0": chunk, **{f"x{j + 1}": s for j, s in enumerate(kernel.outer)}}
        flat = var("x0") * chunk + var("y0")
        mapping: dict[Node, Node] = {var(f"x{j}"): var(f"x{j + 1}") for j in range(n)}
        order = _inner_order(kernel, red)
        mapping.update(_unflatten(flat, order, kernel.inner, ranges))
        cond = op("lt", flat, length, dtype=torch.bool) if masked else None

        def rewrite(body: Node) -> Node:
            body = substitute(body, mapping, ranges)
            return _mask_loads(body, cond) if cond is not None else body

        part_sizes = (split,) + kernel.outer
        part_strides = contiguous_strides(part_sizes)
        part_store = Layout(part_sizes, part_strides).index([var(f"x{j}") for j in range(n + 1)])
        row_strides = contiguous_strides(kernel.outer)
        row_index = Layout(kernel.outer, row_strides).index([var(f"x{j}") for j in range(n)])
        k1 = Kernel(f"{kernel.name}_part", part_sizes, (chunk,), bindings=bindings)
        k2 = Kernel(kernel.name, kernel.outer, (split,))
        for m in pre:
            k1.members.append(Member(m.buffer, "inner", rewrite(m.body), substitute(m.store, mapping, ranges)))
        if chain is not None:
            red = [m for m in red if m is not chain.total and m is not chain.squares]
            self._split_variance(kernel, chain, shift_x, k1, k2, split, chunk, length, order, mapping, ranges,
                                 cond, rewrite, part_sizes, part_strides, part_store, row_index)
        for m in red:
            red_op, acc = m.buffer.reduction_op, m.body.dtype
            body = rewrite(m.body)
            if cond is not None:
                body = where(cond, body, _identity(red_op, acc))
            name = f"{m.buffer.name}_part"
            device = self.program.buffer_meta[m.buffer.name][3]
            part = ComputedBuffer(name, acc, Layout(part_sizes, part_strides), part_sizes, body, red_op,
                                  (chunk,), list(m.buffer.origins))
            self.program.buffer_meta[name] = (part_sizes, part_strides, acc, device)
            k1.members.append(Member(part, "reduce", body, part_store))
            combine = load(name, var("y0") * _product(kernel.outer) + row_index, acc)
            k2.members.append(Member(m.buffer, "reduce", combine, m.store))
        k2.members += outer
        out = [k1, k2]
        if post:
            k3 = Kernel(f"{kernel.name}_post", kernel.outer + kernel.inner, ())
            to_x = {var(f"y{j}"): var(f"x{n + j}") for j in range(len(kernel.inner))}
            for m in post:
                k3.members.append(Member(m.buffer, "pointwise", substitute(m.body, to_x), substitute(m.store, to_x)))
            out.append(k3)
        for k in out:
            why = _read_elsewhere(k)
            if why:     # a compiler bug, caught here rather than as a race on a GPU
                log.warning("not splitting %s: %s", kernel.name, why)
                return why
        log.debug("split %s: %s partials of %s per row over %s rows (%s)", kernel.name, split, chunk, rows,
                  "masked" if masked else "exact")
        return out

    def _split_variance(self, kernel: Kernel, chain: _VarianceChain, shift_x: Node, k1: Kernel, k2: Kernel,
                        split: Node, chunk: Node, length: Node, order: list[int], mapping: dict, ranges: dict,
                        cond: Node | None, rewrite: Callable[[Node], Node], part_sizes: tuple,
                        part_strides: tuple, part_store: Node, row_index: Node) -> None:
        """Chan's parallel variance with shifted sums: each chunk c of a row sums d = x - k_c and
        d * d, k_c being x at the chunk's first element (as the looped kernel's lanes do, see
        codegen.triton._emit_shifted_sums); the second kernel computes k_c again and combines
            S = sum_c (k_c n_c + s1_c)
            V = sum_c (s2_c + 2 (k_c - a) s1_c + n_c (k_c - a)^2)      (exact for any a)
        so the per-row mean a = f(S) is known there.  Nothing cancels by more than a small
        factor when the chunk's first value is within a few deviations of its mean.  `shift_x`
        is x computed from the kernel's inputs (_from_inputs): where x is a value the first
        kernel stores (a residual sum before a group norm), k_c loaded back from that buffer
        would be another thread's store, which nothing orders before the load on a GPU."""
        f32 = torch.float32
        start_k1 = var("x0") * chunk          # the chunk's first reduced index, in K1 ...
        start_k2 = var("y0") * chunk          # ... and in K2, whose reduced index is the chunk
        ranges2 = {"y0": split, **{f"x{j}": s for j, s in enumerate(kernel.outer)}}
        first_ok1 = op("lt", start_k1, length, dtype=torch.bool)
        first_ok2 = op("lt", start_k2, length, dtype=torch.bool)
        at_k1 = {k: v for k, v in mapping.items() if k.arg.startswith("x")}     # K1's rows: x{j} -> x{j+1}
        at_k1.update(_unflatten(start_k1, order, kernel.inner, ranges))
        k_in_k1 = where(first_ok1, _mask_loads(substitute(shift_x, at_k1, ranges), first_ok1), const(0.0, f32))
        at_k2 = _unflatten(start_k2, order, kernel.inner, ranges2)
        k_in_k2 = where(first_ok2, _mask_loads(substitute(shift_x, at_k2, ranges2), first_ok2, ("y0",)),
                        const(0.0, f32))
        d = op("sub", rewrite(chain.x), k_in_k1, dtype=f32)
        if cond is not None:
            d = where(cond, d, const(0.0, f32))
        device = self.program.buffer_meta[chain.total.buffer.name][3]
        names = []
        for m, body in ((chain.total, d), (chain.squares, op("mul", d, d, dtype=f32))):
            name = f"{m.buffer.name}_part"
            part = ComputedBuffer(name, f32, Layout(part_sizes, part_strides), part_sizes, body, "sum",
                                  (chunk,), list(m.buffer.origins))
            self.program.buffer_meta[name] = (part_sizes, part_strides, f32, device)
            k1.members.append(Member(part, "reduce", body, part_store))
            names.append(name)
        s1, s2 = (load(nm, var("y0") * _product(kernel.outer) + row_index, f32) for nm in names)
        # elements in chunk y0: chunk, except the last one(s) when chunks do not divide R
        left = length - start_k2
        count = chunk if cond is None else where(op("lt", left, chunk, dtype=torch.bool),
                                                 where(first_ok2, left, const(0)), chunk)
        n = cast(count, f32)
        total = op("add", op("mul", k_in_k2, n, dtype=f32), s1, dtype=f32)
        c = op("sub", k_in_k2, chain.a, dtype=f32)
        two_s1 = op("mul", const(2.0, f32), s1, dtype=f32)
        squares = op("add", s2, op("mul", c, op("add", two_s1, op("mul", n, c, dtype=f32), dtype=f32), dtype=f32),
                     dtype=f32)
        k2.members.append(Member(chain.total.buffer, "reduce", total, chain.total.store))
        k2.members.append(Member(chain.squares.buffer, "reduce", squares, chain.squares.store))

    def _stored(self, kernel: Kernel, m: Member, post: list[Member]) -> bool:
        post_reads = {ld.arg for p in post for ld in loads(p.body)}
        return bool(m.buffer.is_output or (self.readers.get(m.buffer.name, set()) - {kernel.name})
                    or m.buffer.name in post_reads)


def _from_inputs(body: Node, members: dict[str, Member]) -> Node | str:
    """`body` with every load of a buffer that one of `members` computes replaced by that
    member's body (cast to the buffer's dtype, as its store casts), recursively: the same value
    computed from the kernel's inputs alone, which any lane may evaluate at any index.  A reason
    string where a load of a member is not at the point the member writes (fusion never builds
    one) or is masked."""
    memo: dict[str, Node] = {}

    class _Refused(Exception):
        pass

    def inline(n: Node) -> Node:
        def fn(x: Node, args: tuple[Node, ...]) -> Node:
            if x.op == "load" and x.arg in members:
                m = members[x.arg]
                if len(x.args) != 1 or x.args[0] != m.store:
                    raise _Refused(f"reads {x.arg} away from where it is written")
                if x.arg not in memo:
                    memo[x.arg] = cast(inline(m.body), m.buffer.dtype)
                return cast(memo[x.arg], x.dtype)
            return x if args == x.args else Node(x.op, args, x.arg, x.dtype)
        return map_nodes(n, fn)

    try:
        return inline(body)
    except _Refused as e:
        return str(e)


def _read_elsewhere(kernel: Kernel) -> str:
    """Empty unless a member of `kernel` reads a buffer the kernel computes at another point than
    the one it is written at: that value is another lane's (thread's, program's) of the launch,
    and a GPU orders no store of one thread before another's load (fusion's _reads_ok rule,
    which the kernels made here must keep)."""
    written = {m.buffer.name: m.store for m in kernel.members}
    for m in kernel.members:
        for ld in loads(m.body):
            if ld.arg in written and ld.args[0] != written[ld.arg]:
                return f"{m.buffer.name} would read {ld.arg} of the same kernel away from where it is written"
    return ""


def _unflatten(flat: Node, order: list[int], inner: tuple[Node, ...], ranges: dict) -> dict[Node, Node]:
    """{y_j: its index} for a flat reduced index walking the dims in `order` (slowest first)."""
    out: dict[Node, Node] = {}
    rest = flat
    for pos, j in enumerate(reversed(order)):
        last = pos == len(order) - 1
        out[var(f"y{j}")] = rest if last else mod(rest, inner[j], ranges)
        rest = rest if last else floordiv(rest, inner[j], ranges)
    return out


def _mask_loads(body: Node, cond: Node, index_vars: tuple[str, ...] = ("x0", "y0")) -> Node:
    """Guard every load whose address walks the reduced index: the last chunk may pass R."""
    def fn(n: Node, args: tuple[Node, ...]) -> Node:
        if n.op == "load" and any(x.op == "var" and x.arg in index_vars for x in walk(args[0])):
            mask = cond if len(args) == 1 else op("and", args[1], cond, dtype=torch.bool)
            return Node("load", (args[0], mask), n.arg, n.dtype)
        return n if args == n.args else Node(n.op, args, n.arg, n.dtype)
    return map_nodes(body, fn)


def split_reductions(sched: Schedule, program: LoweredGraph, readers: dict[str, set[str]],
                     params: SplitParams) -> Schedule:
    """Replace each reduction kernel with few long rows by its split form (see module doc)."""
    splitter = _Splitter(program, readers, params)
    items: list = []
    refused = list(sched.refused)
    for item in sched.items:
        if not isinstance(item, Kernel) or item.kind != "reduction":
            items.append(item)
            continue
        reason = splitter.why_not(item)
        result = splitter.split(item) if not reason else reason
        if isinstance(result, str):
            log.debug("not splitting %s (%s): %s", item.name, ", ".join(item.origins), result)
            if not reason:      # few long rows, but this kernel cannot split: worth reporting
                refused.append(f"{item.name} ({', '.join(item.origins)}) not split: {result}")
            items.append(item)
        else:
            items += result
    return Schedule(items, refused)

