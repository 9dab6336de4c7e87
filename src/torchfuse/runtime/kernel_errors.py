"""The errors a generated kernel's run-time checks raise (codegen/checks.py), of eager's kinds.

Eager raises IndexError for an index out of range (RuntimeError for gather's) and RuntimeError
("ZeroDivisionError") for an integer division by zero; these classes are both, so code written
against either catches them."""
from __future__ import annotations

import ctypes
from typing import Any, Sequence


class KernelIndexError(IndexError, RuntimeError):
    """An index out of range for the dim it indexes (eager: IndexError, or RuntimeError)."""


class KernelZeroDivisionError(ZeroDivisionError, RuntimeError):
    """An integer division by zero (eager: RuntimeError "ZeroDivisionError")."""


def error_for(site: tuple[str, str], value: int, size: int) -> Exception:
    kind, what = site
    if kind == "index":
        op, _, dim = what.partition(" dim ")
        return KernelIndexError(f"index {value} is out of bounds for dimension {dim or 0} with size {size} "
                                f"(torchfuse: {op})")
    return KernelZeroDivisionError(f"ZeroDivisionError (torchfuse: integer {what} by zero)")


def raise_cpp_error(sites: Sequence[tuple[str, str]], last_error: Any) -> None:
    """A C++ kernel returned non-zero: read which check failed and raise its error."""
    info = (ctypes.c_int64 * 3)()
    last_error(info)
    raise error_for(sites[info[0]], info[1], info[2])


SENTINEL = -2 ** 63      # an error slot no check has written


def check_triton_errors(slots: Any, sites: Sequence[tuple[str, str]], sizes: Sequence[int]) -> None:
    """After a graph's Triton kernels: raise the error of a check that failed.  On a GPU this
    reads the slots back (one synchronization per graph with checks); while a CUDA graph is
    being captured it cannot, and the capture's replays are not checked."""
    import torch
    if slots.is_cuda and torch.cuda.is_current_stream_capturing():
        return
    values = slots.tolist()
    for k, v in enumerate(values):
        if v != SENTINEL:
            slots.fill_(SENTINEL)
            raise error_for(sites[k], v, sizes[k])
