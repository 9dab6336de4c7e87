"""The graph-level cache: a restart skips AOTAutograd, through AOTAutograd's own cache.

AOTAutograd consults its on-disk cache (torch/_functorch/_aot_autograd/autograd_cache.py) when the
forward compiler is a `SerializableAOTDispatchCompiler` whose results are `OutputCode`s, and in
bundled mode stores those results pickled inside the entry, next to everything its runtime
wrappers need (input mutations, aliasing, the backward).  torchfuse's result, `TorchfuseCode`,
pickles as the code torchfuse generated (kernels and wrapper: `capture`, linked again by `restore`), the
compile's kind and static inputs, and, only where a hit may have to compile it, the aten graph it
was compiled from (torch's GraphPickler, fake tensors included): on a hit, `post_compile` links
the code again (the kernels come from the kernel cache), or runs torchfuse's own stages on the
stored graph; an entry with neither usable is a miss.  Dynamo's trace is all that precedes it.

The entry's key hashes the Dynamo graph, its inputs and torch's configs; torchfuse's source and
`Config` must be in it too, or a stale entry would load.  AOTAutograd hashes the UUID of Inductor's
custom-pass slots for exactly this purpose (a pass that runs after the lookup provides its own
identity), so the key carries ours through `post_grad_custom_post_pass`, patched only while
AOTAutograd runs for torchfuse (Inductor never runs there, so the slot is never called).

Anything this torch does not provide (2.11 through 2.13 differ in these internals) turns the graph
cache off with a debug log line: compiles then behave as without it.
"""
from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import hashlib
import importlib
import io
import logging
import operator
import pickle
from pathlib import Path
from typing import Any, Callable, Iterator
from unittest import mock

import torch
import torch.fx as fx

from ..config import Config
from ..counters import counters

log = logging.getLogger("torchfuse")

# (kind, gm, static input positions, training state) -> the boxed compiled callable
Compile = Callable[[str, fx.GraphModule, set, Any], Callable]


@functools.lru_cache(maxsize=1)
def source_hash() -> str:
    """A hash of torchfuse's own source: any change to the compiler invalidates every entry."""
    root = Path(__file__).resolve().parent.parent
    h = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        h.update(str(path.relative_to(root)).encode())
        h.update(path.read_bytes())
    return h.hexdigest()[:32]


def config_key(config: Config) -> str:
    fields = {f.name: getattr(config, f.name) for f in dataclasses.fields(config)
              if f.name not in ("debug", "debug_dir", "cache_dir", "progress", "first_calls")}   # not what is built
    return hashlib.sha256(f"{source_hash()}|{sorted(fields.items())!r}".encode()).hexdigest()[:32]


