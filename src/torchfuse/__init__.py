"""torchfuse: a small, readable fusing compiler for PyTorch.

    torch.compile(model, backend="torchfuse")      # through Dynamo + AOTAutograd
    torchfuse.compile(model)                       # the same with torchfuse's defaults
    torch.compile(model, backend=torchfuse.backend(options={...}))   # options checked at once
    torchfuse.explain(fn, *args)                   # what was fused, what fell back, and why
    torchfuse.counters                             # process-wide counters
    torchfuse.wait_compiled()                      # wait for kernels compiling in the background
"""
from .config import Config
from .counters import counters
from .api import compile, backend, explain, Explanation, KernelInfo, FallbackInfo
from .lazy import lazy
from .extend import register_pass, register_decomposition, register_lowering
from .runtime import cache_artifacts as _cache_artifacts
from .runtime.kernel_errors import check_kernel_errors
from .runtime.tiered import wait_compiled

_cache_artifacts.register()    # before any torch.compiler.load_cache_artifacts() of this process


def _register_backend_name() -> None:
    """Name the Dynamo backend where no installed entry point does: a source tree on PYTHONPATH
    (a checkout, a benchmark's fresh child process) would otherwise raise InvalidBackend at
    torch.compile(backend="torchfuse") after `import torchfuse`.  The compiler itself is imported
    at the first compile, as through the entry point, so `import torchfuse` stays light."""
    from importlib.metadata import entry_points

    if any(ep.name == "torchfuse" for ep in entry_points(group="torch_dynamo_backends")):
        return
    import torch._dynamo

    def torchfuse(gm, example_inputs, **kwargs):
        from .frontend.dynamo import torchfuse_backend
        return torchfuse_backend(gm, example_inputs, **kwargs)

    try:
        torch._dynamo.register_backend(torchfuse, name="torchfuse")
    except AssertionError:      # registered already (by whoever imported the entry point's module)
        pass


_register_backend_name()

__all__ = ["Config", "counters", "compile", "backend", "explain", "Explanation", "KernelInfo", "FallbackInfo", "lazy",
           "register_pass", "register_decomposition", "register_lowering", "check_kernel_errors",
           "wait_compiled"]
__version__ = "0.1.0"
