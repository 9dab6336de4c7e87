"""Code generators: `base.Backend` is the interface, one folder per backend implements it.

The registry below is the one place that names backends.  A backend is imported only when a
graph needs it (Triton is an optional dependency).
"""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ..config import Config
    from ..scheduler.split import SplitParams
    from .base import Backend

# name -> "module:class"; a new backend is one line here (and a folder beside this file)
REGISTRY: dict[str, str] = {
    "cpp": "torchfuse.backends.cpp:CppBackend",
    "triton": "torchfuse.backends.triton:TritonBackend",
}
# The backend of each device type; any other device (the CPU) takes Config.cpu_backend.
DEVICE_BACKENDS: dict[str, str] = {"cuda": "triton"}

_instances: dict[tuple[str, str], "Backend"] = {}


def name_for(device_type: str, config: Config) -> str:
    """The name of the backend that compiles graphs on `device_type` under `config`."""
    return DEVICE_BACKENDS.get(device_type, config.cpu_backend)


def by_name(name: str, device_type: str = "cpu") -> Backend:
    """The backend registered as `name`, for graphs on `device_type`."""
    key = (name, device_type)
    backend = _instances.get(key)
    if backend is None:
        module, _, cls = REGISTRY[name].partition(":")
        backend = _instances[key] = getattr(importlib.import_module(module), cls)(device_type)
    return backend


def for_device(device: Any, config: Config) -> Backend:
    """The backend of a graph on `device` (a torch.device or its type's name)."""
    device_type = getattr(device, "type", device) or "cpu"
    return by_name(name_for(device_type, config), device_type)


def split_params(device: Any, config: Config) -> SplitParams:
    """How reductions split on `device`; a CUDA graph traced where no GPU is present (tests)
    gets the CPU's."""
    import torch
    device_type = getattr(device, "type", device) or "cpu"
    if device_type == "cuda" and not torch.cuda.is_available():
        device_type = "cpu"
    return for_device(device_type, config).split_params(config.num_threads or torch.get_num_threads(),
                                                        config.split_min_chunk)
