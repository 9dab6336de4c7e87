"""Index arithmetic of the loop IR (src/torchfuse/ir/nodes.py): canonical sums of products,
floordiv / mod simplification and the div/mod merge rule.

Index nodes are printed as C (`/` and `%` truncate toward zero), so every rewrite is checked by
evaluating both sides with C semantics over the whole range of the loop variables.
"""
from __future__ import annotations

import itertools
import random

import pytest
import torch

from torchfuse.ir import nodes as N
from torchfuse.ir.nodes import INDEX, add, cast, const, floordiv, mod, mul, sym, substitute, var, where

i, j, k = var("i"), var("j"), var("k")
s = sym("s0")


def c_eval(n: N.Node, env: dict[str, int]) -> int:
    """Evaluate an index expression as the generated C++ does (truncating / and %)."""
    if n.op == "const":
        return n.arg
    if n.op in ("var", "sym"):
        return env[n.arg]
    a = [c_eval(x, env) for x in n.args]
    if n.op == "add":
        return sum(a)
    if n.op == "mul":
        out = 1
        for x in a:
            out *= x
        return out
    if n.op == "floordiv":
        q = abs(a[0]) // abs(a[1])
        return q if (a[0] >= 0) == (a[1] > 0) else -q
    if n.op == "mod":
        return a[0] - a[1] * c_eval(N.Node("floordiv", (const(a[0]), const(a[1]))), {})
    if n.op == "where":
        return a[1] if a[0] else a[2]
    if n.op == "ge":
        return a[0] >= a[1]
    if n.op == "lt":
        return a[0] < a[1]
    raise AssertionError(f"unexpected op {n.op}")


def points(ranges: dict[str, int]):
    names = sorted(ranges)
    for values in itertools.product(*(range(ranges[nm]) for nm in names)):
        yield dict(zip(names, values))


def assert_equiv(simplified: N.Node, reference, ranges: dict[str, int]) -> None:
    """`simplified` (C semantics) equals the Python function `reference` at every point."""
    for env in points(ranges):
        got = c_eval(simplified, env)
        want = reference(env)
        assert got == want, f"{N.to_text(simplified)} at {env}: {got} != {want}"


def R(**sizes: int) -> dict[str, N.Node]:
    return {name: const(v) for name, v in sizes.items()}


# ------------------------------------------------------------------------------------------------
# canonical form
# ------------------------------------------------------------------------------------------------

def test_add_mul_canonical_form():
    assert add(i, i) == mul(i, 2)
    assert add(i, 0) is i or add(i, 0) == i
    assert mul(i, 1) == i
    assert mul(i, 0) == const(0)
    assert (i - i) == const(0)
    assert add(mul(add(i, 1), 2), -2) == mul(i, 2)
    assert add(add(i, j), k) == add(k, add(j, i))             # order independent
    assert mul(add(i, j), 3) == add(mul(i, 3), mul(j, 3))     # distributes
    assert add(const(3), const(4)) == const(7)
    assert mul(s, add(i, 1)) == add(mul(s, i), s)


def test_node_hash_consing():
    assert const(1.5, torch.float32) == const(1.5, torch.float32)
    assert const(1.5, torch.float32) != const(1.5, torch.float64)
    assert const(1, INDEX) != const(1.0, torch.float32)
    nan = float("nan")
    assert const(nan, torch.float32) == const(nan, torch.float32)
    assert hash(const(nan, torch.float32)) == hash(const(nan, torch.float32))
    assert len({add(i, j), add(j, i), add(i, j)}) == 1


def test_const_folding_of_casts_and_where():
    assert cast(const(3.7, torch.float32), torch.int64) == const(3)
    assert cast(const(-3.7, torch.float64), torch.int32) == const(-3, torch.int32)
    assert cast(const(2, INDEX), torch.float32) == const(2.0, torch.float32)
    assert cast(const(0.5, torch.float32), torch.bool) == const(True, torch.bool)
    inf_to_int = cast(const(float("inf"), torch.float32), torch.int64)
    assert inf_to_int.op == "cast"                          # not folded: the value is undefined
    a, b = N.load("a", i, torch.float32), N.load("b", i, torch.float32)
    assert where(const(True, torch.bool), a, b) is a
    assert where(const(False, torch.bool), a, b) is b
    cond = N.op("lt", a, b, dtype=torch.bool)
    assert where(cond, a, a) is a


