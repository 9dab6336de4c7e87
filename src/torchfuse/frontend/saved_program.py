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

Each `TorchfuseCode` carries its generated code (`capture`): the Python wrapper, its constants,
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
import hashlib
import importlib
import io
import logging
import pickle
from typing import Any, Callable

import torch

from ..config import Config
from ..counters import counters

log = logging.getLogger("torchfuse")

_FORMAT = 2


# --- the generated code of one graph ---------------------------------------------------------

class _CodePickler(pickle.Pickler):
    """Pickles a wrapper's constants: torch's modules and ops by name (they are not picklable
    themselves), everything else as pickle does."""

    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, torch._ops._OpNamespace):    # (a module subclass: before modules)
            return _op, (obj.name,)
        if isinstance(obj, type(torch)):
            return importlib.import_module, (obj.__name__,)
        if isinstance(obj, torch._ops.OpOverloadPacket):
            ns, name = obj._qualified_op_name.split("::")
            return _op, (ns, name)
        if isinstance(obj, torch._ops.OpOverload):
            return _op, (obj.namespace, obj._schema.name.split("::")[1], obj._overloadname)
        if isinstance(obj, torch._ops.HigherOrderOperator) and hasattr(torch.ops.higher_order, obj.name()):
            # (with_effects: a fallback with effect tokens; its pickled form fails on a closure)
            return _op, ("higher_order", obj.name())
        reduce = getattr(obj, "_tf_reduce", None)       # a closure that says how to make it again
        if reduce is not None and callable(obj):
            return reduce
        return NotImplemented


def _op(*path: str) -> Any:
    out: Any = torch.ops
    for name in path:
        out = getattr(out, name)
    return out


def capture(call: Callable) -> bytes | None:
    """The generated code behind a compiled graph's callable, as bytes `restore` takes (a
    sha256 of the payload, then the payload); None where there is none to store (an eagerly run
    graph, a CUDA graph wrapper) or it does not pickle."""
    from ..runtime.static_values import StaticPrologue
    from .graph_cache import source_hash
    main = call.main if isinstance(call, StaticPrologue) else call
    code = getattr(main, "_torchfuse_code", None)
    if code is None:
        return None
    static = (call.const_gm, list(call.positions), call.frozen) if isinstance(call, StaticPrologue) else None
    payload = {"format": _FORMAT, "torch": torch.__version__, "source": source_hash(),
               "code": code, "static": static}
    buf = io.BytesIO()
    try:
        # AOTAutograd stores entries under its fake mode; a real constant (a CUDA tensor) must be
        # copied out for pickling as the real tensor it is
        from torch._subclasses.fake_tensor import unset_fake_temporarily
        with unset_fake_temporarily():
            _CodePickler(buf, protocol=pickle.HIGHEST_PROTOCOL).dump(payload)
    except Exception as e:     # a constant pickle cannot carry: loading re-runs the stages instead
        log.info("torchfuse: generated code not stored, a restart compiles this graph again (%s: %s)",
                 type(e).__name__, e)
        return None
    data = buf.getvalue()
    return hashlib.sha256(data).digest() + data


def restore(blob: bytes, config: Config) -> Callable | None:
    """The callable `capture` described, its kernels from the kernel cache; None (with the
    reason logged) when the blob is damaged or was made by other torchfuse source or torch."""
    from .graph_cache import source_hash
    digest, data = blob[:32], blob[32:]
    if hashlib.sha256(data).digest() != digest:
        log.warning("torchfuse: stored generated code failed its checksum; compiling the graph again")
        return None
    try:
        payload = pickle.loads(data)
    except (ImportError, AttributeError) as e:   # stored by a torchfuse whose classes lived elsewhere
        log.info("torchfuse: stored generated code is from another torchfuse (%s); compiling the graph again", e)
        return None
    if payload.get("format") != _FORMAT or payload["source"] != source_hash() or payload["torch"] != torch.__version__:
        log.info("torchfuse: stored generated code is from another torchfuse or torch; compiling the graph again")
        return None
    from ..passes.hoist_static import HoistedValues
    from ..pipeline import DebugWriter, build_and_link
    from ..runtime.static_values import StaticPrologue
    # the same build and link steps as compile_graph's, minus everything that produced their input
    call = build_and_link(payload["code"], config, DebugWriter(config, "loaded"))
    counters.bump("compiled_graph_loads")
    if payload["static"] is None:
        return call
    const_gm, positions, frozen = payload["static"]
    return StaticPrologue(call, HoistedValues(const_gm, positions, [], 0), frozen)


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
        from . import graph_cache
        from .dynamo import TorchfuseBackend
        state = pickle.loads(data)
        if state.get("format") != _FORMAT:
            raise RuntimeError("torchfuse: this saved program was written by another torchfuse version; save it again")
        config = Config.from_options(state["options"])
        backend = TorchfuseBackend(config)
        # the stored graphs name their compiler by the key they were saved with: a graph whose
        # generated code cannot be restored is compiled again with this Config
        graph_cache.register(state["key"], backend._compile, config)
        compiled = deserialize_bundled_cache_entry(state["entry"])
        return cls(compiled, config, state["key"])


def in_aot_compile() -> bool:
    """Whether the backend is running for `aot_compile` (which sets these while it calls it)."""
    cfg = torch._functorch.config
    return bool(getattr(cfg, "bypass_autograd_cache_key", False) or getattr(cfg, "force_autograd_cache", False))


def check_can_save(config: Config) -> None:
    """Raise, saying why, where a program compiled with `config` on this torch cannot be saved
    (before compiling: AOTAutograd itself fails obscurely on a result that cannot serialize)."""
    _serializable_callable()
    _deserialize_bundled_cache_entry()
    from .graph_cache import usable
    if not usable(config):
        raise RuntimeError("torchfuse: aot_compile saves a program through the graph cache, which is off "
                           "(options={'graph_cache': False}, or it failed earlier in this process)")


def wrap(compiled: Callable, config: Config) -> Callable:
    """`compiled` (AOTAutograd's result) as a SavedProgram, or a clear error why it cannot be."""
    from .graph_cache import config_key
    if getattr(compiled, "serialize", None) is None:
        raise RuntimeError(f"torchfuse: aot_compile cannot save this program: AOTAutograd on torch "
                           f"{torch.__version__} returned no serializable result")
    return SavedProgram(compiled, config, config_key(config))
