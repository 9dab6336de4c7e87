"""Constants are typed values in every position of the generated code, on both backends.

A literal reaches a kernel as a stored value (`torch.zeros_like(x, dtype=torch.int64)`), through
a cast, a select, a comparison, a min/max, a fill, a reduction, ...  Each position is checked
for int64, int32, bool, fp16, bf16, fp32 and fp64 constants (zero, other values, Python ints
beyond int32, infinities and NaN) on the C++ backend and on the Triton backend (under Triton's
interpreter), against eager.  In Triton an int64 constant used to be printed as a bare Python
int, so a kernel storing one did not parse (`tl.store(..., 0.to(tl.int64), xmask)`) and a
transformers MoE decoder's graph ran eagerly; `test_moe_top2_routing` is that decoder's
routing.
"""
from __future__ import annotations

import math
from typing import Callable

import pytest
import torch
import torch.nn.functional as F

import torchfuse
from torchfuse import counters

BACKENDS = ["cpp", "triton"]


def _options(backend: str) -> dict:
    if backend == "triton":
        pytest.importorskip("triton")
        return {"cpu_backend": "triton"}
    return {}


# per dtype: (constant, another constant of the same dtype); zero first, the MoE case
VALUES: dict[torch.dtype, list[tuple]] = {
    torch.int64: [(0, -1), (-7, 2 ** 40)],
    torch.int32: [(0, 3), (-2 ** 31, 2 ** 31 - 1)],
    torch.bool: [(False, True), (True, True)],
    torch.float16: [(0.0, -1.5), (2.5, float("-inf"))],
    torch.bfloat16: [(0.0, 2.5), (-0.75, float("inf"))],
    torch.float32: [(0.0, -1.5), (float("-inf"), float("nan"))],
    torch.float64: [(0.0, 1e-300), (-0.25, float("nan"))],
}

def _finite(v: object) -> object:
    """A float constant cast to an integer dtype must be finite (inf -> int is undefined)."""
    return v if not isinstance(v, float) or math.isfinite(v) else -3.0


Fn = Callable[[torch.Tensor, torch.Tensor, object, object], list]

# position -> (outputs for a value tensor y of the dtype, a mask m and constants v, w;
#              dtypes eager has no such op for)
POSITIONS: dict[str, tuple[Fn, tuple[torch.dtype, ...]]] = {
    "stored": (lambda y, m, v, w: [torch.full_like(y, v), y.new_full((7,), v),
                                   torch.full((5, 7), v, dtype=y.dtype), torch.zeros_like(y), torch.ones_like(y)], ()),
    "cast": (lambda y, m, v, w: [torch.full_like(y, v).to(torch.float32), torch.full_like(y, v).half(),
                                 torch.full_like(y, v).bfloat16(), torch.full_like(y, v).to(torch.bool),
                                 torch.full_like(y, _finite(w)).to(torch.int64),
                                 torch.full_like(y, _finite(v)).to(torch.int8),
                                 (y > y.flip(0)).to(y.dtype)], ()),
    "select": (lambda y, m, v, w: [torch.where(m, v, y), torch.where(m, y, w),
                                   torch.where(m, torch.full_like(y, v), torch.full_like(y, w))], ()),
    "compare": (lambda y, m, v, w: [y > v, y == w, torch.full_like(y, v) >= y,
                                    torch.full_like(y, v) != torch.full_like(y, w)], ()),
    "minmax": (lambda y, m, v, w: [y.clamp(min=v), y.clamp(max=w), torch.maximum(torch.full_like(y, v), y),
                                   torch.minimum(torch.full_like(y, v), torch.full_like(y, w))], (torch.bool,)),
    "fill": (lambda y, m, v, w: [y.masked_fill(m, v), F.pad(y, (1, 2), value=w),
                                 y.clone().masked_fill_(~m, w) if y.dtype != torch.bool else y & m], ()),
    "reduce": (lambda y, m, v, w: [torch.full_like(y, v).sum(-1), torch.full_like(y, v).amax(-1),
                                   y.masked_fill(m, v).amin(-1), torch.full_like(y, w).argmax(-1),
                                   y.masked_fill(m, w).sum(0)], (torch.bool,)),
    "reduce_bool": (lambda y, m, v, w: [torch.full_like(y, v).any(-1), torch.full_like(y, w).all(-1),
                                        y.masked_fill(m, v).sum(0), y.masked_fill(m, w).amax(-1)], ()),
}


