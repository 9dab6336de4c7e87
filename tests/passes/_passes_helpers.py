"""Shared helpers for the graph pass tests: trace to aten, count nodes, compare with eager."""
from __future__ import annotations

from typing import Any, Callable, Sequence

import torch
import torch.fx as fx
from torch.fx.experimental.proxy_tensor import make_fx

from torchfuse.passes import PassContext, run_passes


def trace(fn: Callable, *inputs: Any, mode: str = "fake") -> fx.GraphModule:
    """An aten graph with meta["val"] on every node, like the ones AOTAutograd hands us."""
    return make_fx(fn, tracing_mode=mode)(*inputs)


def run(gm: fx.GraphModule, *names: str, inference: bool = False) -> int:
    """Run passes; return the total number of changes."""
    return sum(r.changes for r in run_passes(gm, names, PassContext(inference=inference)))


def targets(gm: fx.GraphModule) -> list[Any]:
    return [n.target for n in gm.graph.nodes if n.op == "call_function"]


def count(gm: fx.GraphModule, target: Any) -> int:
    return sum(1 for t in targets(gm) if t is target)


def n_calls(gm: fx.GraphModule) -> int:
    return len(targets(gm))


def flat(x: Any) -> list[Any]:
    return list(x) if isinstance(x, (list, tuple)) else [x]


def assert_same(actual: Any, expected: Any, *, exact: bool = True, **tol: Any) -> None:
    """Compare (bit-exactly by default, -0.0 vs 0.0 included) outputs of the graph and eager."""
    actual, expected = flat(actual), flat(expected)
    assert len(actual) == len(expected)
    for a, e in zip(actual, expected):
        assert a.shape == e.shape and a.dtype == e.dtype, (a.shape, e.shape, a.dtype, e.dtype)
        if exact:
            torch.testing.assert_close(a, e, rtol=0, atol=0, equal_nan=True)
            if a.is_floating_point():
                assert torch.equal(a.signbit(), e.signbit()), "sign of zero changed"
        else:
            torch.testing.assert_close(a, e, equal_nan=True, **tol)


def check(fn: Callable, gm: fx.GraphModule, inputs: Sequence[Any], **kw: Any) -> None:
    """The rewritten graph computes what eager `fn` computes on `inputs`."""
    assert_same(gm(*inputs), fn(*inputs), **kw)


def inputs_of(dtype: torch.dtype, *shape: int, noncontig: bool = False) -> torch.Tensor:
    """Random non-zero test data; integers in [-9, 9] \\ {0}; optionally a transposed view."""
    full = (*shape[:-2], shape[-1], shape[-2]) if noncontig and len(shape) >= 2 else shape
    if dtype.is_floating_point:
        t = (torch.rand(full) + 0.25) * torch.where(torch.rand(full) < 0.5, -1.0, 1.0)
        t = t.to(dtype)
    else:
        t = torch.randint(1, 10, full) * torch.where(torch.rand(full) < 0.5, -1, 1)
        t = t.to(dtype)
    return t.transpose(-1, -2) if noncontig and len(shape) >= 2 else t


# the input flavours every value-checking test runs on
FLAVOURS = [(torch.float32, False), (torch.float16, False), (torch.int64, False), (torch.float32, True)]
FLAVOUR_IDS = ["fp32", "fp16", "int64", "fp32-noncontig"]
