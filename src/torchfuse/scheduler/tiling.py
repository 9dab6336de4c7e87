"""Iteration spaces that are reshapes of each other: their common refinement.

Lowering realizes each buffer over its own shape, so a value viewed between two shapes
(attention's scores: [B*H, S, S] out of a bmm, [B, H, S, S] for the softmax, [B*H, S, S] again
for the next bmm) gives buffers whose loops differ only by how the same row-major elements are
grouped into dims.  Such buffers can share one loop nest: loop over the *common refinement*
(the coarsest shape both are merges of, e.g. [2, 3, 33, 33] for [6, 33, 33] and [2, 3, 33, 33]),
and write each shape's index vars as affine combinations of the refined vars
(i0 = x0 * 3 + x1).  No `//` or `%` appears, so loop merging (loops.py) and vectorization are
unaffected; a reshape that would need them ([4, 6] vs [6, 4]) has no refinement and is refused.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..ir.nodes import Node, _build, _factor_out, _terms, const, substitute, unit_move, var

Groups = list[list[int]]     # per dim of a shape: the refined dims it merges, outermost first


@dataclass
class Refinement:
    sizes: tuple[Node, ...]   # the refined dims, outermost first
    a: Groups                 # groups of the first shape's dims
    b: Groups                 # groups of the second shape's dims

    def boundary(self, groups: Groups, ndims: int) -> int:
        """The refined dim where dim `ndims` of a shape starts (its first `ndims` dims end)."""
        return sum(len(g) for g in groups[:ndims])


def _divide(n: Node, d: Node) -> Node | None:
    """n / d when d divides n exactly (constants, or a product of symbols with d as a factor)."""
    if n.op == "const" and d.op == "const":
        return const(n.arg // d.arg) if d.arg > 1 and n.arg % d.arg == 0 else None
    split = _factor_out(_terms(n), d)
    if split is None or split[1]:
        return None
    quotient = _build(split[0])
    # a quotient of 1 means n == d up to form: handled by the equality test, not by a split
    return None if quotient.op == "const" and quotient.arg in (0, 1) else quotient


def refine(a: tuple[Node, ...], b: tuple[Node, ...]) -> Refinement | None:
    """The common refinement of two shapes (without size-1 dims) of the same element count, or
    None when there is none (the counts differ, or a dim boundary of one shape falls inside a dim
    of the other at a point that is not a divisor, as in [4, 6] vs [6, 4]).

    Walks both shapes from the innermost dim: equal sizes are one refined dim; otherwise the
    larger size is split by the smaller one when it divides it."""
    if a == b:
        ident = [[j] for j in range(len(a))]
        return Refinement(a, ident, [list(g) for g in ident])
    if not a or not b or any(s.op == "const" and s.arg == 0 for s in a + b):
        return None       # (empty tensors: only literally equal shapes share loops)
    out: list[Node] = []                    # innermost first
    ga: Groups = []
    gb: Groups = []
    cur_a: list[int] = []
    cur_b: list[int] = []
    ia, ib = len(a) - 1, len(b) - 1
    ra, rb = a[ia], b[ib]                   # what is left of the current dim of each shape
    while True:
        done_a = done_b = False
        if ra == rb:
            piece, done_a, done_b = ra, True, True
        elif (q := _divide(ra, rb)) is not None:
            piece, ra, done_b = rb, q, True
        elif (q := _divide(rb, ra)) is not None:
            piece, rb, done_a = ra, q, True
        else:
            return None
        out.append(piece)
        cur_a.append(len(out) - 1)
        cur_b.append(len(out) - 1)
        if done_a:
            ga.append(cur_a)
            cur_a, ia = [], ia - 1
        if done_b:
            gb.append(cur_b)
            cur_b, ib = [], ib - 1
        if ia < 0 or ib < 0:
            break
        if done_a:
            ra = a[ia]
        if done_b:
            rb = b[ib]
    if ia >= 0 or ib >= 0 or cur_a or cur_b:
        return None
    n = len(out)
    flip = lambda groups: [sorted(n - 1 - j for j in g) for g in reversed(groups)]  # noqa: E731
    return Refinement(tuple(reversed(out)), flip(ga), flip(gb))


def kernel_var(j: int, nb: int) -> Node:
    """The kernel loop var of refined dim j when the inner (reduced) dims start at nb."""
    return var(f"x{j}") if j < nb else var(f"y{j - nb}")


def dim_exprs(sizes: tuple[Node, ...], groups: Groups, nb: int) -> list[Node]:
    """Per dim of a shape, its index as an affine expression of the refined kernel vars."""
    out: list[Node] = []
    for g in groups:
        e: Node = const(0)
        for j in g:
            e = e * sizes[j] + kernel_var(j, nb)
        out.append(e)
    return out


def kernel_ranges(sizes: tuple[Node, ...], nb: int) -> dict[str, Node]:
    return {kernel_var(j, nb).arg: s for j, s in enumerate(sizes)}


def rewrite(n: Node, mapping: dict[Node, Node], ranges: dict[str, Node]) -> Node:
    """Substitute, simplifying a view's `i // d` and `i % d` against the refined loop sizes."""
    return substitute(n, mapping, ranges) if mapping else n


def stride_of(expr: Node, name: str) -> float:
    """The constant coefficient of var `name` in an affine index (inf if symbolic, 0 if absent)."""
    coef: float = 0
    for key, c in _terms(expr).items():
        if any(f.op == "var" and f.arg == name for f in key):
            coef = c if len(key) == 1 else float("inf")
    return coef


def step_of(expr: Node, name: str) -> float:
    """How far the address moves when var `name` goes from 0 to 1, the other vars at 0: the
    stride of an affine index, and also of an index that unflattens a split's chunk
    (((x0 * C + y0) // W) % H * S1 + (y0 % W) * S2 ...), whose terms hide y0 inside // and %
    (stride_of sees no y0 term there).  Falls back to stride_of when the index is symbolic."""
    step = unit_move(expr, name)
    return step if step is not None else stride_of(expr, name)
