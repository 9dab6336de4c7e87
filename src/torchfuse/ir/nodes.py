"""The one IR node type: an immutable scalar expression evaluated at one point of a loop nest.

Everything in the loop IR is a `Node`: index arithmetic (`var`, `sym`, `const`, `add`, `mul`,
`floordiv`, `mod`), memory access (`load`), and value math (`exp`, `where`, `cast`, ...).
Index expressions are ordinary int64 nodes, so an indirect load (embedding, gather) is simply a
`load` whose index contains another `load`.  Nodes are hash-consed by value and print as C-like
text, so a kernel body reads like a program.
"""
from __future__ import annotations

import functools
from typing import Any, Callable, Iterable, Mapping

import torch

INDEX = torch.int64

# Ops whose value is the same as a C/Triton expression of their arguments and that cost little.
UNARY_OPS = {
    "neg", "abs", "exp", "exp2", "expm1", "log", "log2", "log10", "log1p", "sqrt", "rsqrt",
    "sin", "cos", "tan", "asin", "acos", "atan", "sinh", "cosh", "tanh", "asinh", "acosh", "atanh",
    "sigmoid", "erf", "erfc", "erfinv", "lgamma", "digamma", "ceil", "floor", "round", "trunc",
    "frac", "sign", "signbit", "reciprocal", "isnan", "isinf", "isfinite", "not", "bitnot",
    "relu", "square",
}
BINARY_OPS = {
    "add", "sub", "mul", "truediv", "floordiv", "mod", "remainder", "fmod", "pow", "atan2",
    "maximum", "minimum", "fmax", "fmin", "eq", "ne", "lt", "le", "gt", "ge", "and", "or", "xor",
    "bitand", "bitor", "bitxor", "lshift", "rshift", "copysign", "hypot", "nextafter",
}
EXPENSIVE_OPS = {"exp", "exp2", "expm1", "log", "log2", "log10", "log1p", "sin", "cos", "tan", "asin",
                 "acos", "atan", "sinh", "cosh", "tanh", "asinh", "acosh", "atanh", "sigmoid", "erf",
                 "erfc", "erfinv", "lgamma", "digamma", "pow", "atan2", "truediv", "sqrt", "rsqrt",
                 "hypot", "fmod", "remainder"}


class Node:
    """An immutable expression node: `op(args...)` with an optional literal `arg` and a dtype.

    op      what the node computes ("load", "add", "const", "var", ...)
    args    operand nodes
    arg     literal payload: a constant value, a variable/buffer/symbol name, a target dtype
    dtype   the torch dtype of the value
    """

    __slots__ = ("op", "args", "arg", "dtype", "_hash", "_text")

    def __init__(self, op: str, args: tuple["Node", ...] = (), arg: Any = None, dtype: torch.dtype = INDEX):
        self.op = op
        self.args = args
        self.arg = arg
        self.dtype = dtype
        self._hash = hash((op, args, arg if not isinstance(arg, float) or arg == arg else "nan", dtype))
        self._text: str | None = None

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other: object) -> bool:
        if self is other:
            return True
        if not isinstance(other, Node) or self._hash != other._hash:
            return False
        if self.op != other.op or self.dtype != other.dtype or self.args != other.args:
            return False
        a, b = self.arg, other.arg
        if isinstance(a, float) and isinstance(b, float) and a != a and b != b:
            return True   # two NaN constants are the same node
        return type(a) is type(b) and a == b

    def __repr__(self) -> str:
        return to_text(self)

    # Convenience constructors for index arithmetic; they simplify as they build.
    def __add__(self, other: "Node | int") -> "Node":
        return add(self, other)

    __radd__ = __add__

    def __mul__(self, other: "Node | int") -> "Node":
        return mul(self, other)

    __rmul__ = __mul__

    def __sub__(self, other: "Node | int") -> "Node":
        return add(self, mul(other, -1))

    def __floordiv__(self, other: "Node | int") -> "Node":
        return floordiv(self, other)

    def __mod__(self, other: "Node | int") -> "Node":
        return mod(self, other)


# --------------------------------------------------------------------------------------------
# constructors
# --------------------------------------------------------------------------------------------

_INDEX_CONSTS: dict[int, Node] = {}   # index constants, made once: index arithmetic makes ~100K a graph
_INDEX_CONSTS_LIMIT = 1 << 16


