"""Fuzzer regression 02ce3af683a4: a minimal program on which torchfuse disagreed with eager.

Found by `torchfuse.tools.fuzz` (hypothesis shrank it); the error was:

    SyntaxError: invalid decimal literal (tf_8894f7bdc78ed0b6fa414fe14e27e477.py, line 92)
"""
import os

import pytest
import torch

from torchfuse.tools.fuzz import InputSpec, check, make_inputs

os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

INPUTS = [
    InputSpec(shape=(5, 5), dtype='float32', layout='contiguous', seed=0),
    InputSpec(shape=(), dtype='pyfloat', layout='contiguous', seed=1),
]
OPTIONS = {'cpu_backend': 'triton'}


def program(a0, a1):
    v0 = torch.full_like(a0, 0.0, dtype=torch.int64)
    return (v0,)


def test_case_02ce3af683a4():
    check(program, make_inputs(INPUTS), options=OPTIONS)