# ------------------------------------------------------------------------------------------------
# floordiv / mod
# ------------------------------------------------------------------------------------------------

def test_floordiv_mod_constants_and_identities():
    assert floordiv(const(17), const(5)) == const(3)
    assert mod(const(17), const(5)) == const(2)
    assert floordiv(i, 1) == i
    assert mod(i, 1) == const(0)
    assert floordiv(mul(i, 6), 3) == mul(i, 2)
    assert mod(mul(i, 6), 3) == const(0)
    assert floordiv(mul(s, i), s) == i
    assert mod(mul(s, i), s) == const(0)


def test_floordiv_mod_split_with_known_ranges():
    e = add(mul(i, 4), j)                                  # i*4 + j, j < 4
    assert floordiv(e, 4, R(j=4)) == i
    assert mod(e, 4, R(j=4)) == j
    assert floordiv(add(mul(i, 4), 3), 4) == i             # a constant remainder is bounded by itself
    assert mod(add(mul(i, 4), 3), 4) == const(3)
    assert mod(j, 4, R(j=4)) == j                          # already below the divisor
    assert mod(j, 4, R(j=5)).op == "mod"
    assert floordiv(j, 4, R(j=4)) == const(0)


def test_floordiv_mod_unknown_range_splits_off_multiples():
    """Without a bound on j, (i*4 + j) // 4 is i + j // 4 and (i*4 + j) % 4 is j % 4 (both
    parts non-negative, so C's truncating / and % agree); neither folds further."""
    e = add(mul(i, 4), j)
    assert floordiv(e, 4) == add(i, floordiv(j, 4))
    assert mod(e, 4) == mod(j, 4)
    assert floordiv(add(add(mul(i, 4), j), const(-1)), 4).op == "floordiv"    # a negative part: kept
    assert_equiv(floordiv(e, 4), lambda v: (v["i"] * 4 + v["j"]) // 4, {"i": 3, "j": 9})
    assert_equiv(mod(e, 4), lambda v: (v["i"] * 4 + v["j"]) % 4, {"i": 3, "j": 9})


def test_quotient_below_the_modulus_drops_the_mod():
    """(j // 32) % 4 with j < 128 is j // 32: the bound of a quotient is the bound of its dividend
    divided.  A rotate_half over 4 heads of 32 read q at ((j // 32) % 4) * 32 + j % 32, which
    then merges back into j: a contiguous load where g++ had emitted a gather."""
    q = floordiv(j, 32)
    assert mod(q, 4, R(j=128)) == q
    assert mod(q, 4, R(j=129)).op == "mod"                 # 128 // 32 = 4 is not below 4
    assert mod(floordiv(add(j, 5), 32), 4, R(j=123)).op == "floordiv"
    assert N._merge_divmod(add(mul(mod(q, 4, R(j=128)), 32), mod(j, 32))) == j


def test_merge_divmod_with_a_divisor_that_is_a_sum():
    """A channels-last map behind a stride-2 conv under dynamic shapes: its rows are n, h, w of
    sizes (s0 - 1) // 2 + 1, so a batch norm's flat row index r came back as
    ((r // w) % h) * w * 128 + (r // w // h) * h * w * 128 + (r % w) * 128: gathers, where the
    address is r * 128, contiguous across rows.  A divisor with several terms merges too."""
    s0, s1 = sym("s0"), sym("s1")
    w = add(floordiv(add(s0, -1), 2), 1)
    h = add(floordiv(add(s1, -1), 2), 1)
    r = var("r")
    flat = add(add(mul(mul(mod(floordiv(r, w), h), w), 128), mul(mul(mul(floordiv(floordiv(r, w), h), h), w), 128)),
               mul(mod(r, w), 128))
    assert flat == mul(r, 128)
    partial = add(mul(mod(r, w), 128), mul(floordiv(r, w), 128))      # not k*w*(r // w): kept
    assert partial != mul(r, 128) and any(f.op == "mod" for f in N.walk(partial))


def test_nested_floordiv():
    assert floordiv(floordiv(i, 2), 3) == floordiv(i, 6)
    assert_equiv(floordiv(floordiv(i, 2), 3), lambda v: v["i"] // 6, {"i": 40})


def test_mod_bound_by_symbolic_divisor():
    """x % s0 is below s0, so (x % s0) // s0 is 0 and (x % s0) % s0 is x % s0."""
    m = mod(i, s)
    assert floordiv(m, s) == const(0)
    assert mod(m, s) == m
    e = add(mul(j, s), m)
    assert floordiv(e, s) == j
    assert mod(e, s) == m


def test_merge_divmod_inverts_a_split():
    """k*d*(m // d) + k*(m % d) == k*m: the inverse of splitting one loop into two."""
    assert add(mul(floordiv(i, 4), 4), mod(i, 4)) == i
    assert add(mul(floordiv(i, 4), 8), mul(mod(i, 4), 2)) == mul(i, 2)
    assert add(add(mul(floordiv(i, s), s), mod(i, s)), 5) == add(i, 5)
    e = add(mul(floordiv(add(i, j), 3), 3), mod(add(i, j), 3))
    assert e == add(i, j)
    # no merge when the coefficients do not match
    assert add(mul(floordiv(i, 4), 3), mod(i, 4)).op == "add"
    assert_equiv(add(mul(floordiv(i, 4), 3), mod(i, 4)), lambda v: v["i"] // 4 * 3 + v["i"] % 4, {"i": 30})


def test_merge_divmod_through_nested_quotients():
    """A view that unflattens one index into three dims ([392] -> [2, 14, 14], row stride 384)
    merges back into x*384: the quotient of a quotient is spelled x // 196, not (x // 14) // 14."""
    x = var("x")
    e = add(add(mul(mod(floordiv(x, 14), 14), 14 * 384), mul(mod(x, 14), 384)), mul(floordiv(x, 196), 196 * 384))
    assert e == mul(x, 384)
    assert_equiv(e, lambda v: v["x"] * 384, {"x": 392})
    # one coefficient off: left alone, and still the same function
    e2 = add(add(mul(mod(floordiv(x, 14), 14), 14 * 384), mul(mod(x, 14), 383)), mul(floordiv(x, 196), 196 * 384))
    assert e2 != mul(x, 384)
    assert_equiv(e2, lambda v: (v["x"] // 14 % 14) * 14 * 384 + (v["x"] % 14) * 383 + (v["x"] // 196) * 196 * 384,
                 {"x": 392})


def test_loop_split_and_merge_round_trip():
    """Substituting i -> m // 7, j -> m % 7 into the flat index i*7 + j gives back m (dim merging)."""
    m = var("m")
    flat = add(mul(i, 7), j)
    merged = substitute(flat, {i: floordiv(m, 7), j: mod(m, 7)}, R(m=35))
    assert merged == m
    # a 3-d contiguous view: (a, b, c) -> a*20 + b*5 + c, with b, c from a merged var over 4*5
    a, b, c = var("a"), var("b"), var("c")
    flat3 = add(add(mul(a, 20), mul(b, 5)), c)
    merged3 = substitute(flat3, {b: floordiv(m, 5), c: mod(m, 5)}, R(a=3, m=20))
    assert merged3 == add(mul(a, 20), m)


def test_view_index_roundtrip_on_contiguous():
    """view(6, 20) of a (6, 4, 5) contiguous tensor and back: the outer index and the innermost
    remainder simplify away, and the round trip evaluates to the flat index."""
    x0, x1 = var("x0"), var("x1")
    flat = add(mul(x0, 20), x1)
    sub = [floordiv(flat, 20, R(x0=6, x1=20)), mod(floordiv(flat, 5, R(x0=6, x1=20)), 4, R(x0=6, x1=20)),
           mod(flat, 5, R(x0=6, x1=20))]
    assert sub[0] == x0
    assert sub[2] == mod(x1, 5)
    assert_equiv(sub[1], lambda v: (v["x1"] // 5) % 4, {"x0": 6, "x1": 20})
    back = add(add(mul(sub[0], 20), mul(sub[1], 5)), sub[2])
    assert_equiv(back, lambda v: v["x0"] * 20 + v["x1"], {"x0": 6, "x1": 20})


@pytest.mark.parametrize("seed", range(4))
def test_random_nonnegative_affine_floordiv_mod(seed):
    """floordiv/mod of random affine expressions with non-negative coefficients: the simplified
    result, evaluated with C semantics, equals Python's // and % everywhere in the ranges."""
    rng = random.Random(seed)
    sizes = {"i": rng.randint(1, 6), "j": rng.randint(1, 6), "k": rng.randint(1, 5)}
    for _ in range(60):
        coefs = {nm: rng.choice([0, 1, 2, 3, 4, 6, 8, 12]) for nm in sizes}
        c0 = rng.randint(0, 30)
        d = rng.choice([1, 2, 3, 4, 6, 8])
        e = const(c0)
        for nm, co in coefs.items():
            e = add(e, mul(var(nm), co))
        ranges = R(**sizes) if rng.random() < 0.7 else None

        def ref(v, op):
            val = c0 + sum(co * v[nm] for nm, co in coefs.items())
            return val // d if op == "div" else val % d
        assert_equiv(floordiv(e, d, ranges), lambda v: ref(v, "div"), sizes)
        assert_equiv(mod(e, d, ranges), lambda v: ref(v, "mod"), sizes)


def test_upper_bound_and_interval():
    assert N.upper_bound(const(4)) == const(5)
    assert N.upper_bound(i, R(i=7)) == const(7)
    assert N.upper_bound(mod(j, s)) == s
    assert N.upper_bound(add(mul(i, 3), 2), R(i=4)) == const(12)
    assert N.upper_bound(add(mul(i, -1), 2), R(i=4)) is None        # may be negative
    assert N._int_interval(add(mul(i, -2), 10), R(i=4)) == (4, 10)
    assert N._int_interval(floordiv(i, 3), R(i=10)) == (0, 3)


def test_substitute_resimplifies():
    e = floordiv(add(mul(i, 4), j), 4)
    assert e == add(i, floordiv(j, 4))                               # unknown j
    assert substitute(e, {j: const(3)}) == i
    assert substitute(mod(add(mul(i, 4), j), 4), {j: mod(k, 4)}) == mod(k, 4)


def test_mod_keeps_dividend_nonnegative():
    e = mod(add(mul(i, -1), 12), 6)
    assert_equiv(e, lambda v: (12 - v["i"]) % 6, {"i": 6})


@pytest.mark.parametrize("seed", range(2))
def test_random_affine_with_negative_coefficients(seed):
    """Expressions like (c - i) that stay non-negative over the range (flip, roll indices)."""
    rng = random.Random(100 + seed)
    sizes = {"i": rng.randint(2, 6), "j": rng.randint(2, 6)}
    for _ in range(60):
        ci, cj = rng.choice([-3, -2, -1, 1, 2]), rng.choice([-2, -1, 0, 1, 3])
        d = rng.choice([2, 3, 4, 5])
        low = min(0, ci * (sizes["i"] - 1)) + min(0, cj * (sizes["j"] - 1))
        c0 = -low + rng.randint(1, 7)       # keeps the expression non-negative; not a multiple of d by luck only
        if c0 % d == 0:
            c0 += 1
        e = add(add(mul(i, ci), mul(j, cj)), c0)
        ref = lambda v, op: (lambda val: val // d if op == "div" else val % d)(c0 + ci * v["i"] + cj * v["j"])  # noqa
        assert_equiv(floordiv(e, d, R(**sizes)), lambda v: ref(v, "div"), sizes)
        assert_equiv(mod(e, d, R(**sizes)), lambda v: ref(v, "mod"), sizes)


def test_mixed_radix_index_bounded_by_symbolic_sizes():
    """x0 + s1*x1 + s1*s2*x2 with x0 < s1, x1 < s2, x2 < s3 is below s1*s2*s3 (dynamic shapes):
    `// (s1*s2*s3)` is 0 and `%` keeps it; with one range too large nothing is simplified."""
    s1, s2, s3 = sym("s1"), sym("s2"), sym("s3")
    x0, x1, x2 = var("x0"), var("x1"), var("x2")
    idx = add(add(x0, mul(s1, x1)), mul(mul(s1, s2), x2))
    total = mul(mul(s1, s2), s3)
    ranges = {"x0": s1, "x1": s2, "x2": s3}
    assert floordiv(idx, total, ranges) == const(0)
    assert mod(idx, total, ranges) == idx
    assert floordiv(idx, total, {**ranges, "x2": add(s3, 1)}).op == "floordiv"     # x2 may reach s3
    assert floordiv(idx, total, {"x0": s1, "x1": s2}).op == "floordiv"              # x2 unbounded
    m = mod(idx, total, ranges)
    for v0, v1, v2 in itertools.product(range(3), range(5), range(4)):     # s1, s2, s3 = 3, 5, 4
        env = {"s1": 3, "s2": 5, "s3": 4, "x0": v0, "x1": v1, "x2": v2}
        assert c_eval(m, env) == (v0 + 3 * v1 + 15 * v2) % 60


def test_symbolic_max_in_sizes():
    # Max appears in strides of symbolic views (Max(1, 768 // s0) for a dim inferred from -1)
    import sympy
    from torch.utils._sympy.functions import FloorDiv

    from torchfuse.lowering.values import sym_to_node
    from torchfuse.codegen.wrapper import py_index
    s0, s1 = sympy.Symbol("s0", integer=True, positive=True), sympy.Symbol("s1", integer=True, positive=True)
    # Max(1, a product of backed sizes) is the product itself (sizes are >= 2)
    assert sym_to_node(sympy.Max(1, s0 * s1)) == sym_to_node(s0 * s1)
    # otherwise an index maximum, evaluated on the host and in kernels alike
    n = sym_to_node(sympy.Max(1, FloorDiv(768, s0)))
    assert n.op == "maximum"
    expr = py_index(n)
    assert eval(expr, {"s0": 64}) == 12 and eval(expr, {"s0": 1000}) == 1


def test_symbolic_ceil_and_floor_of_a_quotient_in_sizes():
    # memory-efficient attention's log-sum-exp has ceil(s / 32) * 32 rows (CeilToInt(IntTrueDiv))
    import sympy
    from torch.utils._sympy.functions import CeilToInt, FloorToInt, IntTrueDiv

    from torchfuse.lowering.values import sym_to_node
    from torchfuse.codegen.wrapper import py_index
    s0 = sympy.Symbol("s0", integer=True, positive=True)
    ceil_rows = py_index(sym_to_node(CeilToInt(IntTrueDiv(s0, 32)) * 32))
    floor_rows = py_index(sym_to_node(FloorToInt(IntTrueDiv(s0 + 3, 8))))
    for n in (1, 31, 32, 33, 77, 4096):
        assert eval(ceil_rows, {"s0": n}) == -(-n // 32) * 32
        assert eval(floor_rows, {"s0": n}) == (n + 3) // 8


def test_symbolic_row_step_divisor():
    """A view's flat index over rows `c` apart, divided by `s * c` (a batch of `s` symbolic rows:
    GPT-2's (b*t, 512) -> (b, t, 512) -> (b*t, 512) with a symbolic t) simplifies to x0 // s, and
    the whole unflatten/flatten round trip to the flat index, as it does with constant sizes."""
    x0, x1 = var("x0"), var("x1")
    ranges = {"x0": mul(s, 3), "x1": const(8)}
    flat = add(mul(x0, 8), x1)
    q = floordiv(flat, mul(s, 8), ranges)
    r = mod(flat, mul(s, 8), ranges)
    assert q == floordiv(x0, s)
    assert "//" not in N.to_text(r).replace(N.to_text(x0), "")    # no division of the flat index
    assert add(mul(mul(q, s), 8), add(mul(mod(floordiv(flat, 8, ranges), s, ranges), 8), x1)) == flat
    for sv in (2, 3, 5):
        for env in points({"x0": 3 * sv, "x1": 8}):
            env["s0"] = sv
            assert c_eval(q, env) == (env["x0"] * 8 + env["x1"]) // (sv * 8)
            assert c_eval(r, env) == (env["x0"] * 8 + env["x1"]) % (sv * 8)
    # not a size symbol (an unbacked one may be 0 or negative): left alone
    u = sym("u0")
    assert floordiv(flat, mul(u, 8), {"x0": mul(u, 3), "x1": const(8)}).op == "floordiv"
