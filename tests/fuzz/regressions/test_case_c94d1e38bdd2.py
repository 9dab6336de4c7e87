"""Fuzzer regression c94d1e38bdd2: a minimal program on which torchfuse disagreed with eager.

Found by `torchfuse.tools.fuzz` (hypothesis shrank it); the error was:

    RuntimeError: setStorage: sizes [5, 5], strides [5, 1], storage offset 0, and itemsize 4
    requiring a storage size of 100 are out of bounds for storage of size 20
"""
import pytest
import torch

from torchfuse.tools.fuzz import InputSpec, check, make_inputs

INPUTS = [
    InputSpec(shape=(5, 5), dtype='float32', layout='contiguous', seed=0),
]
OPTIONS = {}


def program(a0):
    v0 = torch.neg(a0)
    v1 = v0.select(0, 0)
    return (v1, v0,)


@pytest.mark.xfail(raises=RuntimeError, strict=False, reason=(
    "lowering.py GraphLowering._lower_outputs: v1 (a view of the unrealized v0) is lowered first and "
    "becomes a 5-element buffer; v0 shares its fake storage, so it is made an AliasView of that "
    "buffer with 25 elements: out of bounds (see tests/opinfo/test_known_failures.py)"))
def test_case_c94d1e38bdd2():
    check(program, make_inputs(INPUTS), options=OPTIONS)
