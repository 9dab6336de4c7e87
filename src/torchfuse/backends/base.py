"""The interface every code generator implements, and what passes through it.

The pipeline (pipeline.py) turns a graph into fused kernels (scheduler.loops.LoopPlan) and then
asks the graph's backend, chosen by `backends.for_device`, for each kernel's code, for the build
of them all and for an optional head start on their compile.  The lowering and the scheduler ask
the backend what it supports (`Features`) and how to split reductions (`split_params`), never
which backend it is.  A new backend is a folder with a `Backend` subclass and one line in
`backends/__init__.py`.
"""
from __future__ import annotations

import dataclasses
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any, Callable, ClassVar, Mapping

from ..ir.nodes import Node, const

if TYPE_CHECKING:
    import torch

    from ..config import Config
    from ..ir.buffers import LoweredGraph
    from ..scheduler.fusion import Schedule
    from ..scheduler.loops import LoopPlan
    from ..scheduler.split import SplitParams


@dataclasses.dataclass(frozen=True)
class Features:
    """What a backend's kernels can do; the stages before code generation read these."""
    split_reductions: bool = True
    """Reductions of few long rows may run as partials plus a second kernel (scheduler/split.py)."""
    pooling: bool = True
    """Window reductions (max/avg pooling and their backward) are lowered into kernels rather
    than left to ATen (lowering/pool.py, and the low-memory max-pool decomposition)."""
    split_loops: bool = False
    """Loop planning splits the vectorized dim where that makes its accesses affine (loops.plan_loops)."""
    reductions_in_place: bool = False
    """A reduction's output may be written over a dying input by the wrapper (codegen/wrapper.py)."""
    scatter_dtypes: Mapping[str, frozenset] = dataclasses.field(default_factory=dict)
    """The dtypes each accumulating scatter mode ("sum", "prod", "amax", "amin") can update in
    its kernels; the others run through ATen (lowering/scatter.py).  Plain stores take any dtype."""
    scatter_wide_sums: bool = False
    """A scatter-sum of fp16/bf16 values accumulates into an fp32 buffer that is rounded once
    (lowering/scatter.py), where the kernels could otherwise round every add to 16 bits."""
    half_atomic_add: frozenset = frozenset()
    """The 16-bit dtypes (fp16, bf16) its scatter-sums can add atomically in the value's own
    dtype, straight into the output.  Used, instead of the wide sum, only by the ops whose eager
    kernel on this device rounds every add to 16 bits too (CUDA's atomic scatter_add, index_add,
    scatter_reduce sum): no fp32 buffer, no conversion pass, half the atomic traffic.  Sums that
    eager accumulates in fp32 (embedding backward, accumulating index_put) stay wide."""
    deterministic_scatters: bool = False
    """Its float scatter-sums and products add in an order fixed by the sizes and the thread
    count alone (no atomics), when the buffer asks (`ComputedBuffer.deterministic`): they are
    then lowered under `torch.use_deterministic_algorithms(True)` instead of running in ATen."""
    embedding_bag_kernels: bool = True
    """embedding_bag (sum, mean) and its backward decompose into gathers and scatters
    (frontend/index_decompositions.py) rather than running ATen's kernels."""
    scatter_in_reductions: bool = False
    """A reduction kernel may run a scatter over its rows x reduced loops as a per-element
    member (scheduler/fusion._scatter_in_reduction), stored with the same atomics as a scatter
    kernel's."""
    max_fused_cat_parts: int = 32
    """A concatenation of more parts runs through ATen's cat (lowering/views.py).  A fused cat
    tests every part's range and issues every part's (masked) load for each element: about six
    instructions a part, against the ~100-200 a memory-bound element can hide on a GPU."""


@dataclasses.dataclass
class KernelCode:
    """One kernel's source and how the wrapper calls it."""
    source: str
    buffers: list[str]
    """The buffer arguments, in order."""
    symbols: list[str]
    """The size-symbol arguments, after the buffers."""
    site: tuple | None = None
    """A launch site the wrapper calls as `<name>_site(...)` instead of `<name>(...)` (Triton:
    (helper, variants, n_sizes, n_buffers, n_symbols, kwargs)); None: called directly."""
    site_call: str | None = None
    """The wrapper's call of the site (with `site`)."""
    launch_call: str | None = None
    """The same launch through the backend's launch helper, as `precompile` plans it."""
    register_only: set[str] = dataclasses.field(default_factory=set)
    """Buffers this kernel keeps in registers: no memory is allocated for them."""
    checks: list = dataclasses.field(default_factory=list)
    """Its run-time check sites (codegen/checks.py), (kind, what) each: a C++ kernel with any
    returns non-zero when one failed."""
    error_slots: tuple | None = None
    """Where a Triton kernel's failed checks are stored: (the wrapper's global, sites, size
    expressions, device); the wrapper reads them after the graph."""


