"""Fuzzer regression c94d1e38bdd2: a minimal program on which torchfuse disagreed with eager.

Found by `torchfuse.tools.fuzz` (hypothesis shrank it); the error was:

    RuntimeError: setStorage: sizes [5, 5], strides [5, 1], storage offset 0, and itemsize 4
    requiring a storage size of 100 are out of bounds for storage of size 20

Fixed in lowering.py `_lower_outputs` (only an output covering its whole storage may be
the base other outputs alias): v1, a view of the unrealized v0, was lowered first into a
5-element buffer and v0 became a 25-element view of it: out of bounds.
"""
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


def test_case_c94d1e38bdd2():
    check(program, make_inputs(INPUTS), options=OPTIONS)
