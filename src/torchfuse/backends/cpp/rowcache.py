"""Per-row caches of a row kernel: a costly per-element value that two loops over the row compute
(a softmax's exp(x - max), summed by one loop and divided by the sum in the next) is stored into
a small array by the first loop and read back by the later ones, as Inductor does.  Recomputed,
the exp cost a softmax over rows of 1000 floats 1.4x Inductor's time; one store and one load per
element hit L1 (the array is one row, at most ROW_CACHE_BYTES, on the thread's stack).

The value read back is the one the first loop computed, so results are bit-for-bit those of
recomputing it.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from ...ir.nodes import Node, walk
from ...scheduler.loops import LoopPlan
from .common import CTYPE

if TYPE_CHECKING:
    from .codegen import Emitter

# ops worth a store and a load per element to compute once (a vector exp or erf is ~20-70
# instructions per vector; an add or a division is not worth the traffic)
COSTLY_OPS = frozenset({
    "exp", "exp2", "expm1", "log", "log2", "log10", "log1p", "tanh", "sigmoid", "erf", "erfc", "sin", "cos",
    "tan", "asin", "acos", "atan", "sinh", "cosh", "asinh", "acosh", "atanh", "lgamma", "pow", "atan2",
})
# all of a kernel's row arrays together: per thread, on its stack, and within L1/L2
ROW_CACHE_BYTES = 64 * 1024
_SIZES = {"float": 4, "double": 8, "int64_t": 8, "int32_t": 4, "int16_t": 2, "int8_t": 1, "uint8_t": 1, "bool": 1}


class RowCache:
    """Which values to cache and the code that declares, stores and reloads them.  A value is
    cached when it depends on the row's element (an inner var), contains a COSTLY_OPS op, and
    appears in the bodies of two or more loops over the row (reduce or inner stages); of a cached
    value and a part of it used in exactly the same loops, only the whole is cached."""

    def __init__(self, plan: LoopPlan):
        self.first: dict[Node, int] = {}        # value -> the stage that computes and stores it
        self.users: dict[Node, list[int]] = {}  # value -> the stages that read it back
        self.arrays: dict[Node, str] = {}
        self.length = 0
        inner_vars = {f"y{j}" for j in range(len(plan.inner))}
        if not plan.inner or any(s.op != "const" for s in plan.inner):
            return
        self.length = 1
        for s in plan.inner:
            self.length *= s.arg
        self.sizes = [s.arg for s in plan.inner]
        # per node: does it read the row's element, does it hold a costly op, may it be stored
        inner, costly, ok = set(), set(), set()
        order: dict[Node, None] = {}       # first appearance: the generated source is deterministic
        stage_nodes: dict[int, set[Node]] = {}
        for k, stage in enumerate(plan.stages):
            if stage.kind not in ("reduce", "inner"):
                continue
            nodes = stage_nodes[k] = set()
            for m in stage.members:
                for x in walk(m.body):          # operands before users
                    nodes.add(x)
                    order.setdefault(x)
                    if (x.op == "var" and x.arg in inner_vars) or any(a in inner for a in x.args):
                        inner.add(x)
                    if x.op in COSTLY_OPS or any(a in costly for a in x.args):
                        costly.add(x)
                    if x.op not in ("check_index", "checked") and x.dtype in CTYPE and \
                            all(a in ok or a.op in ("const", "var", "sym") for a in x.args):
                        ok.add(x)
        candidates: dict[Node, tuple[int, ...]] = {}
        for n in (x for x in order if x in inner and x in costly and x in ok):
            stages = tuple(k for k in sorted(stage_nodes) if n in stage_nodes[k])
            if len(stages) >= 2:
                candidates[n] = stages
        # keep the largest values: drop a part used in exactly the same loops as a whole holding it
        parts = {p: set(walk(p)) - {p} for p in candidates}
        keep = [n for n, st in candidates.items() if not any(n in parts[p] and st == candidates[p] for p in candidates)]
        budget = ROW_CACHE_BYTES
        for n in sorted(keep, key=lambda x: candidates[x][0]):
            size = self.length * _SIZES.get(CTYPE[n.dtype], 8)
            if size > budget:
                continue
            budget -= size
            self.first[n] = candidates[n][0]
            self.users[n] = candidates[n][1:]
            self.arrays[n] = f"tf_row{len(self.arrays)}"

    def __bool__(self) -> bool:
        return bool(self.arrays)

    def declare(self, em: "Emitter") -> None:
        """The arrays, inside the row loop (private to the thread that runs the row)."""
        for n, name in self.arrays.items():
            em.line(f"alignas(64) {CTYPE[n.dtype]} {name}[{self.length}];")

    def _flat(self) -> str:
        flat = "y0"
        for j in range(1, len(self.sizes)):
            flat = f"({flat} * (int64_t){self.sizes[j]} + y{j})"
        return flat

    def reload(self, em: "Emitter", stage: int) -> None:
        """At the top of a later loop's body: the values it reads back, bound for the body's CSE."""
        for n, users in self.users.items():
            if stage in users:
                em.bind(n, em.tmp(f"{self.arrays[n]}[{self._flat()}]", n.dtype))

    def store(self, em: "Emitter", stage: int) -> None:
        """At the end of the first loop's body: the values it computed."""
        for n, first in self.first.items():
            if first == stage:
                em.line(f"{self.arrays[n]}[{self._flat()}] = {em.value(n)};")

