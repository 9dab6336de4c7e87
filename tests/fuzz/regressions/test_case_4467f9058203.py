"""Fuzzer regression 4467f9058203: a minimal program on which torchfuse disagreed with eager.

Found by `torchfuse.tools.fuzz` (hypothesis shrank it); the error was:

    KernelIndexError: index 3329056722377468275 is out of bounds for dimension 0 with size 5
    (torchfuse: index_select)
"""
import torch

from torchfuse.tools.fuzz import InputSpec, check, make_inputs

INPUTS = [
    InputSpec(shape=(5, 5), dtype='float32', layout='contiguous', seed=0),
]
OPTIONS = {'dynamic': True}


def program(a0):
    v0 = torch.neg(a0)
    v1 = v0.index_select(0, (torch.arange(2) * 3 + 1) % 5)
    v2 = torch.cat([v1, v1], 0)
    v3 = torch.neg(v2)
    return (v3, v0,)


def test_case_4467f9058203():
    check(program, make_inputs(INPUTS), options=OPTIONS)
