"""Fuzzer regression 129ab0af318c: a minimal program on which torchfuse disagreed with eager.

Found by `torchfuse.tools.fuzz` (hypothesis shrank it); the error was:

    Mismatch: output 0: Scalars are not equal! Expected 0 but got 2147483647. Absolute
    difference: 2147483647 Relative difference: inf
"""
import os

import pytest
import torch

from torchfuse.tools.fuzz import InputSpec, check, make_inputs

os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

INPUTS = [
    InputSpec(shape=(), dtype='float32', layout='contiguous', seed=0),
    InputSpec(shape=(), dtype='float32', layout='contiguous', seed=1),
]
OPTIONS = {'cpu_backend': 'triton'}


def program(a0, a1):
    v0 = torch.sqrt(a0)
    v1 = v0.min(0).indices
    return (v1,)


def test_case_129ab0af318c():
    check(program, make_inputs(INPUTS), options=OPTIONS)
