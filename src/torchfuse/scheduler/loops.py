"""Backend-neutral loop planning for one kernel: dim merging, stages, and which buffers to store.

* Dim merging: adjacent loop dims are merged when every memory access stays affine (no new
  `//` or `%` appears).  A contiguous elementwise kernel becomes one flat loop; a bias-add keeps
  two loops so the inner one stays contiguous.
* Dim splitting (C++ only): the vectorized (innermost) loop dim is split in two when its accesses
  unflatten it with `// c` and `% c` (a view that flattened heads and head_dim, read next to a
  table broadcast over heads): the inner loop of c then addresses memory affinely and
  vectorizes, where the flat loop was a gather per lane.
* Stages: a reduction kernel runs, per outer point, a sequence of stages; independent
  reductions over the same rows share one pass over the data.
* Stores: a member is written to memory only when something outside its own loop reads it.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field

from ..ir.nodes import Node, add, const, floordiv, loads, mod, mul, substitute, var, walk
from .fusion import Kernel, Member
from .tiling import step_of, stride_of

log = logging.getLogger("torchfuse.loops")


@dataclass
class Stage:
    kind: str                       # "reduce" (loop over inner, accumulate), "inner" (loop over inner), "outer"
    members: list[Member] = field(default_factory=list)


@dataclass
class LoopPlan:
    kernel: Kernel
    outer: tuple[Node, ...]          # merged outer sizes (vars x0..)
    inner: tuple[Node, ...]          # merged inner sizes (vars y0..)
    members: list[Member]            # bodies/stores rewritten to the merged vars
    stages: list[Stage]
    stored: set[str]                 # buffer names written to memory
    ranges: dict[str, Node]          # var name -> size
    # of those, the ones stored only so that a later loop over the row reads them back (nothing
    # outside the kernel does): a kernel that holds the whole row in registers skips their store
    carried: set[str] = field(default_factory=set)


def _count_divmod(members: list[Member]) -> int:
    total = 0
    for m in members:
        for e in [m.store] + [ld.args[0] for ld in loads(m.body)]:
            total += sum(1 for n in walk(e) if n.op in ("floordiv", "mod"))
    return total


def _rewrite(members: list[Member], mapping: dict[Node, Node], ranges: dict[str, Node]) -> list[Member]:
    return [Member(m.buffer, m.role, substitute(m.body, mapping, ranges), substitute(m.store, mapping, ranges))
            for m in members]


def _merge_dims(members: list[Member], sizes: tuple[Node, ...], prefix: str,
                other: dict[str, Node]) -> tuple[list[Member], tuple[Node, ...]]:
    """Greedily merge adjacent dims (from the innermost) while no access gets div/mod."""
    sizes = list(sizes)
    k = len(sizes) - 2
    while k >= 0 and len(sizes) > 1:
        merged = sizes[k] * sizes[k + 1]
        new_sizes = sizes[:k] + [merged] + sizes[k + 2:]
        ranges = dict(other)
        ranges.update({f"{prefix}{j}": s for j, s in enumerate(new_sizes)})
        m = var(f"{prefix}__m")
        mapping = {var(f"{prefix}{k}"): floordiv(m, sizes[k + 1]), var(f"{prefix}{k + 1}"): mod(m, sizes[k + 1])}
        # vars after the merged pair shift down by one
        for j in range(k + 2, len(sizes)):
            mapping[var(f"{prefix}{j}")] = var(f"{prefix}{j - 1}__t")
        ranges[f"{prefix}__m"] = merged
        for j in range(k + 2, len(sizes)):
            ranges[f"{prefix}{j - 1}__t"] = sizes[j]
        trial = _rewrite(members, mapping, ranges)
        if _count_divmod(trial) <= _count_divmod(members):
            rename = {m: var(f"{prefix}{k}")}
            for j in range(k + 2, len(sizes)):
                rename[var(f"{prefix}{j - 1}__t")] = var(f"{prefix}{j - 1}")
            final_ranges = dict(other)
            final_ranges.update({f"{prefix}{j}": s for j, s in enumerate(new_sizes)})
            members = _rewrite(trial, rename, final_ranges)
            sizes = new_sizes
        k -= 1
    return members, tuple(sizes)


# A split leaves an inner loop of c; below a vector's lanes it would not pay for itself.
_MIN_SPLIT = 8


def _divisors_used(members: list[Member], name: str, size: int) -> set[int]:
    """Constant divisors c of `size` with which an access unflattens var `name` (`... // c`, `... % c`)."""
    found: set[int] = set()
    for m in members:
        for e in (m.store, m.body):          # (the body holds its loads' indices)
            for n in walk(e):
                if n.op in ("floordiv", "mod") and n.args[1].op == "const":
                    c = n.args[1].arg
                    if isinstance(c, int) and _MIN_SPLIT <= c < size and size % c == 0 and \
                            any(f.op == "var" and f.arg == name for f in walk(n.args[0])):
                        found.add(c)
    return found


def _split_innermost(members: list[Member], sizes: tuple[Node, ...], prefix: str,
                     other: dict[str, Node]) -> tuple[list[Member], tuple[Node, ...]]:
    """Split the innermost dim (size S) into (S // c, c) while that removes div/mod from the
    accesses; c is the divisor that removes the most."""
    sizes = list(sizes)
    while sizes and sizes[-1].op == "const":
        k, size = len(sizes) - 1, sizes[-1].arg
        name = f"{prefix}{k}"
        base = _count_divmod(members)
        best: tuple[int, int, list[Member]] | None = None
        for c in sorted(_divisors_used(members, name, size)):
            ranges = dict(other)
            ranges.update({f"{prefix}{j}": s for j, s in enumerate(sizes[:-1])})
            ranges.update({f"{prefix}__hi": const(size // c), f"{prefix}__lo": const(c)})
            mapping = {var(name): add(mul(var(f"{prefix}__hi"), c), var(f"{prefix}__lo"))}
            trial = _rewrite(members, mapping, ranges)
            count = _count_divmod(trial)
            if count < base and (best is None or count < best[0]):
                best = (count, c, trial)
        if best is None:
            break
        count, c, trial = best
        log.debug("split loop %s (%d) into %d x %d: div/mod in accesses %d -> %d", name, size, size // c, c, base, count)
        sizes = sizes[:-1] + [const(size // c), const(c)]
        final = dict(other)
        final.update({f"{prefix}{j}": s for j, s in enumerate(sizes)})
        members = _rewrite(trial, {var(f"{prefix}__hi"): var(name), var(f"{prefix}__lo"): var(f"{prefix}{k + 1}")},
                           final)
    return members, tuple(sizes)


def _reorder_outer(members: list[Member], sizes: tuple[Node, ...]) -> tuple[list[Member], tuple[Node, ...]]:
    """Loop over the outer dims in the order of the output's memory layout (innermost = smallest
    stride), so a channels-last or transposed output is written contiguously."""
    ref = next((m for m in members if m.role in ("pointwise", "inner")), None)
    if ref is None or len(sizes) < 2:
        return members, sizes
    strides = [stride_of(ref.store, f"x{k}") for k in range(len(sizes))]
    order = sorted(range(len(sizes)), key=lambda k: -strides[k])
    if order == list(range(len(sizes))):
        return members, sizes
    mapping = {var(f"x{old}"): var(f"x{new}__o") for new, old in enumerate(order)}
    rename = {var(f"x{new}__o"): var(f"x{new}") for new in range(len(order))}
    members = [Member(m.buffer, m.role, substitute(substitute(m.body, mapping), rename),
                      substitute(substitute(m.store, mapping), rename)) for m in members]
    return members, tuple(sizes[k] for k in order)


def plan_loops(kernel: Kernel, readers: dict[str, set[str]], *, merge: bool = True,
               split: bool = False) -> LoopPlan:
    """`split` splits the vectorized dim where that makes its accesses affine (the C++ backend,
    whose vectorizer needs affine addresses; Triton computes any index per lane)."""
    members = list(kernel.members)
    outer, inner = kernel.outer, kernel.inner
    if kernel.kind == "pointwise":
        members, outer = _reorder_outer(members, outer)
    if merge:
        inner_ranges = {f"y{j}": s for j, s in enumerate(inner)}
        members, outer = _merge_dims(members, outer, "x", inner_ranges)
        outer_ranges = {f"x{j}": s for j, s in enumerate(outer)}
        members, inner = _merge_dims(members, inner, "y", outer_ranges)
    if split:
        if kernel.kind == "pointwise":
            members, outer = _split_innermost(members, outer, "x", {f"y{j}": s for j, s in enumerate(inner)})
        else:
            members, inner = _split_innermost(members, inner, "y", {f"x{j}": s for j, s in enumerate(outer)})
    ranges = {f"x{j}": s for j, s in enumerate(outer)}
    ranges.update({f"y{j}": s for j, s in enumerate(inner)})

    stages: list[Stage] = []
    for m in members:
        kind = "outer" if m.role == "outer" else "reduce" if m.role == "reduce" else "inner"
        if kernel.kind == "pointwise":
            kind = "inner"
        last = stages[-1] if stages else None
        # inside one elementwise loop a member may read another at the same point; a reduction
        # stage may not read a sibling's accumulator before the loop ends
        if last is not None and last.kind == kind and kind != "outer" and (kind == "inner" or not _depends(m, last)):
            last.members.append(m)
        else:
            stages.append(Stage(kind, [m]))

    # A member must be stored if anything other than its own stage reads it.
    stage_of = {m.buffer.name: i for i, s in enumerate(stages) for m in s.members}
    stored: set[str] = set()
    carried: set[str] = set()
    for m in members:
        name = m.buffer.name
        outside = readers.get(name, set()) - {kernel.name}
        if outside or m.buffer.is_output or m.buffer.scatter is not None:
            stored.add(name)
            continue
        for i, s in enumerate(stages):
            for other in s.members:
                if any(ld.arg == name for ld in loads(other.body)):
                    same_loop = i == stage_of[name] and s.kind != "reduce"
                    scalar = m.role in ("reduce", "outer")   # per-row values live in a local variable
                    if not same_loop and not scalar:
                        stored.add(name)
                        carried.add(name)
    return LoopPlan(kernel, outer, inner, members, stages, stored, ranges, carried)


def _depends(m: Member, stage: Stage) -> bool:
    names = {o.buffer.name for o in stage.members}
    return any(ld.arg in names for ld in loads(m.body))


def rows_contiguous(plan: LoopPlan) -> bool:
    """True for a reduction whose input is contiguous across rows, not along them (column sums:
    x.sum(0), the partial kernel of a split column sum): a [XBLOCK, RBLOCK] tile with several
    rows then reads whole sectors, where one row per program reads one element per sector."""
    if plan.kernel.kind != "reduction" or not plan.outer or not plan.inner:
        return False
    return reads_columns(len(plan.outer), len(plan.inner), plan.members)


def reads_columns(n_outer: int, n_inner: int, members: list) -> bool:
    """Does a reduce member load along the reduced dims with a stride while its neighbouring
    rows are adjacent in memory?  (Loads that do not move with the rows, a per-row scale
    broadcast across columns, say nothing about coalescing.)  The split pass sizes a reduction's
    programs with this same test, so it counts the column tiles the code generator makes."""
    last_x, last_y = f"x{n_outer - 1}", f"y{n_inner - 1}"
    for m in members:
        if m.role == "reduce":
            for ld in loads(m.body):
                if step_of(ld.args[0], last_y) not in (0, 1) and step_of(ld.args[0], last_x) == 1:
                    return True
    return False
