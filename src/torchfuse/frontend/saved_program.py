"""Saved programs: `aot_compile` a function with torchfuse, save it, load it in a new process.

    compiled = torch.compile(fn, fullgraph=True, backend="torchfuse").aot_compile(((x,), {}))
    compiled.save_compiled_function("fn.tf")
    ...                                                    # another process
    with open("fn.tf", "rb") as f:
        fn = torch.compiler.load_compiled_function(f)      # no Dynamo, no AOTAutograd

`aot_compile` hands the saved file the backend's result, which must be a `SerializableCallable`.
Under `aot_compile` torchfuse's backend returns a `SavedProgram`: AOTAutograd's bundled cache
entry (what the graph cache stores: runtime wrappers, forward and backward `TorchfuseCode`s) plus
the `Config` it was compiled with.  Loading registers that Config's compiler, then lets AOTAutograd
rebuild its wrappers from the entry, which calls each `TorchfuseCode.post_compile`.

Each `TorchfuseCode` carries its generated code (graph_cache.py's `capture`): the Python wrapper, its constants,
the kernel sources (C++ or Triton) and the parameter-only prologue.  `restore` links that again:
the kernels come from the kernel cache (g++ runs only if the library was evicted; Triton's
binaries come from Triton's own cache), so torchfuse's passes, lowering, scheduling and codegen
do not run either.  Anything `restore` cannot use (a damaged blob, other torchfuse source,
CUDA-graph graphs, a constant it cannot pickle) falls back
to re-running torchfuse's stages on the stored aten graph, as a graph-cache hit always did.
The graph cache's restarts take the same path.
"""
from __future__ import annotations

import dataclasses
import functools
import logging
import pickle
from typing import Any, Callable

import torch

from ..config import Config
from ..passes import check_names
# (upsample_training: its torchfuse:: ops, which stored graphs may call, exist once it is imported)
from . import graph_cache, upsample_training  # noqa: F401
from .graph_cache import in_aot_compile  # noqa: F401  (dynamo asks here)
from .graph_compile import compile_aten_graph

log = logging.getLogger("torchfuse")

_FORMAT = 2

# --- the program aot_compile saves -----------------------------------------------------------

def _serializable_callable() -> type:
    """torch's SerializableCallable, the base aot_compile wants; a clear error where this torch
    has none."""
    try:
        from torch._dynamo.aot_compile_types import SerializableCallable
    except ImportError:
        try:                                      # (before it had a module of its own)
            from torch._dynamo.aot_compile import SerializableCallable  # type: ignore[no-redef]
        except ImportError as e:
            raise RuntimeError(_unsupported(e)) from e
    return SerializableCallable


def _deserialize_bundled_cache_entry() -> Callable:
    """AOTAutograd's rebuild of its runtime wrappers from a bundled entry (imported only when a
    program is loaded: the module pulls in much of Inductor, ~0.1 s)."""
    try:
        from torch._functorch._aot_autograd.aot_autograd_result import deserialize_bundled_cache_entry
    except ImportError:
        try:
            from torch._functorch._aot_autograd.autograd_cache import (  # type: ignore[no-redef]
                deserialize_bundled_cache_entry,
            )
        except ImportError as e:
            raise RuntimeError(_unsupported(e)) from e
    return deserialize_bundled_cache_entry


def _unsupported(e: Exception) -> str:
    return (f"torchfuse: saving compiled programs (torch.compile(...).aot_compile and "
            f"torch.compiler.load_compiled_function) is not supported on torch {torch.__version__}: {e}")


try:
    _Base: type = _serializable_callable()
except RuntimeError:
    _Base = object      # (saving then raises from `check_can_save`, with the reason)


class SavedProgram(_Base):  # type: ignore[misc,valid-type]
    """What torchfuse's backend returns under `aot_compile`: AOTAutograd's compiled function,
    serializable as its bundled cache entry and torchfuse's Config."""

    def __init__(self, compiled_fn: Callable, config: Config, key: str):
        self.compiled_fn, self.config, self.key = compiled_fn, config, key

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.compiled_fn(*args, **kwargs)

    @classmethod
    def serialize_compile_artifacts(cls, fn: "SavedProgram") -> bytes:
        with torch._functorch.config.patch(bundled_autograd_cache=True):
            entry = fn.compiled_fn.serialize()
        # where files go is the loading process's business (its TORCHFUSE_CACHE_DIR), not ours
        options = {f.name: getattr(fn.config, f.name) for f in dataclasses.fields(fn.config)
                   if f.name not in ("cache_dir", "debug", "debug_dir")}
        return pickle.dumps({"format": _FORMAT, "options": options, "key": fn.key, "entry": entry})

    @classmethod
    def deserialize_compile_artifacts(cls, data: bytes) -> "SavedProgram":
        deserialize_bundled_cache_entry = _deserialize_bundled_cache_entry()
        state = pickle.loads(data)
        if state.get("format") != _FORMAT:
            raise RuntimeError("torchfuse: this saved program was written by another torchfuse version; save it again")
        config = Config.from_options(state["options"])
        check_names(config.passes)
        # the stored graphs name their compiler by the key they were saved with: a graph whose
        # generated code cannot be restored is compiled again with this Config
        graph_cache.register(state["key"], functools.partial(compile_aten_graph, config, None), config)
        compiled = deserialize_bundled_cache_entry(state["entry"])
        return cls(compiled, config, state["key"])


def check_can_save(config: Config) -> None:
    """Raise, saying why, where a program compiled with `config` on this torch cannot be saved
    (before compiling: AOTAutograd itself fails obscurely on a result that cannot serialize)."""
    _serializable_callable()
    _deserialize_bundled_cache_entry()
    if not graph_cache.usable(config):
        raise RuntimeError("torchfuse: aot_compile saves a program through the graph cache, which is off "
                           "(options={'graph_cache': False}, or it failed earlier in this process)")


def wrap(compiled: Callable, config: Config) -> Callable:
    """`compiled` (AOTAutograd's result) as a SavedProgram, or a clear error why it cannot be."""
    if getattr(compiled, "serialize", None) is None:
        raise RuntimeError(f"torchfuse: aot_compile cannot save this program: AOTAutograd on torch "
                           f"{torch.__version__} returned no serializable result")
    return SavedProgram(compiled, config, graph_cache.config_key(config))
