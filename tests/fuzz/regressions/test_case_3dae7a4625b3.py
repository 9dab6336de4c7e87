"""Fuzzer regression 3dae7a4625b3: a minimal program on which torchfuse disagreed with eager.

Found by `torchfuse.tools.fuzz` (hypothesis shrank it); the error was:

    InterpreterError: AttributeError("'int' object has no attribute 'to'")
"""
import os

import pytest
import torch

from torchfuse.tools.fuzz import InputSpec, check, make_inputs

os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

INPUTS = [
    InputSpec(shape=(5, 5), dtype='int32', layout='contiguous', seed=0),
]
OPTIONS = {'dynamic': True, 'cpu_backend': 'triton'}


def program(a0):
    v0 = torch.isnan(a0)
    v1 = (v0 + 2)
    v2 = torch.neg(v1)
    v3 = torch.sin(v1)
    return (v3, v2,)


def test_case_3dae7a4625b3():
    check(program, make_inputs(INPUTS), options=OPTIONS)