def _compile_and_compare(tf, fn: Callable, args: tuple, options: dict, labels: list[str], *,
                         dynamic: bool = False, arg_sets: list[tuple] | None = None) -> None:
    """Every output of `fn` equals eager's (integers exactly, floats within the dtype's
    tolerance: sums may add in another order; NaN == NaN), through torchfuse in strict mode
    with no eager fallback; every kernel comes from the backend asked for."""
    before = counters["eager_fallbacks"]
    if dynamic:
        compiled = torchfuse.compile(fn, dynamic=True, options={"strict": True, **options})
        runs = [(compiled(*a), fn(*a)) for a in arg_sets or [args]]
    else:
        e = torchfuse.explain(fn, *args, options={"strict": True, **options})
        backend = options.get("cpu_backend", "cpp")
        assert e.kernels and all(k.backend == backend for k in e.kernels), e
        runs = [(e.output, fn(*args))]
    assert counters["eager_fallbacks"] == before, "the graph ran eagerly"
    for got, expected in runs:
        assert len(got) == len(expected) == len(labels)
        for label, a, b in zip(labels, got, expected):
            tf.assert_same(a, b, what=f"{label}: ")


def _inputs(dtype: torch.dtype, tf) -> tuple[torch.Tensor, torch.Tensor]:
    y = tf.rand((7, 5), dtype).t()              # non-contiguous, odd sizes
    m = torch.rand(5, 7) > 0.5
    return y, m


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("position", sorted(POSITIONS))
def test_constant_in_every_position(tf, backend, position):
    """For each dtype and pair of constants, the position's outputs; one graph per position
    (all dtypes), each output labelled in a failure."""
    fn, skip = POSITIONS[position]
    if position == "reduce_bool":
        dtypes = [torch.bool]
    else:
        dtypes = [d for d in VALUES if d not in skip]
    cases = [(d, v, w) for d in dtypes for v, w in VALUES[d]]
    inputs = [_inputs(d, tf) for d, _, _ in cases]
    labels = [f"{position} {d} ({v}, {w}) output {k}" for (d, v, w), (y, m) in zip(cases, inputs)
              for k in range(len(fn(y, m, v, w)))]

    def program(*args):
        outs = []
        for (d, v, w), k in zip(cases, range(0, len(args), 2)):
            outs += fn(args[k], args[k + 1], v, w)
        return tuple(outs)

    args = tuple(t for pair in inputs for t in pair)
    _compile_and_compare(tf, program, args, _options(backend), labels)


@pytest.mark.parametrize("backend", BACKENDS)
def test_stored_constant_fuses_with_other_outputs(tf, backend):
    """The MoE failure's shape: an int64 zeros buffer stored by the kernel that computes other
    outputs (one kernel for the three)."""
    x = tf.rand((6, 9))
    e = tf.check(lambda a: (torch.zeros_like(a, dtype=torch.int64), a * 2, (a > 0).to(torch.int64)), x,
                 options=_options(backend), kernels=1)
    assert all(k.backend == backend for k in e.kernels)


@pytest.mark.parametrize("backend", BACKENDS)
def test_python_ints_beyond_int32(tf, backend):
    y = torch.randint(-2 ** 40, 2 ** 40, (5, 7))
    m = torch.rand(5, 7) > 0.5
    big = 2 ** 40
    y32 = torch.randint(-9, 9, (5, 7), dtype=torch.int32)
    labels = ["full", "add", "where", "clamp", "compare", "min int64", "max int64", "mul amax", "fill", "sub",
              "int32 > 2**40", "int32 + 2**40", "int32 == 2**33 + 3"]

    def program(y, m, y32):
        # next to an int32 tensor, ATen wraps the Python int to int32 (2**40 -> 0)
        return (torch.full((5,), big), y + big, torch.where(m, big, y), y.clamp(-big, big), y < 2 ** 35,
                torch.full_like(y, -2 ** 63), torch.full_like(y, 2 ** 63 - 1), (y * 2 ** 13).amax(-1),
                y.masked_fill(m, -big), y - (2 ** 62 + 1), y32 > big, y32 + big, y32 == 2 ** 33 + 3)
    _compile_and_compare(tf, program, (y, m, y32), _options(backend), labels)


