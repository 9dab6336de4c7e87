"""The user-facing entry points: `compile`, `explain` and the `Explanation` report."""
from __future__ import annotations

from typing import Any, Callable, Mapping

import torch

from .config import Config
from .report import Explanation, FallbackInfo, KernelInfo

__all__ = ["compile", "explain", "Explanation", "KernelInfo", "FallbackInfo"]


def compile(fn: Callable | None = None, *, mode: str | None = None, dynamic: bool | None = None,
            fullgraph: bool = False, options: Mapping[str, Any] | None = None) -> Callable:
    """`torch.compile(fn, backend="torchfuse")` with torchfuse's defaults; usable as a decorator."""
    from .frontend.dynamo import TorchfuseBackend

    def wrap(f: Callable) -> Callable:
        backend = TorchfuseBackend(Config.from_options(options, mode=mode))
        return torch.compile(f, backend=backend, dynamic=dynamic, fullgraph=fullgraph)

    return wrap if fn is None else wrap(fn)


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