def const(value: Any, dtype: torch.dtype = INDEX) -> Node:
    if dtype is INDEX and type(value) is int:
        node = _INDEX_CONSTS.get(value)
        if node is None:
            node = Node("const", (), value, INDEX)
            if len(_INDEX_CONSTS) < _INDEX_CONSTS_LIMIT:
                _INDEX_CONSTS[value] = node
        return node
    if dtype == torch.bool:
        value = bool(value)
    elif dtype.is_floating_point:
        value = float(value)
    elif not dtype.is_complex:
        value = int(value)
    return Node("const", (), value, dtype)


def var(name: str) -> Node:
    return Node("var", (), name, INDEX)


def sym(name: str) -> Node:
    """A size known only at run time (a Dynamo symbol such as s0); passed to kernels as an argument."""
    return Node("sym", (), name, INDEX)


def as_node(x: "Node | int") -> Node:
    return x if isinstance(x, Node) else const(int(x))


def is_const(n: Node, value: Any = None) -> bool:
    return n.op == "const" and (value is None or n.arg == value)


def load(buffer: str, index: Node, dtype: torch.dtype) -> Node:
    return Node("load", (index,), buffer, dtype)


def op(name: str, *args: Node, dtype: torch.dtype) -> Node:
    return Node(name, tuple(args), None, dtype)


def cast(x: Node, dtype: torch.dtype) -> Node:
    if x.dtype == dtype:
        return x
    if x.op == "const" and not dtype.is_complex:
        v = x.arg
        if dtype == torch.bool:
            return const(bool(v), dtype)
        if not dtype.is_floating_point:
            if isinstance(v, float) and (v != v or v in (float("inf"), float("-inf"))):
                return Node("cast", (x,), dtype, dtype)
            return const(int(v), dtype) if dtype not in (torch.uint8, torch.int8) else Node("cast", (x,), dtype, dtype)
        if dtype in (torch.float32, torch.float64):
            return const(float(v), dtype)
    return Node("cast", (x,), dtype, dtype)


def where(cond: Node, a: Node, b: Node) -> Node:
    if cond.op == "const":
        return a if cond.arg else b
    if a == b:
        return a
    return Node("where", (cond, a, b), None, a.dtype)


# --------------------------------------------------------------------------------------------
# index arithmetic with on-the-fly canonicalisation (sum of products form)
# --------------------------------------------------------------------------------------------

_TERMS: dict[Node, dict[tuple[Node, ...], int]] = {}
_TERMS_LIMIT = 1 << 17


def _terms(n: Node) -> dict[tuple[Node, ...], int]:
    """Write an int expression as {sorted factor tuple: coefficient}; () is the constant term.
    Sums and products are remembered (index arithmetic rebuilds the same ones over and over:
    a third of a BERT graph's lowering time); the returned dict is shared, so read it only."""
    if n.op not in ("add", "mul"):
        return _expand(n)
    out = _TERMS.get(n)
    if out is None:
        if len(_TERMS) >= _TERMS_LIMIT:
            _TERMS.clear()
        out = _TERMS[n] = _expand(n)
    return out


def _expand(n: Node) -> dict[tuple[Node, ...], int]:
    if n.op == "const":
        return {(): int(n.arg)} if n.arg else {}
    if n.op == "add":
        out: dict[tuple[Node, ...], int] = {}
        for a in n.args:
            for k, v in _terms(a).items():
                out[k] = out.get(k, 0) + v
        return {k: v for k, v in out.items() if v}
    if n.op == "mul":
        out = {(): 1}
        for a in n.args:
            nxt: dict[tuple[Node, ...], int] = {}
            for k1, v1 in out.items():
                for k2, v2 in _terms(a).items():
                    key = tuple(sorted(k1 + k2, key=_order))
                    nxt[key] = nxt.get(key, 0) + v1 * v2
            out = {k: v for k, v in nxt.items() if v}
        return out
    return {(n,): 1}


def _order(n: Node) -> tuple:
    return (n.op != "sym", n.op != "var", to_text(n))


def _build(terms: Mapping[tuple[Node, ...], int]) -> Node:
    parts: list[Node] = []
    constant = 0
    for key in sorted(terms, key=lambda k: [_order(f) for f in k]):
        coef = terms[key]
        if not key:
            constant += coef
            continue
        factors = list(key)
        if coef != 1:
            factors.append(const(coef))
        parts.append(factors[0] if len(factors) == 1 else Node("mul", tuple(factors), None, INDEX))
    if constant:
        parts.append(const(constant))
    if not parts:
        return const(0)
    return parts[0] if len(parts) == 1 else Node("add", tuple(parts), None, INDEX)


