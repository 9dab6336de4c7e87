"""What the C++ and Triton emitters share: turning Node DAGs into statements with CSE.

Every distinct sub-expression becomes one temporary in the innermost scope where it is first
needed; a loop body opens a scope, so temporaries never leak out of the loop that made them.
A buffer that a kernel computes itself is read from its local variable (`bind_local`), so a
fused intermediate that is never stored is never loaded either.  Backends supply the syntax.

Constants come in two kinds, because index arithmetic and int64 values share one dtype (INDEX
is int64): a constant in index arithmetic (`index()`: offsets, sizes) is an `index_literal`,
which a backend may print as a bare number; a constant reached through `value()` is a value
of its own dtype wherever it goes (a store, a cast, a select, a comparison, a min/max, a
reduction), so `literal` must print a typed value.  A bare int64 there was a Python int in
Triton, which has no `.to()` (`0.to(tl.int64)` does not parse) and no shape.
"""
from __future__ import annotations

import torch

from ..ir.nodes import INDEX, Node


class ExprEmitter:
    INDENT = "  "
    FLOORDIV = "/"       # index math is on non-negative ints, where C's / and Python's // agree

    def __init__(self, buffers: dict[str, torch.dtype], indent: int = 1):
        self.buffers = buffers
        self.lines: list[str] = []
        self.indent = indent
        self.scopes: list[dict[Node, str]] = [{}]
        self.locals: list[dict[tuple[str, Node], str]] = [{}]
        self.count = 0

    # -- backend syntax ---------------------------------------------------------------------------
    def literal(self, value, dtype: torch.dtype) -> str:
        """`value` as a typed value of `dtype` (never a bare number a backend could mistype)."""
        raise NotImplementedError

    def index_literal(self, value: int) -> str:
        """An integer constant of index arithmetic."""
        return self.literal(value, INDEX)

    def declare(self, name: str, expr: str, dtype: torch.dtype | None) -> str:
        raise NotImplementedError

    def masked(self, mask: str, value: str, dtype: torch.dtype) -> str:
        """`value` where `mask` holds, else 0 (for a masked load served from a local)."""
        raise NotImplementedError

    def _expr(self, n: Node) -> str:
        raise NotImplementedError

    # -- shared machinery -------------------------------------------------------------------------
    def line(self, text: str) -> None:
        self.lines.append(self.INDENT * self.indent + text)

    def push(self) -> None:
        self.scopes.append({})
        self.locals.append({})

    def pop(self) -> None:
        self.scopes.pop()
        self.locals.pop()

    def bind(self, n: Node, name: str) -> None:
        """`n`'s value is `name` in the current scope: `value(n)` returns it until the scope is popped."""
        self.scopes[-1][n] = name

    def bind_local(self, buffer: str, index: Node, name: str) -> None:
        self.locals[-1][(buffer, index)] = name

    def local_of(self, load: Node) -> str | None:
        key = (load.arg, load.args[0])
        for scope in reversed(self.locals):
            if key in scope:
                return scope[key]
        return None

    def tmp(self, expr: str, dtype: torch.dtype | None = None) -> str:
        name = f"t{self.count}"
        self.count += 1
        self.line(self.declare(name, expr, dtype))
        return name

    def index(self, n: Node) -> str:
        """Index arithmetic is printed inline (the backend compiler does strength reduction)."""
        if n.op == "const":
            return self.index_literal(n.arg)
        if n.op in ("var", "sym"):
            return n.arg
        if n.op == "add":
            return "(" + " + ".join(self.index(a) for a in n.args) + ")"
        if n.op == "mul":
            return "(" + " * ".join(self.index(a) for a in n.args) + ")"
        if n.op == "floordiv":
            return f"({self.index(n.args[0])} {self.FLOORDIV} {self.index(n.args[1])})"
        if n.op == "mod":
            return f"({self.index(n.args[0])} % {self.index(n.args[1])})"
        return self.value(n)

    def value(self, n: Node) -> str:
        if n.op == "const":
            return self.literal(n.arg, n.dtype)
        if n.op in ("var", "sym"):
            return n.arg
        for scope in reversed(self.scopes):
            if n in scope:
                return scope[n]
        local = self.local_of(n) if n.op == "load" else None
        if local is not None and len(n.args) == 1:
            return local
        expr = self.masked(self.value(n.args[1]), local, n.dtype) if local is not None else self._expr(n)
        name = self.tmp(expr, n.dtype)
        self.scopes[-1][n] = name
        return name
