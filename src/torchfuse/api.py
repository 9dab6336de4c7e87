"""The user-facing entry points: `compile`, `explain` and the `Explanation` report."""
from __future__ import annotations

import os
from typing import Any, Callable, Mapping

import torch

from .config import Config
from .report import Explanation, FallbackInfo, KernelInfo

__all__ = ["compile", "backend", "explain", "Explanation", "KernelInfo", "FallbackInfo"]


def compile(fn: Callable | None = None, *, mode: str | None = None, dynamic: bool | None = None,
            fullgraph: bool = False, options: Mapping[str, Any] | None = None) -> Callable:
    """`torch.compile(fn, backend="torchfuse")` with torchfuse's defaults; usable as a decorator.
    Bad options raise here, not at the first call."""
    from .frontend.dynamo import TorchfuseBackend
    config = Config.from_options(options, mode=mode)       # (checked now, decorator or not)

    def wrap(f: Callable) -> Callable:
        return torch.compile(f, backend=TorchfuseBackend(config), dynamic=dynamic, fullgraph=fullgraph)

    return wrap if fn is None else wrap(fn)


def backend(*, mode: str | None = None, options: Mapping[str, Any] | None = None) -> Callable:
    """A torchfuse backend with these options, checked now: `torch.compile(model,
    backend=torchfuse.backend(options={...}))`.  (`torch.compile(model, backend="torchfuse",
    options={...})` cannot check them before the first call: torch hands a backend named by a
    string its options only when it compiles a graph, and wraps what the backend raises then in
    BackendCompilerFailed.)"""
    from .frontend.dynamo import TorchfuseBackend
    return TorchfuseBackend(Config.from_options(options, mode=mode))


def explain(fn: Callable, *args: Any, options: Mapping[str, Any] | None = None, **kwargs: Any) -> Explanation:
    """Compile `fn` with torchfuse, run it once on `args`, and report what was generated.

    Dynamo's caches are reset first so that the report describes a fresh compilation.  The run
    is the compiled graphs' (its output is theirs): it waits for kernels that compile in the
    background, unless `options` sets first_calls="eager" (the report then says which calls ran
    through ATen meanwhile).
    """
    from .frontend.dynamo import TorchfuseBackend

    from .counters import counters

    torch._dynamo.reset()
    report = Explanation()
    opts = dict(options or {})
    if "first_calls" not in opts and not os.environ.get("TORCHFUSE_FIRST_CALLS"):
        opts["first_calls"] = "wait"
    backend = TorchfuseBackend(Config.from_options(opts), report=report)
    compiled = torch.compile(fn, backend=backend)
    before = dict(counters.seconds)
    tiered = counters["calls_tiered"]
    report.output = compiled(*args, **kwargs)
    report.calls_tiered = counters["calls_tiered"] - tiered
    report.stage_seconds = {k: v - before.get(k, 0.0) for k, v in counters.seconds.items()
                            if v - before.get(k, 0.0) > 0}
    torch._dynamo.reset()
    return report
