"""Fuzzer regression 6c2c679ce244: a minimal program on which torchfuse disagreed with eager.

Found by `torchfuse.tools.fuzz` (hypothesis shrank it); the error was:

    ZeroDivisionError: integer modulo by zero

Fixed: lower_views.py `_repeat` (and `_view`, `_roll`) of an empty tensor computed index
maths modulo the zero size.
"""
import torch

from torchfuse.tools.fuzz import InputSpec, check, make_inputs

INPUTS = [
    InputSpec(shape=(5, 5, 5), dtype='float32', layout='contiguous', seed=0),
]
OPTIONS = {}


def program(a0):
    v0 = torch.neg(a0)
    v1 = torch.neg(v0)
    v2 = torch.neg(v1)
    v3 = v2[0:0]
    v4 = torch.neg(v3)
    v5 = v4.repeat(1, 1, 1)
    return (v5,)


def test_case_6c2c679ce244():
    check(program, make_inputs(INPUTS), options=OPTIONS)
