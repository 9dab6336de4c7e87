"""Adversarial values for the fuzzer: what eager rejects or wraps must never read out of bounds,
trap or give a wrong value.

    python -m torchfuse.tools.fuzz --bad-values --examples 200 [--triton | --lazy]

Each case is an indexed load (advanced indexing, gather, index_select, embedding) with indices
drawn from in-range, negative, just-out-of-range and huge values, or an integer division (`//`,
`%`, fmod, rounding divisions) with divisors drawn from 0, -1 and ordinary values and dividends
from INT_MIN, INT_MAX and ordinary values, int32 and int64, followed by a pointwise op so that
the value is computed by a fused kernel.  torchfuse (C++, Triton under its interpreter, or the
lazy mode) must give eager's result, or raise eager's kind of error where eager raises.
Eager itself traps (SIGFPE) on INT_MIN // -1 in int32 and in truncating division: there the
expected value is the two's-complement one, computed without that division.
"""
from __future__ import annotations

import random
import warnings
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn.functional as F

INDEX_OPS: dict[str, Callable] = {
    "index": lambda t, i: (t[i] * 2 + 1),
    "index_dim1": lambda t, i: torch.relu(t[:, i]),
    "gather": lambda t, i: t.gather(0, i.view(-1, 1).expand(-1, t.shape[1]).contiguous()) - 1,
    "index_select": lambda t, i: t.index_select(1, i) * 3,
    "embedding": lambda t, i: F.embedding(i.view(-1, 2) if i.numel() % 2 == 0 else i, t).sum(-1),
}
DIV_OPS: dict[str, Callable] = {
    "floordiv": lambda a, b: a // b + 1,
    "remainder": lambda a, b: a % b * 2,
    "fmod": lambda a, b: torch.fmod(a, b) - 1,
    "div_trunc": lambda a, b: torch.div(a, b, rounding_mode="trunc") + 1,
    "div_floor": lambda a, b: torch.div(a, b, rounding_mode="floor") - 1,
}


@dataclass
class Case:
    op: str
    inputs: list[torch.Tensor]

    def __str__(self) -> str:
        return f"{self.op}({', '.join(str(t.tolist()) for t in self.inputs)})"


def draw(rng: random.Random) -> Case:
    if rng.random() < 0.5:
        op = rng.choice(sorted(INDEX_OPS))
        rows, cols = rng.choice([1, 3, 5, 8]), rng.choice([1, 2, 4, 7])
        size = rows if op in ("index", "gather", "embedding") else cols
        pool = [0, 1, size - 1, -1, -size, size, size + 1, -size - 1, 10 ** 9, -10 ** 9]
        k = rng.choice([1, 2, 4, 6])
        # mostly in range (an error must not hide behind an earlier one), sometimes one bad value
        idx = [rng.randrange(size) for _ in range(k)]
        if rng.random() < 0.7:
            idx[rng.randrange(k)] = rng.choice(pool)
        table = torch.randn(rows, cols, generator=torch.Generator().manual_seed(rng.randrange(2 ** 31)))
        return Case(op, [table, torch.tensor(idx, dtype=rng.choice([torch.int64, torch.int32]))])
    op = rng.choice(sorted(DIV_OPS))
    dtype = rng.choice([torch.int32, torch.int64])
    lo, hi = torch.iinfo(dtype).min, torch.iinfo(dtype).max
    n = rng.choice([1, 3, 5])
    a = [rng.choice([lo, hi, lo + 1, -7, 9, 0, 12]) for _ in range(n)]
    b = [rng.choice([-1, 2, -3, 5, 1]) for _ in range(n)]
    if rng.random() < 0.4:
        b[rng.randrange(n)] = 0
    return Case(op, [torch.tensor(a, dtype=dtype), torch.tensor(b, dtype=dtype)])


def _fn(case: Case) -> Callable:
    return INDEX_OPS.get(case.op) or DIV_OPS[case.op]


def expected(case: Case) -> tuple[Any, BaseException | None]:
    """Eager's result or error, without running the divisions that trap in eager (by -1)."""
    fn = _fn(case)
    if case.op not in DIV_OPS:
        try:
            return fn(*case.inputs), None
        except Exception as e:      # noqa: BLE001 - the error is what is compared
            return None, e
    a, b = case.inputs
    minus1 = b == -1
    try:
        out = fn(a, torch.where(minus1, torch.ones_like(b), b))
    except Exception as e:          # noqa: BLE001
        return None, e
    by_minus1 = fn(torch.neg(a), torch.ones_like(b)) if case.op in ("floordiv", "div_trunc", "div_floor") \
        else fn(torch.zeros_like(a), torch.ones_like(b))
    return torch.where(minus1, by_minus1, out), None


def run_case(case: Case, mode: str) -> str | None:
    """None when torchfuse agrees with eager on `case` in `mode` (a CPU backend, "cpp" or
    "triton", or "lazy"), else what differs."""
    import torchfuse
    want, error = expected(case)
    fn = _fn(case)
    inputs = [t.clone() for t in case.inputs]
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            if mode == "lazy":
                with torchfuse.lazy():
                    got = fn(*inputs)
                    got = got.clone()
                got = torch.as_tensor(got.tolist(), dtype=got.dtype) if got.ndim else got
            else:
                torch._dynamo.reset()
                # (a backend's name: cpp, triton; the first call waits for the compiled graph)
                options = {"strict": True, "cpu_backend": mode, "first_calls": "wait"}
                got = torch.compile(fn, backend="torchfuse", options=options, dynamic=False)(*inputs)
    except Exception as e:          # noqa: BLE001
        if error is None:
            return f"raised {type(e).__name__}: {e}; eager gave {want}"
        if not _same_kind(e, error):
            return f"raised {type(e).__name__}: {e}; eager raised {type(error).__name__}: {error}"
        return None
    finally:
        torch._dynamo.reset()
    if error is not None:
        return f"gave {got}; eager raised {type(error).__name__}: {error}"
    try:
        torch.testing.assert_close(got, want)      # (exact for the integer divisions)
    except AssertionError:
        return f"gave {got}; eager gave {want}"
    return None


def _same_kind(got: BaseException, want: BaseException) -> bool:
    """Eager's kind: its class (IndexError, RuntimeError), and a division by zero as one."""
    if "ZeroDivisionError" in str(want):
        return isinstance(got, ZeroDivisionError) or "ZeroDivisionError" in str(got)
    return isinstance(got, type(want))


def run(examples: int, seed: int = 0, mode: str = "cpp") -> list[tuple[Case, str]]:
    """`examples` cases in `mode`; the failures, with what differed."""
    rng = random.Random(seed)
    failures = []
    for _ in range(examples):
        case = draw(rng)
        msg = run_case(case, mode)
        if msg is not None:
            failures.append((case, msg))
    return failures
