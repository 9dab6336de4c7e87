"""Fuzzer regression 07a4a17efac1: a minimal program on which torchfuse disagreed with eager.

Found by `torchfuse.tools.fuzz` (hypothesis shrank it); the error was:

    Mismatch: output 0: Tensor-likes are not close! Mismatched elements: 50 / 50 (100.0%)
    Greatest absolute difference: 7.970020294189453 at index (3, 2) (up to 0.0001 allowed)
    Greatest relative difference: 1.0 at index (0, 0) (up to 0.0001 allowed)
"""
import torch

from torchfuse.tools.fuzz import InputSpec, check, make_inputs

INPUTS = [
    InputSpec(shape=(5, 5), dtype='float32', layout='contiguous', seed=0),
]
OPTIONS = {}


def program(a0):
    v0 = a0.add_(a0)
    v1 = torch.neg(v0)
    v2 = torch.cat([v1, v1], 0)
    return (v2,)


def test_case_07a4a17efac1():
    check(program, make_inputs(INPUTS), options=OPTIONS)