# Sums and products already simplified, by operands: a model's layers build the same index
# expressions again and again, and simplifying one (`_merge_divmod`) costs far more than a lookup
# (half of a 22-layer Llama training graph's lowering).
_SIMPLIFIED: dict[tuple[str, Node, Node], Node] = {}


def _simplified(op: str, a: Node, b: Node) -> Node:
    key = (op, a, b)
    out = _SIMPLIFIED.get(key)
    if out is None:
        if len(_SIMPLIFIED) >= _TERMS_LIMIT:
            _SIMPLIFIED.clear()
        out = _SIMPLIFIED[key] = _merge_divmod(_build(_terms(Node(op, (a, b), None, INDEX))))
    return out


def add(a: "Node | int", b: "Node | int") -> Node:
    a, b = as_node(a), as_node(b)
    if a.dtype != INDEX or b.dtype != INDEX:
        raise TypeError("index add on non-index nodes")
    return _simplified("add", a, b)


def mul(a: "Node | int", b: "Node | int") -> Node:
    a, b = as_node(a), as_node(b)
    return _simplified("mul", a, b)


def _factor_out(terms: dict[tuple[Node, ...], int], d: Node) -> tuple[dict, dict] | None:
    """Split `terms` into (terms divisible by d, divided) and the remainder terms."""
    dterms = _terms(d)
    divisible: dict[tuple[Node, ...], int] = {}
    rest: dict[tuple[Node, ...], int] = {}
    if len(dterms) != 1:
        return None
    (dkey, dcoef), = dterms.items()
    for key, coef in terms.items():
        remaining = list(key)
        ok = coef % dcoef == 0
        if ok:
            for f in dkey:
                if f in remaining:
                    remaining.remove(f)
                else:
                    ok = False
                    break
        if ok:
            divisible[tuple(remaining)] = divisible.get(tuple(remaining), 0) + coef // dcoef
        else:
            rest[key] = coef
    return divisible, rest


def upper_bound(n: Node, ranges: Mapping[str, Node] | None = None) -> Node | None:
    """An exclusive upper bound of a non-negative index expression, or None if unknown.

    Vars are bounded by their loop size; `x % d` by d; sums of `coef * bounded` terms by
    interval arithmetic when everything is constant.
    """
    if n.op == "const":
        return const(n.arg + 1) if n.arg >= 0 else None
    if n.op == "var":
        return ranges.get(n.arg) if ranges else None
    if n.op == "mod":
        return n.args[1]
    if n.op in ("add", "mul", "floordiv"):
        lo_hi = _int_interval(n, ranges)
        if lo_hi and lo_hi[0] >= 0:
            return const(lo_hi[1] + 1)
        return _symbolic_sum_bound(n, ranges) if n.op != "floordiv" else None
    return None


def _symbolic_sum_bound(n: Node, ranges: Mapping[str, Node] | None) -> Node | None:
    """1 + sum(coef * (size(var) - 1)) for a sum of positive `coef * sizes... * var` terms with
    symbolic loop sizes: for a mixed-radix index (x0 + s1*x1 + s1*s2*x2) it simplifies to the
    product of the sizes, which is what proves `idx // (s0*s1*s2)` is 0 under dynamic shapes."""
    if not ranges:
        return None
    bound = const(1)
    for key, coef in _terms(n).items():
        if coef <= 0:
            return None
        loop_vars = [f for f in key if f.op == "var"]
        if not key:
            bound = bound + coef
            continue
        if len(loop_vars) != 1 or any(f.op not in ("var", "sym") for f in key):
            return None
        size = ranges.get(loop_vars[0].arg)
        if size is None:
            return None
        scale = const(coef)
        for f in key:
            if f.op == "sym":
                scale = scale * f
        bound = bound + scale * (size - 1)
    return bound


