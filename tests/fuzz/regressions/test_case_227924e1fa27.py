"""Fuzzer regression 227924e1fa27: a minimal program on which torchfuse disagreed with eager.

Found by `torchfuse.tools.fuzz` (hypothesis shrank it); the error was:

    InterpreterError: ValueError("Expected pointer argument to have shape ['constexpr[1]',
    'constexpr[2]'] but got ['constexpr[1]', 'constexpr[1]']")
"""
import os

import pytest
import torch

from torchfuse.tools.fuzz import InputSpec, check, make_inputs

os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

INPUTS = [
    InputSpec(shape=(5,), dtype='float32', layout='contiguous', seed=0),
    InputSpec(shape=(1,), dtype='float32', layout='contiguous', seed=1),
]
OPTIONS = {'dynamic': True, 'cpu_backend': 'triton'}


def program(a0, a1):
    v0 = torch.neg(a1)
    v1 = torch.neg(v0)
    v2 = torch.neg(v1)
    v3 = v2.repeat(2)
    v4 = torch.add(v2, v2)
    v5 = v3.sum()
    return (v5, v4,)


def test_case_227924e1fa27():
    check(program, make_inputs(INPUTS), options=OPTIONS)
