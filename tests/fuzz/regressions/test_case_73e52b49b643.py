"""Fuzzer regression 73e52b49b643: a minimal program on which torchfuse disagreed with eager.

Found by `torchfuse.tools.fuzz` (hypothesis shrank it); the error was:

    InterpreterError: AssertionError('only accepts size-1 tensor')
"""
import os

import pytest
import torch

from torchfuse.tools.fuzz import InputSpec, check, make_inputs

os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

INPUTS = [
    InputSpec(shape=(5, 1), dtype='float32', layout='contiguous', seed=0),
]
OPTIONS = {'dynamic': True, 'cpu_backend': 'triton'}


def program(a0):
    v0 = torch.topk(a0.float(), 1, dim=0).indices + 1
    v1 = torch.add(v0, a0)
    return (v1,)


def test_case_73e52b49b643():
    check(program, make_inputs(INPUTS), options=OPTIONS)