def _int_interval(n: Node, ranges: Mapping[str, Node] | None) -> tuple[int, int] | None:
    if n.op == "const":
        return (n.arg, n.arg)
    if n.op == "var":
        size = ranges.get(n.arg) if ranges else None
        return (0, size.arg - 1) if size is not None and size.op == "const" else None
    if n.op == "mod" and n.args[1].op == "const":
        return (0, n.args[1].arg - 1)
    if n.op == "floordiv" and n.args[1].op == "const" and n.args[1].arg > 0:
        inner = _int_interval(n.args[0], ranges)
        return (inner[0] // n.args[1].arg, inner[1] // n.args[1].arg) if inner else None
    if n.op in ("add", "mul"):
        parts = [_int_interval(a, ranges) for a in n.args]
        if any(p is None for p in parts):
            return None
        lo, hi = parts[0]
        for plo, phi in parts[1:]:
            if n.op == "add":
                lo, hi = lo + plo, hi + phi
            else:
                cands = [lo * plo, lo * phi, hi * plo, hi * phi]
                lo, hi = min(cands), max(cands)
        return (lo, hi)
    return None


def _provably_below(n: Node, d: Node, ranges: Mapping[str, Node] | None) -> bool:
    """True when 0 <= n < d is certain."""
    if n.op == "const" and n.arg == 0:
        return True
    ub = upper_bound(n, ranges)
    if ub is None:
        return False
    if ub == d:
        return True
    return ub.op == "const" and d.op == "const" and ub.arg <= d.arg and _nonneg(n, ranges)


def _nonneg(n: Node, ranges: Mapping[str, Node] | None) -> bool:
    iv = _int_interval(n, ranges)
    return iv is not None and iv[0] >= 0


def _sum_nonneg(terms: Mapping[tuple[Node, ...], int]) -> bool:
    """Every term is a positive coefficient times non-negative index factors."""
    return all(c > 0 and all(f.op in ("var", "sym", "mod", "floordiv") for f in key) for key, c in terms.items())


def floordiv(a: "Node | int", d: "Node | int", ranges: Mapping[str, Node] | None = None) -> Node:
    a, d = as_node(a), as_node(d)
    if is_const(d, 1):
        return a
    if a.op == "const" and d.op == "const":
        return const(a.arg // d.arg)
    split = _factor_out(_terms(a), d)
    if split is not None:
        divisible, rest = split
        rest_node = _build(rest)
        if _provably_below(rest_node, d, ranges):
            return _build(divisible)
        if divisible and rest and _sum_nonneg(divisible) and _sum_nonneg(rest):
            # (d*q + r) // d = q + r // d for non-negative q and r (C's / truncates): a split
            # reduction's chunk index (x0*3136 + y0) // 28 becomes x0*112 + y0 // 28
            return add(_build(divisible), floordiv(rest_node, d, ranges))
    if a.op == "floordiv" and d.op == "const" and a.args[1].op == "const":
        return floordiv(a.args[0], a.args[1].arg * d.arg, ranges)
    part = _split_by_step(a, d, ranges)
    if part is not None:            # (c*q + r) // (c*k) = q // k when 0 <= r < c
        q, _, c, k = part
        return floordiv(q, k, ranges)
    return Node("floordiv", (a, d), None, INDEX)


def _split_by_step(a: Node, d: Node, ranges: Mapping[str, Node] | None
                   ) -> tuple[Node, Node, int, Node] | None:
    """(q, r, c, k) with a = c*q + r, 0 <= r < c, d = c*k, c > 1: the flat index of a view
    whose rows are c apart (x0*3072 + x1 over [2048, 3072], d = 512*3072).  d may be a constant
    times size symbols (d = s0*512 with symbolic sizes: the same view of a batch of s0 rows);
    k is then that product, positive since size symbols are >= 2."""
    if a.op != "add":
        return None
    dterms = _terms(d)
    if len(dterms) != 1:
        return None
    (dkey, dcoef), = dterms.items()
    if dcoef <= 1 or not all(f.op == "sym" and str(f.arg).startswith("s") for f in dkey):
        return None
    terms = _terms(a)
    if not _sum_nonneg(terms):
        return None
    for c in sorted({abs(coef) for coef in terms.values()}, reverse=True):
        if c <= 1 or dcoef % c or (c == dcoef and not dkey):
            continue
        big = {k: v // c for k, v in terms.items() if v % c == 0}
        small = {k: v for k, v in terms.items() if v % c}
        if small and _provably_below(_build(small), const(c), ranges):
            return _build(big), _build(small), c, _build({dkey: dcoef // c})
    return None


def mod(a: "Node | int", d: "Node | int", ranges: Mapping[str, Node] | None = None) -> Node:
    a, d = as_node(a), as_node(d)
    if is_const(d, 1):
        return const(0)
    if a.op == "const" and d.op == "const":
        return const(a.arg % d.arg)
    split = _factor_out(_terms(a), d)
    if split is not None:
        _, rest = split
        rest_node = _build(rest)
        if _provably_below(rest_node, d, ranges):
            return rest_node
        if rest_node != a and _sum_nonneg(rest):
            # dropping multiples of d is only sound when C's % still sees a non-negative dividend
            a = rest_node
    if _provably_below(a, d, ranges):
        return a
    part = _split_by_step(a, d, ranges)
    if part is not None:            # (c*q + r) % (c*k) = c*(q % k) + r when 0 <= r < c
        q, r, c, k = part
        return add(mul(mod(q, k, ranges), c), r)
    return Node("mod", (a, d), None, INDEX)


def _merge_divmod(n: Node) -> Node:
    """Rewrite `C*d*(m // d) + C*(m % d)` into `C*m`: the inverse of splitting one loop in two.
    Repeated, it undoes a view's unflattening of one index into several dims
    (`((x // 14) % 14)*14*k + (x // 196)*196*k + (x % 14)*k` is `x*k`), which lets a consumer
    that reads a reshaped buffer see that it reads element for element what it writes.

    C is everything multiplying `m % d` (all the terms holding it, summed), and `C*d*(m // d)` is
    matched term by term after expansion: a divisor that is a sum (a strided conv's output size
    (s0 - 1) // 2 + 1), or equal sizes whose product expands into several terms (a square map,
    w*w = q*q + 2q + 1), merge too."""
    if n.op != "add":
        return n
    terms = dict(_terms(n))       # edited below: a copy of the shared expansion
    changed = True
    while changed:
        changed = False
        mods = sorted({f for key in terms for f in key if f.op == "mod"}, key=_order)
        for m in mods:
            base, d = m.args
            # the quotient as floordiv() spells it: (m // a) // d is m // (a*d)
            quotient = floordiv(base, d)
            if quotient.op != "floordiv":
                continue
            carrier: list[tuple[tuple[Node, ...], list[Node], int]] = []    # (key, C's factors, coef)
            for key, coef in terms.items():
                if key.count(m) == 1:
                    rest = list(key)
                    rest.remove(m)
                    carrier.append((key, rest, coef))
            expected: dict[tuple[Node, ...], int] = {}
            dterms, bterms = _terms(d), _terms(base)
            for _, rest, coef in carrier:
                for dkey, dcoef in dterms.items():
                    k = tuple(sorted(rest + [quotient] + list(dkey), key=_order))
                    expected[k] = expected.get(k, 0) + coef * dcoef
            expected = {k: c for k, c in expected.items() if c}
            if not carrier or any(terms.get(k) != c for k, c in expected.items()):
                continue
            for key, _, _ in carrier:
                del terms[key]
            for k in expected:
                del terms[k]
            for _, rest, coef in carrier:
                for bkey, bcoef in bterms.items():
                    nk = tuple(sorted(rest + list(bkey), key=_order))
                    terms[nk] = terms.get(nk, 0) + coef * bcoef
                    if terms[nk] == 0:
                        del terms[nk]
            changed = True
            break
    return _build(terms)


# --------------------------------------------------------------------------------------------
# traversal helpers
# --------------------------------------------------------------------------------------------

def substitute(n: Node, mapping: Mapping[Node, Node], ranges: Mapping[str, Node] | None = None) -> Node:
    """Replace sub-expressions (usually vars) and re-simplify index arithmetic on the way up."""
    memo: dict[Node, Node] = {}

    def go(x: Node) -> Node:
        if x in mapping:
            return mapping[x]
        if not x.args:
            return x
        got = memo.get(x)
        if got is not None:
            return got
        args = tuple(go(a) for a in x.args)
        if args == x.args:
            out = x
        elif x.op == "add" and x.dtype == INDEX:
            out = args[0]
            for a in args[1:]:
                out = add(out, a)
        elif x.op == "mul" and x.dtype == INDEX:
            out = args[0]
            for a in args[1:]:
                out = mul(out, a)
        elif x.op == "floordiv" and x.dtype == INDEX:
            out = floordiv(args[0], args[1], ranges)
        elif x.op == "mod" and x.dtype == INDEX:
            out = mod(args[0], args[1], ranges)
        else:
            out = Node(x.op, args, x.arg, x.dtype)
        memo[x] = out
        return out

    return go(n)


def walk(n: Node) -> Iterable[Node]:
    """Every distinct node of the expression, operands before users."""
    seen: set[Node] = set()
    order: list[Node] = []
    stack: list[tuple[Node, bool]] = [(n, False)]
    while stack:
        x, expanded = stack.pop()
        if expanded:
            order.append(x)
            continue
        if x in seen:
            continue
        seen.add(x)
        stack.append((x, True))
        for a in reversed(x.args):
            if a not in seen:
                stack.append((a, False))
    return order


def unit_move(index: Node, name: str) -> Any:
    """How far `index` moves when var `name` goes from 0 to 1, the other vars at 0, where both
    values are constants (None where `name` is absent or a size is symbolic).  Unlike a term's
    coefficient, this sees vars hidden inside // and % (a split chunk's unflattened index)."""
    names = {n.arg for n in walk(index) if n.op == "var"}
    if name not in names:
        return None
    zero = {var(v): const(0) for v in names}
    at0, at1 = substitute(index, zero), substitute(index, {**zero, var(name): const(1)})
    if at0.op == "const" and at1.op == "const":
        return at1.arg - at0.arg
    return None


def free_syms(n: Node) -> set[str]:
    return {x.arg for x in walk(n) if x.op == "sym"}


@functools.lru_cache(maxsize=1 << 15)
def loads(n: Node) -> tuple[Node, ...]:
    """The loads in `n`, operands before users (remembered: the scheduler asks about each
    member's body for every kernel it might join)."""
    return tuple(x for x in walk(n) if x.op == "load")


def cost(n: Node) -> int:
    """A rough count of the work to evaluate `n` once (loads count as 1, transcendentals as 4)."""
    total = 0
    for x in walk(n):
        if x.op in ("const", "var", "sym"):
            continue
        if x.dtype == INDEX and x.op in ("add", "mul", "floordiv", "mod"):
            continue
        total += 4 if x.op in EXPENSIVE_OPS else 1
    return total


# --------------------------------------------------------------------------------------------
# printing
# --------------------------------------------------------------------------------------------

_INFIX = {"add": "+", "sub": "-", "mul": "*", "truediv": "/", "floordiv": "//", "mod": "%",
          "eq": "==", "ne": "!=", "lt": "<", "le": "<=", "gt": ">", "ge": ">=", "and": "&&", "or": "||",
          "bitand": "&", "bitor": "|", "bitxor": "^", "lshift": "<<", "rshift": ">>"}


def _short_dtype(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def to_text(n: Node) -> str:
    """Readable, C-like text; large shared sub-expressions are printed inline (bodies are small)."""
    if n._text is None:
        n._text = _to_text(n)
    return n._text


def _to_text(n: Node) -> str:
    if n.op == "const":
        return repr(n.arg) if n.dtype == INDEX else f"{n.arg!r}:{_short_dtype(n.dtype)}"
    if n.op in ("var", "sym"):
        return str(n.arg)
    if n.op == "load":
        return f"{n.arg}[{to_text(n.args[0])}]"
    if n.op == "cast":
        return f"{_short_dtype(n.arg)}({to_text(n.args[0])})"
    if n.op in _INFIX and len(n.args) >= 2:
        return "(" + f" {_INFIX[n.op]} ".join(to_text(a) for a in n.args) + ")"
    inner = ", ".join(to_text(a) for a in n.args)
    if n.arg is not None:
        inner = f"{inner}, {n.arg!r}" if inner else repr(n.arg)
    return f"{n.op}({inner})"


def map_nodes(n: Node, fn: Callable[[Node, tuple[Node, ...]], Node]) -> Node:
    """Rebuild `n` bottom-up, letting `fn(node, new_args)` return the replacement of each node."""
    memo: dict[Node, Node] = {}
    for x in walk(n):
        args = tuple(memo[a] for a in x.args)
        memo[x] = fn(x, args)
    return memo[n]


def py_index(n: Node) -> str:
    """An index Node as a Python int expression (sizes are non-negative, so // and % agree)."""
    if n.op == "const":
        return str(int(n.arg))
    if n.op in ("sym", "var"):
        return n.arg
    if n.op == "add":
        return "(" + " + ".join(py_index(a) for a in n.args) + ")"
    if n.op == "mul":
        return "(" + " * ".join(py_index(a) for a in n.args) + ")"
    if n.op == "floordiv":
        return f"({py_index(n.args[0])} // {py_index(n.args[1])})"
    if n.op == "mod":
        return f"({py_index(n.args[0])} % {py_index(n.args[1])})"
    if n.op == "maximum":
        return f"max({py_index(n.args[0])}, {py_index(n.args[1])})"
    raise ValueError(f"not an index expression: {n}")
