"""Fuzzer regression 8dd457df61f7: a minimal program on which torchfuse disagreed with eager.

Found by `torchfuse.tools.fuzz` (hypothesis shrank it); the error was:

    InterpreterError: ValueError('mask has unsupported dtype')
"""
import os

import pytest
import torch

from torchfuse.tools.fuzz import InputSpec, check, make_inputs

os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

INPUTS = [
    InputSpec(shape=(5, 5, 5), dtype='float32', layout='transposed', seed=0),
]
OPTIONS = {'dynamic': True, 'cpu_backend': 'triton'}


def program(a0):
    v0 = torch.cat([a0, a0], 1)
    return (v0,)


def test_case_8dd457df61f7():
    check(program, make_inputs(INPUTS), options=OPTIONS)