_CODE_FORMAT = 2


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
    main = call.main if isinstance(call, StaticPrologue) else call
    code = getattr(main, "_torchfuse_code", None)
    if code is None:
        return None
    static = (call.const_gm, list(call.positions), call.frozen) if isinstance(call, StaticPrologue) else None
    payload = {"format": _CODE_FORMAT, "torch": torch.__version__, "source": source_hash(),
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
    digest, data = blob[:32], blob[32:]
    if hashlib.sha256(data).digest() != digest:
        log.warning("torchfuse: stored generated code failed its checksum; compiling the graph again")
        return None
    try:
        payload = pickle.loads(data)
    except (ImportError, AttributeError) as e:   # stored by a torchfuse whose classes lived elsewhere
        log.info("torchfuse: stored generated code is from another torchfuse (%s); compiling the graph again", e)
        return None
    if payload.get("format") != _CODE_FORMAT or payload["source"] != source_hash() or payload["torch"] != torch.__version__:
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


def in_aot_compile() -> bool:
    """Whether the backend is running for `aot_compile` (which sets these while it calls it)."""
    cfg = torch._functorch.config
    return bool(getattr(cfg, "bypass_autograd_cache_key", False) or getattr(cfg, "force_autograd_cache", False))


# --- AOTAutograd's cache, keyed for torchfuse -----------------------------------------------

def _torch_parts() -> tuple[Any, Any, Any, Any] | None:
    try:
        from torch._functorch._aot_autograd.schemas import (
            SerializableAOTDispatchCompiler,
        )
        from torch._inductor.custom_graph_pass import CustomGraphPass
        from torch._inductor.output_code import OutputCode
        from torch.fx._graph_pickler import GraphPickler
    except ImportError as e:
        log.debug("torchfuse: graph cache off: %s", e)
        return None
    return SerializableAOTDispatchCompiler, CustomGraphPass, OutputCode, GraphPickler


try:
    from torch._inductor.output_code import OutputCode as _OutputCode
except ImportError:          # the graph cache is then off (_torch_parts)
    _OutputCode = object  # type: ignore[assignment,misc]


class TorchfuseCode(_OutputCode):  # type: ignore[misc,valid-type]
    """A torchfuse-compiled aten graph as AOTAutograd's cache stores it (a module-level class:
    pickle finds it by name)."""

    def __init__(self, call: Callable, graph: tuple[fx.Graph, dict] | None, kind: str, static: set,
                 training: Any, key: str, keep_graph: bool = False):
        super().__init__()
        self._boxed_call = True
        self._call: Callable | None = call
        # the aten graph as AOTAutograd gave it, pickled only when an entry needs it (below); in a
        # list shared with the copies AOTAutograd serializes, so that it is freed once stored
        self._pristine = [graph]
        self._graph = b""
        self._kind, self._static, self._training = kind, set(static), training
        self._key, self._keep_graph = key, keep_graph
        self._code: bytes | None = None     # the generated code (`capture`)
        # effect tokens the graph takes first and returns first (an op with effects: a
        # linalg.inv's error check); see _without_tokens
        self._tokens = _effect_tokens(graph[0]) if graph is not None else 0

    def __call__(self, inputs: list) -> Any:
        return self._call(inputs)

    def prepare_for_serialization(self) -> None:
        """Store the generated code; the graph only where a hit may have to compile it: no code
        could be stored, CUDA graphs (whose runner is built by compiling), or a saved program
        (loaded by another torchfuse, it compiles the graph).  Pickling the graph with its fake
        tensors took GPT-2 0.6-1.2 s of a cold compile, for entries that link their code."""
        from torch._functorch._aot_autograd.autograd_cache import BypassAOTAutogradCache
        if self._call is not None:
            self._code = capture(self._call)
        self._call = None      # (the live callable stays behind; its code, if any, travels)
        pristine, self._pristine = self._pristine, []
        if self._code is None or self._keep_graph:
            try:
                self._graph = pristine[0] if isinstance(pristine[0], bytes) else _pickled(pristine[0])
            except Exception as e:     # a graph the pickler cannot carry: compiled, never stored
                raise BypassAOTAutogradCache(f"torchfuse: the graph could not be pickled: {type(e).__name__}: {e}")
            pristine[0] = self._graph        # (a later save of the same graph reuses the bytes)
        else:
            pristine[0] = None

    def post_compile(self, example_inputs: Any, constants: Any, graph_kwargs: Any) -> None:
        if self._call is not None:
            return
        compile, config, reuse_code = _compilers.get(self._key, (None, None, False))
        if compile is None:
            raise RuntimeError("torchfuse: a cached graph was loaded before any torchfuse backend "
                               "with its Config ran in this process")
        code = getattr(self, "_code", None)
        if code is not None and reuse_code and not config.cudagraphs:
            # the stored code, linked against the kernel cache: none of torchfuse's stages run
            try:
                self._call = restore(code, config)
            except Exception as e:      # (e.g. the kernels no longer build): compile it again
                log.warning("torchfuse: stored code did not load (%s: %s); compiling the graph again",
                            type(e).__name__, e)
            if self._call is not None:
                self._call = _without_tokens(self._call, getattr(self, "_tokens", 0))
                counters.bump("graph_cache_hits")
                log.debug("torchfuse: graph cache hit: %s graph linked from its stored code (%s)", self._kind,
                          _entry_folder(config))
                return
        if not self._graph:
            # stored as code only: a miss (AOTAutograd compiles and stores the entry again)
            from torch._functorch._aot_autograd import autograd_cache
            miss = getattr(autograd_cache, "FXGraphCacheMiss", autograd_cache.BypassAOTAutogradCache)
            raise miss("torchfuse: the entry's code cannot be used here and it has no graph")
        from torch._guards import detect_fake_mode
        from torch.fx._graph_pickler import GraphPickler
        fake_mode = detect_fake_mode(example_inputs)
        if fake_mode is None:
            from torch._subclasses.fake_tensor import FakeTensorMode
            fake_mode = FakeTensorMode()
        gm = GraphPickler.loads(self._graph, fake_mode)     # (a GraphModule: its code is generated)
        self._call = _without_tokens(compile(self._kind, gm, self._static, self._training), getattr(self, "_tokens", 0))
        counters.bump("graph_cache_hits")
        log.debug("torchfuse: graph cache hit: %s graph compiled again from its stored aten graph (%s)", self._kind,
                  _entry_folder(config))

    def set_triton_bundle(self, triton_bundle: Any) -> None:
        pass


def _effect_tokens(graph: fx.Graph) -> int:
    """How many effect tokens a graph takes: the placeholders that `with_effects` calls thread
    (AOTAutograd passes them first and the graph returns them first)."""
    with_effects = getattr(torch.ops.higher_order, "with_effects", None)
    if with_effects is None:
        return 0
    return len({n.args[0] for n in graph.find_nodes(op="call_function", target=with_effects)
                if n.args and isinstance(n.args[0], fx.Node) and n.args[0].op == "placeholder"})


def _without_tokens(call: Callable, tokens: int) -> Callable:
    """A loaded graph's call as AOTAutograd calls it on a cache hit.  A fresh compile's result is
    wrapped by AOTAutograd's EffectTokensWrapper (None tokens in, tokens out dropped); the result
    its cache loads is not, so without this a graph with effect tokens (linalg.inv, cholesky)
    got one argument too few on every hit."""
    if not tokens:
        return call

    def call_with_tokens(args: list) -> Any:
        full = [None] * tokens + list(args)
        args.clear()
        outs = call(full)
        return None if outs is None else outs[tokens:]
    call_with_tokens._boxed_call = True  # type: ignore[attr-defined]
    for attr in ("_torchfuse_lib", "_torchfuse_code"):
        if hasattr(call, attr):
            setattr(call_with_tokens, attr, getattr(call, attr))
    return call_with_tokens


def _entry_folder(config: Config) -> str:
    try:
        from ..runtime.cache_dir import cache_folder
        return f"entry under {cache_folder(config, 'graphs')}"
    except Exception:      # (only for the log line)
        return "graph cache"


# config key -> the compile function of the latest backend with that Config, the Config, and
# whether stored code may stand in for compiling: a hit's post_compile (inside AOTAutograd, or
# later for a backward loaded lazily) uses them
_compilers: dict[str, tuple[Compile, Config, bool]] = {}


def register(key: str, compile: Compile, config: Config, reuse_code: bool = True) -> None:
    """Graphs stored under `key` link their stored code (`reuse_code`) or compile with `compile`
    from now on."""
    _compilers[key] = (compile, config, reuse_code)


def serializable(kind: str, compile: Compile, static: Callable[[], set], training: Any,
                 config: Config) -> Callable | None:
    """AOTAutograd's compiler for `kind` whose results the graph cache can store, or None when
    this torch lacks the parts (the caller then uses a plain compiler)."""
    parts = _torch_parts()
    if parts is None:
        return None
    SerializableAOTDispatchCompiler = parts[0]
    key = config_key(config)

    def compile_fn(gm: fx.GraphModule, example_inputs: list) -> Any:
        positions = static()
        pristine = _copy(gm)         # before torchfuse's passes rewrite it
        return TorchfuseCode(compile(kind, gm, positions, training), pristine, kind, positions, training, key,
                             keep_graph=config.cudagraphs or in_aot_compile())

    return SerializableAOTDispatchCompiler(TorchfuseCode, compile_fn)


def _copy(gm: fx.GraphModule) -> tuple[fx.Graph, dict] | None:
    """A copy of the graph's nodes (their metadata dicts copied, the values in them shared) and of
    the attributes it reads, which the passes rewriting `gm` leave as they are.  (No GraphModule
    yet: generating its Python code is for the rare entry that stores the graph.)"""
    try:
        graph = fx.Graph()
        value, output = graph.graph_copy(gm.graph, {}, return_output_node=True)
        graph.output(value).meta.update(output.meta)
        attrs = {n.target: operator.attrgetter(n.target)(gm) for n in gm.graph.find_nodes(op="get_attr")}
        return graph, attrs
    except Exception as e:     # then only stored code can serve a hit
        log.debug("torchfuse: graph cache: graph not copied: %s: %s", type(e).__name__, e)
        return None


def _pickled(copy: tuple[fx.Graph, dict] | None) -> bytes:
    from torch.fx._graph_pickler import GraphPickler
    if copy is None:
        raise ValueError("no copy of the graph")
    graph, attrs = copy
    return GraphPickler.dumps(fx.GraphModule(attrs, graph), **_pickle_options())


def _pickle_options() -> dict:
    """The pickler's default op filter (ops importable anywhere) plus prims, which torchfuse's
    decompositions leave in its graphs (prims.var, prims.convert_element_type), and torchfuse's
    own ops (frontend/upsample_training.py), registered wherever torchfuse is imported."""
    try:
        from torch.fx._graph_pickler import Options, _ops_filter_safe
    except ImportError:
        return {}
    return {"options": Options(ops_filter=lambda name: name.startswith(("torch.ops.prims.", "torch.ops.torchfuse."))
                               or _ops_filter_safe(name))}


_off_reason: str | None = None


_patches: dict[str, tuple] = {}


def _config_patches(key: str, CustomGraphPass: type) -> tuple:
    """torch's config patches that put AOTAutograd's bundled cache on, keyed by torchfuse's `key`,
    made once per key: each `config.patch()` of torch 2.12+ makes a ContextVar that is never
    freed (a few hundred bytes per compile in a long-running process).  Those patches nest, so
    one object serves every compile; an older torch's patch may not, and is made anew each time."""
    if key in _patches:
        return _patches[key]

    class TorchfuseKey(CustomGraphPass):  # type: ignore[misc,valid-type]
        def __call__(self, graph: fx.Graph) -> None:    # never run: Inductor does not compile here
            pass

        def uuid(self) -> str:
            return f"torchfuse-{key}"

    functorch = {"enable_autograd_cache": True, "bundled_autograd_cache": True}
    if hasattr(torch._functorch.config, "force_non_lazy_backward_lowering"):
        # the entry is written once the backward is compiled: now, while the patches hold,
        # not at the first backward call
        functorch["force_non_lazy_backward_lowering"] = True
    made = (torch._functorch.config.patch(**functorch),
            torch._inductor.config.patch(post_grad_custom_post_pass=TorchfuseKey()))
    if all(isinstance(getattr(p, "_prior", None), contextvars.ContextVar) for p in made):
        while len(_patches) >= 16:          # (bounded: one entry per Config in use)
            del _patches[next(iter(_patches))]
        _patches[key] = made
    return made


def _portable_entries() -> contextlib.AbstractContextManager:
    """While AOTAutograd runs for torchfuse, the entries it records for torch's portable cache
    (`torch.compiler.save_cache_artifacts`) are recorded as torchfuse's: loaded as AOTAutograd's
    they would be written into Inductor's directory (runtime/cache_artifacts.py)."""
    try:
        from torch.compiler._cache import CacheArtifactManager
    except ImportError:
        return contextlib.nullcontext()
    from ..runtime import cache_artifacts
    record_artifact = CacheArtifactManager.record_artifact

    def redirect(artifact_type: str, key: str, content: Any) -> None:
        if artifact_type == "aot_autograd" and isinstance(content, bytes):
            cache_artifacts.record_aot_entry(key, content)
        else:
            record_artifact(artifact_type, key, content)
    return mock.patch.object(CacheArtifactManager, "record_artifact", staticmethod(redirect))


def _mesh_identity(mesh: Any) -> tuple | None:
    """What a DeviceMesh contributes to the code traced through it: its device, dim names, ranks,
    this rank's coordinate and each dim's process group name (DTensor's collectives are traced
    with the group's name, read from the mesh, not from the Dynamo graph the key hashes)."""
    try:
        from torch.distributed.device_mesh import DeviceMesh
        if not isinstance(mesh, DeviceMesh):
            return None
        groups = tuple(mesh.get_group(dim).group_name for dim in range(mesh.ndim))
        return ("DeviceMesh", mesh.device_type, mesh.mesh_dim_names, mesh.mesh.tolist(),
                mesh.get_coordinate(), groups)
    except Exception:   # another torch's mesh, a rank outside it: keyed as torch keys it (a miss)
        return None


def _stable_opaque_keys() -> contextlib.AbstractContextManager:
    """While AOTAutograd runs for torchfuse, a DeviceMesh among a graph's inputs (DTensor graphs
    under torch 2.13 take it as an opaque object) enters the cache key as what it contributes to
    the traced code (_mesh_identity).  torch's own reduction pickles the object, whose bytes differ
    from one process to the next: every restart missed (a tensor-parallel block's graphs, gloo, 4
    processes: new entries per graph every run, never a hit).  Other opaque objects keep torch's
    reduction."""
    try:
        from torch._inductor.codecache import FxGraphCachePickler, _ident
        reduce_fake_script_object = FxGraphCachePickler._reduce_fake_script_object
    except (ImportError, AttributeError):
        return contextlib.nullcontext()

    def reduce(self: Any, t: Any) -> Any:
        identity = _mesh_identity(getattr(t, "real_obj", None))
        if identity is None:
            return reduce_fake_script_object(self, t)
        return (_ident, (t.script_class_name, identity))
    return mock.patch.object(FxGraphCachePickler, "_reduce_fake_script_object", reduce)


def turn_off(reason: str) -> None:
    """No graph cache for the rest of this process (a compile failed with it, not without)."""
    global _off_reason
    if _off_reason is None:
        log.warning("torchfuse: the graph cache is off for this process: compiling with it failed (%s)",
                    reason.splitlines()[0][:300] if reason else "")
    _off_reason = reason


def usable(config: Config) -> bool:
    return config.graph_cache and _off_reason is None and _torch_parts() is not None


@contextlib.contextmanager
def enabled(config: Config, compile: Compile, wanted: bool = True, reuse_code: bool = True) -> Iterator[bool]:
    """Within the block, AOTAutograd's bundled cache is on and keyed by torchfuse's source and
    `config` too; yields whether it is (False: not `wanted`, off, or this torch cannot).
    `reuse_code=False` compiles hits again instead of linking their stored code (`explain`
    reports what the stages do)."""
    parts = _torch_parts()
    if not (wanted and usable(config)) or parts is None:
        yield False
        return
    _, CustomGraphPass, _, _ = parts
    key = config_key(config)
    register(key, compile, config, reuse_code)
    patches = contextlib.ExitStack()
    try:
        for patch in _config_patches(key, CustomGraphPass):
            patches.enter_context(patch)
        # entries go under torchfuse's cache directory, next to its kernels (one place to trust,
        # bound and clear), not Inductor's
        from torch._functorch._aot_autograd.autograd_cache import AOTAutogradCache

        from ..runtime.cache_dir import cache_folder
        folder = str(cache_folder(config, "graphs"))
        patches.enter_context(mock.patch.object(AOTAutogradCache, "_get_tmp_dir", classmethod(lambda cls: folder)))
        patches.enter_context(_portable_entries())
        patches.enter_context(_stable_opaque_keys())
    except (AttributeError, ImportError, RuntimeError, TypeError) as e:
        patches.close()          # undo the patches that did apply
        log.debug("torchfuse: graph cache off: %s", e)
        yield False
        return
    with patches:
        yield True