@pytest.mark.parametrize("backend", BACKENDS)
def test_sizes_as_values_with_symbolic_sizes(tf, backend):
    """A size symbol stored, compared and selected as a value (dynamic=True), at two sizes."""
    def program(y, m):
        n, k = y.shape
        return (torch.full_like(y, n), y * k + n, torch.where(m, n, y), torch.arange(n) < k,
                y.new_full((n,), 0) + torch.arange(n), (y.sum(-1) // k).to(torch.int64))
    arg_sets = [(torch.randint(-9, 9, (n, k)), torch.rand(n, k) > 0.5) for n, k in ((5, 7), (6, 3))]
    _compile_and_compare(tf, program, arg_sets[0], _options(backend), [f"output {k}" for k in range(6)],
                         dynamic=True, arg_sets=arg_sets)


def _moe_routing(x: torch.Tensor, router: torch.Tensor, w1: torch.Tensor, n_experts: int):
    """Top-2 routing as transformers' MoE decoders do it, without the data-dependent gathers:
    softmax over router logits, topk, renormalised weights, one_hot of the expert ids, per-expert
    masks and an int64 routing table scattered into a zeros buffer."""
    logits = x @ router
    probs = torch.softmax(logits.float(), dim=-1)
    top_w, top_i = torch.topk(probs, 2, dim=-1)
    top_w = top_w / top_w.sum(-1, keepdim=True)
    expert_mask = F.one_hot(top_i, num_classes=n_experts).permute(2, 1, 0)
    hit = torch.greater(expert_mask.sum(dim=(-1, -2)), 0)
    table = torch.zeros(x.shape[0], n_experts, dtype=torch.int64).scatter(1, top_i, 1)
    counts = torch.zeros(n_experts, dtype=torch.int64).scatter_add(0, top_i.flatten(), torch.ones_like(top_i.flatten()))
    out = torch.zeros_like(x)
    for e in range(n_experts):
        weight = (top_w * (top_i == e)).sum(-1, keepdim=True)
        out = out + weight * torch.relu(x @ w1[e])
    return out, expert_mask, hit, table, counts, torch.where(table > 0, top_w.new_zeros(()), -1.0)


@pytest.mark.parametrize("backend", BACKENDS)
def test_moe_top2_routing(tf, backend):
    n_experts = 4
    x, router, w1 = tf.rand((9, 16)), tf.rand((16, n_experts)), tf.rand((n_experts, 16, 16)) / 4
    tf.check(lambda a, b, c: _moe_routing(a, b, c, n_experts), x, router, w1, options=_options(backend),
             allow_fallbacks=("aten.mm.default", "aten.topk.default", "aten.scatter_add.default",
                              "aten._assert_async.msg"), atol=1e-4, rtol=1e-4)


def test_triton_literal_is_a_typed_value():
    """The emitter's contract, on the generated text: a constant reached as a value is a typed
    0-d tensor for every dtype; in index arithmetic it is a bare number."""
    pytest.importorskip("triton")
    from torchfuse.backends.triton.codegen import TritonEmitter
    from torchfuse.ir.nodes import const, var
    em = TritonEmitter({})
    for dtype, pairs in VALUES.items():
        for v, _ in pairs:
            text = em.value(const(v, dtype))
            assert text.startswith("tl.full([1]") or (isinstance(v, float) and math.isnan(v)), (dtype, v, text)
    assert em.index(var("x0") * 7 + 3) in ("((x0 * 7) + 3)", "(3 + (x0 * 7))")
