"""Helpers for the torchfuse.lazy tests: run a function eagerly and inside a lazy block and
compare, with the block's flush log for assertions about what was compiled."""
from __future__ import annotations

from typing import Any, Callable

import torch

import torchfuse
from torchfuse import counters
from torchfuse.lazy import LazyContext


def flat(x: Any) -> list:
    if isinstance(x, (list, tuple)):
        return [y for item in x for y in flat(item)]
    return [x]


def run_lazy(fn: Callable, *args: Any, options: dict | None = None, **kw: Any) -> tuple[Any, LazyContext]:
    """`fn(*args)` inside a strict lazy block (a kernel that fails to build raises)."""
    with torchfuse.lazy(options={"strict": True, **(options or {})}, **kw) as ctx:
        out = fn(*args)
    return out, ctx


def check(tf: Any, fn: Callable, *args: Any, atol: float | None = None, rtol: float | None = None,
          min_kernels: int = 1, check_stride: bool = True) -> LazyContext:
    """Eager vs lazy: same structure, shapes, dtypes, strides and values; every op went through
    torchfuse (no eager fallback) and at least `min_kernels` kernels ran."""
    expected = fn(*args)
    before = counters["eager_fallbacks"]
    got, ctx = run_lazy(fn, *args)
    assert counters["eager_fallbacks"] == before, "a pending graph ran eagerly"
    tf.assert_same(got, expected, atol=atol, rtol=rtol, check_stride=check_stride)
    for g in flat(got):
        if isinstance(g, torch.Tensor):
            torch.testing.assert_close(g.clone(), g)     # usable after the block
    assert ctx.kernels >= min_kernels, ctx.explain()
    return ctx
