"""The fuzzer's adversarial values (torchfuse.tools.fuzz_bad_values) in CI: out-of-range and
negative indices, zero and -1 divisors with INT_MIN, through the C++ backend, Triton under its
interpreter and the lazy mode: eager's result or eager's kind of error, never a wrong value or a
crash.  TORCHFUSE_FUZZ_EXAMPLES scales the number of cases."""
from __future__ import annotations

import os

import pytest

from torchfuse.tools import fuzz_bad_values

EXAMPLES = max(4, int(os.environ.get("TORCHFUSE_FUZZ_EXAMPLES", "40")) // 2)


@pytest.mark.parametrize("mode", ["cpp", "triton", "lazy"])
def test_adversarial_values(mode):
    if mode == "triton":
        pytest.importorskip("triton")
        os.environ.setdefault("TRITON_INTERPRET", "1")
    failures = fuzz_bad_values.run(EXAMPLES if mode != "triton" else EXAMPLES // 2, seed=3, mode=mode)
    assert not failures, "\n".join(f"{case}: {msg}" for case, msg in failures[:5])


def test_cases_cover_every_kind():
    """The draw makes both kinds of case, with bad values and good ones."""
    import random
    rng = random.Random(3)
    cases = [fuzz_bad_values.draw(rng) for _ in range(60)]
    ops = {c.op for c in cases}
    assert ops >= set(fuzz_bad_values.INDEX_OPS) | set(fuzz_bad_values.DIV_OPS), ops
    errors = [fuzz_bad_values.expected(c)[1] for c in cases]
    assert any(e is None for e in errors) and any(isinstance(e, IndexError) for e in errors)
    assert any(e is not None and "ZeroDivisionError" in str(e) for e in errors)
