"""Fuzzer regression 7b6015086fe0: a minimal program on which torchfuse disagreed with eager.

Found by `torchfuse.tools.fuzz` (hypothesis shrank it); the error was:

    Mismatch: output 1: Tensor-likes are not close! Mismatched elements: 2 / 5 (40.0%) Greatest
    absolute difference: 4.123537063598633 at index (0, 3) (up to 0.0001 allowed) Greatest
    relative difference: 1.0 at index (0, 1) (up to 0.0001 allowed)

Fixed in lowering.py `_lower_outputs` (only an output covering its whole storage may be
the base other outputs alias): v2, a strided view of the unrealized v0, was lowered first into a
buffer with v2's strides (5, 2), and v1 became a view of that buffer: silently wrong values.
"""
import torch

from torchfuse.tools.fuzz import InputSpec, check, make_inputs

INPUTS = [
    InputSpec(shape=(1, 5), dtype='float32', layout='contiguous', seed=0),
    InputSpec(shape=(5, 5), dtype='float32', layout='contiguous', seed=1),
    InputSpec(shape=(1, 5), dtype='float32', layout='contiguous', seed=2),
]
OPTIONS = {}


def program(a0, a1, a2):
    v0 = torch.add(a2, a0)
    v1 = v0.permute(0, 1)
    v2 = v0[:, 0::2]
    return (v2, v1,)


def test_case_7b6015086fe0():
    check(program, make_inputs(INPUTS), options=OPTIONS)
