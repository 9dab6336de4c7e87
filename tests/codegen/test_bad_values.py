"""Values eager rejects or wraps never make generated code read out of bounds, trap or return a
wrong value: out-of-range indices (gather, index_select, embedding, advanced indexing) raise
eager's IndexError, integer division by zero raises ZeroDivisionError, INT_MIN // -1 wraps.
C++ and (under Triton's interpreter) Triton, through torch.compile and the lazy mode."""
from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

import torchfuse

BACKENDS = ["cpp", "triton"]


def _opts(backend: str) -> dict:
    if backend == "triton":
        pytest.importorskip("triton")
        os.environ.setdefault("TRITON_INTERPRET", "1")
        return {"cpu_backend": "triton"}
    return {}


def _compiled(fn, backend):
    torch._dynamo.reset()
    return torch.compile(fn, backend="torchfuse", options=_opts(backend))


# fn, the dim indexed, whether eager takes negative indices (advanced indexing only)
INDEXING = {
    "index": (lambda t, i: (t[i] * 2).sum(-1), 0, True),
    "gather": (lambda t, i: t.gather(1, i.view(-1, 1).expand(-1, 3).contiguous()) + 1, 1, False),
    "embedding": (lambda t, i: F.embedding(i.view(3, -1), t) * 3, 0, False),
    "index_select": (lambda t, i: t.index_select(0, i) - 1, 0, False),
}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", sorted(INDEXING))
def test_out_of_range_index_raises(name, backend):
    fn, dim, negative = INDEXING[name]
    t = torch.randn(11, 7)
    size = t.shape[dim]
    good = torch.tensor([1, -2, 5, 0, size - 1, -size]) if negative else torch.tensor([1, 2, 5, 0, size - 1, 3])
    f = _compiled(fn, backend)
    torch.testing.assert_close(f(t, good), fn(t, good))       # negative indices count from the end
    for bad in (size, 10 ** 9, -size - 1) + (() if negative else (-1,)):
        idx = good.clone()
        idx[2] = bad
        with pytest.raises(IndexError if name != "gather" else RuntimeError):
            fn(t, idx)                                          # eager's kind of error ...
        with pytest.raises(IndexError if name != "gather" else RuntimeError, match=f"index {bad}"):
            f(t, idx)                                           # ... naming the index
    torch.testing.assert_close(f(t, good), fn(t, good))        # and the graph still works


@pytest.mark.parametrize("backend", BACKENDS)
def test_out_of_range_index_lazy(backend):
    if backend == "triton":
        pytest.skip("the lazy mode compiles CPU tensors with the C++ backend")
    t = torch.randn(10, 4)
    with torchfuse.lazy():
        ok = (t[torch.tensor([1, -3])] * 2).sum(-1)
        torch.testing.assert_close(ok, (t[torch.tensor([1, -3])] * 2).sum(-1))
    with pytest.raises(IndexError, match="index 12"):
        with torchfuse.lazy():
            y = (t[torch.tensor([1, 12])] * 2).sum(-1)
            y.tolist()


def test_index_known_in_range_has_no_check():
    """An index made from loop positions (arange) needs no check; a loaded one does."""
    t = torch.randn(50, 16)
    rep = torchfuse.explain(lambda t, i: (t[i] * t[torch.arange(9)]).sum(-1), t, torch.randint(-50, 50, (9,)))
    src = "\n".join(k.source for k in rep.kernels)
    assert len(rep.kernels) == 1 and src.count("tf_check_index(") == 1


DIVISIONS = {
    "floordiv": lambda a, b: a // b + 1,
    "remainder": lambda a, b: a % b + 1,
    "fmod": lambda a, b: torch.fmod(a, b) + 1,
    "div_trunc": lambda a, b: torch.div(a, b, rounding_mode="trunc") + 1,
    "div_floor": lambda a, b: torch.div(a, b, rounding_mode="floor") + 1,
}


def _wrapped(name, a: int, b: int, bits: int) -> int:
    """The two's-complement result eager's integer ops give (also where eager itself traps)."""
    if name in ("floordiv", "div_floor"):
        q = a // b
    elif name == "div_trunc":
        q = abs(a) // abs(b) * (1 if (a < 0) == (b < 0) else -1)
    elif name == "remainder":
        q = a % b
    else:
        q = a - b * int(a / b) if abs(a) < 2 ** 52 else (0 if b in (1, -1) else None)
    q += 1
    q &= (1 << bits) - 1
    return q - (1 << bits) if q >= 1 << (bits - 1) else q


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", sorted(DIVISIONS))
def test_integer_division_by_zero_raises(name, backend):
    fn = DIVISIONS[name]
    a, b = torch.tensor([7, -9, 4, 3]), torch.tensor([2, 4, 0, -5])
    with pytest.raises(RuntimeError, match="ZeroDivisionError"):   # eager
        fn(a, b)
    f = _compiled(fn, backend)
    with pytest.raises(ZeroDivisionError):
        f(a, b)
    b[2] = 3
    torch.testing.assert_close(f(a, b), fn(a, b))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("name", sorted(DIVISIONS))
def test_int_min_by_minus_one_wraps(name, dtype, backend):
    bits = torch.iinfo(dtype).bits
    lo = torch.iinfo(dtype).min
    a = torch.tensor([lo, 9, -7, lo + 1, 5], dtype=dtype)
    b = torch.tensor([-1, -1, 2, -1, 3], dtype=dtype)
    f = _compiled(DIVISIONS[name], backend)
    got = f(a, b)
    assert got.dtype == dtype
    assert got.tolist() == [_wrapped(name, int(x), int(y), bits) for x, y in zip(a, b)]
    if dtype == torch.int64 and name not in ("div_trunc",):      # (eager's int32 and trunc trap)
        torch.testing.assert_close(got, DIVISIONS[name](a, b))


def test_division_checks_lazy():
    a, b = torch.tensor([7, -9, 4]), torch.tensor([2, 4, 0])
    with pytest.raises(ZeroDivisionError):
        with torchfuse.lazy():
            (a // b + 1).tolist()
    lo = torch.tensor([-2 ** 63, 4])
    with torchfuse.lazy():
        got = (lo // torch.tensor([-1, 2]) + 1).tolist()
    assert got == [-2 ** 63 + 1, 3]


def test_out_of_range_index_symbolic_sizes():
    """A dim of symbolic size (dynamic=True): checked against its run-time size."""
    fn = INDEXING["index"][0]
    torch._dynamo.reset()
    f = torch.compile(fn, backend="torchfuse", dynamic=True)
    for rows in (9, 13):
        t = torch.randn(rows, 5)
        idx = torch.tensor([0, -1, rows - 2])
        torch.testing.assert_close(f(t, idx), fn(t, idx))
        with pytest.raises(IndexError, match=f"size {rows}"):
            f(t, torch.tensor([0, rows]))


@pytest.mark.parametrize("backend", BACKENDS)
def test_out_of_range_index_into_a_dim_of_one(backend):
    """A dim of one element is loaded at 0 whatever the index: the check must stay all the same."""
    t = torch.randn(1, 6)

    def fn(t, i):
        return t.gather(0, i.view(1, -1)) + 1
    f = _compiled(fn, backend)
    ok = torch.zeros(4, dtype=torch.int64)
    torch.testing.assert_close(f(t, ok), fn(t, ok))
    with pytest.raises(RuntimeError, match="index 1 "):
        f(t, torch.tensor([0, 1, 0, 0]))