@dataclasses.dataclass
class GeneratedCode:
    """What code generation made of one graph, all a restart needs to link it again without
    running any stage (frontend/graph_cache.py stores it): the wrapper, its constants, the
    kernel sources and argument lists, kernels identical to an earlier one, and the kernels'
    launch sites."""
    backend: str
    wrapper: str
    globals: dict
    sources: list[str]
    kernel_args: dict[str, tuple[list[str], list[str]]]
    aliases: dict[str, str]
    sites: dict[str, tuple]
    checks: dict[str, list] = dataclasses.field(default_factory=dict)
    """The kernels that return a check's failure (C++), with their check sites."""


@dataclasses.dataclass
class GraphCode:
    """What a backend's `kernel` may read about the graph being compiled."""
    program: LoweredGraph
    dtypes: dict[str, torch.dtype]
    config: Config
    scratch: dict[str, Any] = dataclasses.field(default_factory=dict)
    """Per-graph values a backend computes once (the C++ backend's int32-addressable buffers)."""


class Backend:
    """A code generator and its build.  Instances are per device type (`device_type`), made by
    `backends.for_device` or `backends.by_name`."""
    name: ClassVar[str]
    title: ClassVar[str]
    """The name in messages ("C++")."""
    features: ClassVar[Features] = Features()
    variant_suffixes: ClassVar[tuple[str, ...]] = ("",)
    """The functions built per kernel, by suffix of its name (Triton: _persistent, _looped, ...)."""

    def __init__(self, device_type: str = "cpu") -> None:
        self.device_type = device_type

    def split_params(self, num_threads: int, min_chunk: int = 0) -> SplitParams:
        """How to split reductions on this device (scheduler/split.py); `min_chunk`
        (Config.split_min_chunk) overrides the chunk size."""
        raise NotImplementedError

    def kernel(self, plan: LoopPlan, graph: GraphCode) -> KernelCode:
        """The source of one fused kernel.  Raise NotImplementedError for what the backend cannot
        generate (the graph then runs eagerly)."""
        raise NotImplementedError

    def build(self, code: GeneratedCode, config: Config, debug: Callable[[str, str], None]) -> dict[str, Any]:
        """Compile (or load from the kernel cache) the graph's kernels: name -> callable, for
        every kernel, variant and launch site the wrapper calls.  `debug(file, text)` writes to
        the debug folder."""
        raise NotImplementedError

    def start_build(self, code: GeneratedCode, config: Config,
                    debug: Callable[[str, str], None]) -> Future | None:
        """Start `build` in the background where it is slow and runs outside the interpreter (a
        compiler process), so the graph's first calls need not wait for it (Config.first_calls):
        a Future of what `build` returns.  None: nothing worth it (the kernels are cached), and
        the pipeline calls `build` itself."""
        return None

    def link(self, code: GeneratedCode, kernels: dict[str, Any]) -> None:
        """Add to the built `kernels` what the wrapper calls besides them (Triton: each kernel's
        launch site), once kernels identical to an earlier one are bound to its build."""

    def precompile(self, scope: dict[str, Any], launches: list[tuple[str, list]], schedule: Schedule,
                   program: LoweredGraph, config: Config) -> Future | None:
        """Start compiling the built kernels ahead of their first call (`launches`: each kernel's
        `launch_call` and its symbol bindings); calls run through ATen (Config.first_calls
        "eager") or the first call waits ("wait") until the returned future is done."""
        return None

    def warm_up(self, config: Config) -> None:
        """Called when a graph for this backend starts compiling (Triton: start compile workers)."""

    @property
    def environment(self) -> dict[str, str]:
        """Environment variables that must be set before the backend's compiler is imported."""
        return {}


def product(sizes: Any) -> Node:
    """The product of index nodes (1 for none)."""
    out = const(1)
    for s in sizes:
        out = out * s
    return out


def span(meta: tuple) -> Node:
    """The largest element offset of a buffer's layout (`LoweredGraph.buffer_meta` entry):
    sum((size-1)*stride)."""
    sizes, strides = meta[0], meta[1]
    out = const(0)
    for sz, st in zip(sizes, strides):
        out = out + (sz - 1) * st
    return out
