"""Fuzzer regression 2c455c86cc46: a minimal program on which torchfuse disagreed with eager.

Found by `torchfuse.tools.fuzz` (hypothesis shrank it); the error was:

    InterpreterError: OverflowError('Python integer 1099511627776 out of bounds for int32')
"""
import os

import pytest
import torch

from torchfuse.tools.fuzz import InputSpec, check, make_inputs

os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

INPUTS = [
    InputSpec(shape=(), dtype='int32', layout='contiguous', seed=0),
    InputSpec(shape=(), dtype='pyfloat', layout='contiguous', seed=1),
]
OPTIONS = {'cpu_backend': 'triton'}


def program(a0, a1):
    v0 = (a0 > 2 ** 40).to(torch.int64)
    return (v0,)


def test_case_2c455c86cc46():
    check(program, make_inputs(INPUTS), options=OPTIONS)
