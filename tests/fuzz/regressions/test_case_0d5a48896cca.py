"""Fuzzer regression 0d5a48896cca: a minimal program on which torchfuse disagreed with eager.

Found by `torchfuse.tools.fuzz` (hypothesis shrank it); the error was:

    IndexError: tuple index out of range
"""
import torch

from torchfuse.tools.fuzz import InputSpec, check, make_inputs

INPUTS = [
    InputSpec(shape=(5,), dtype='float32', layout='contiguous', seed=0),
    InputSpec(shape=(5,), dtype='float32', layout='contiguous', seed=1),
    InputSpec(shape=(), dtype='pyfloat', layout='contiguous', seed=2),
]
OPTIONS = {'dynamic': True}


def program(a0, a1, a2):
    a1[0] = 0
    return (a1,)


def test_case_0d5a48896cca():
    check(program, make_inputs(INPUTS), options=OPTIONS)
