"""torchfuse: a small, readable fusing compiler for PyTorch.

    torch.compile(model, backend="torchfuse")      # through Dynamo + AOTAutograd
    torchfuse.compile(model)                       # the same with torchfuse's defaults
    torch.compile(model, backend=torchfuse.backend(options={...}))   # options checked at once
    torchfuse.explain(fn, *args)                   # what was fused, what fell back, and why
    torchfuse.counters                             # process-wide counters
"""
from .config import Config
from .counters import counters
from .api import compile, backend, explain, Explanation, KernelInfo, FallbackInfo
from .lazy import lazy
from .extend import register_pass, register_decomposition, register_lowering
from .runtime import cache_artifacts as _cache_artifacts
from .runtime.kernel_errors import check_kernel_errors

_cache_artifacts.register()    # before any torch.compiler.load_cache_artifacts() of this process

__all__ = ["Config", "counters", "compile", "backend", "explain", "Explanation", "KernelInfo", "FallbackInfo", "lazy",
           "register_pass", "register_decomposition", "register_lowering", "check_kernel_errors"]
__version__ = "0.1.0"
