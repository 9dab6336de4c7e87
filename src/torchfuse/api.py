"""The user-facing entry points: `compile`, `explain` and the `Explanation` report."""
from __future__ import annotations

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

    Dynamo's caches are reset first so that the report describes a fresh compilation.
    """
    from .frontend.dynamo import TorchfuseBackend

    from .counters import counters

    torch._dynamo.reset()
    report = Explanation()
    backend = TorchfuseBackend(Config.from_options(options), report=report)
    compiled = torch.compile(fn, backend=backend)
    before = dict(counters.seconds)
    report.output = compiled(*args, **kwargs)
    report.stage_seconds = {k: v - before.get(k, 0.0) for k, v in counters.seconds.items()
                            if v - before.get(k, 0.0) > 0}
    torch._dynamo.reset()
    return report
