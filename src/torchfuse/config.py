"""One typed configuration object for the whole compiler.

Every knob lives here.  A `Config` is immutable; `Config.from_options` builds one from the
`options=` dict users pass to `torch.compile` / `torchfuse.compile` and from the few
environment variables we honour (TORCHFUSE_DEBUG, TORCHFUSE_CACHE_DIR, TORCHFUSE_STRICT).
"""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping


def _default_cache_dir() -> Path:
    env = os.environ.get("TORCHFUSE_CACHE_DIR")
    if env:
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "torchfuse"


@dataclass(frozen=True)
class Config:
    # --- behaviour on failure -------------------------------------------------------------
    strict: bool = False
    """Raise instead of warning and falling back to eager when a kernel fails to build."""

    # --- debugging --------------------------------------------------------------------------
    debug: bool = False
    """Write every stage of every compiled graph to `debug_dir`."""
    debug_dir: Path = Path("torchfuse_debug")

    # --- kernel cache / C++ toolchain -------------------------------------------------------
    cache_dir: Path = field(default_factory=_default_cache_dir)
    cxx: str = "g++"
    cxx_flags: tuple[str, ...] = ("-O3", "-march=native", "-fopenmp", "-std=c++17",
                                  "-fPIC", "-shared", "-fno-math-errno", "-fno-trapping-math")
    graph_cache: bool = True
    """Store each compiled graph in AOTAutograd's on-disk cache (bundled mode), keyed by the graph,
    torch's configs, torchfuse's source and this Config: a restart loads it instead of tracing
    again (frontend/graph_cache.py).  torch.compiler.config.force_disable_caches turns it off too."""
    memory_cache_size: int = 256
    """How many loaded kernel libraries stay in the in-process LRU cache."""

    # --- graph passes ------------------------------------------------------------------------
    passes: tuple[str, ...] = ("dce", "cse", "constant_fold", "simplify", "conv_bn_fold", "pad_mm", "unfuse_addmm",
                               "unfuse_conv_bias", "dce")
    """Names of the aten graph passes to run, in order (see torchfuse.passes.REGISTRY)."""
    conv_bn_fold_devices: tuple[str, ...] = ("cpu", "cuda")
    """Devices on which conv_bn_fold runs (inference graphs).  The folded weights are computed
    from parameters alone, so they are hoisted out of the per-call path (see `freezing`)."""
    freezing: bool = False
    """Inference graphs: values computed from parameters and buffers alone (folded conv-bn
    weights, weight casts, position biases) are always computed once and kept; by default they
    are recomputed when a parameter changes (its version counter or storage, checked per call).
    With freezing=True parameters are constants: computed once and never checked again (a
    parameter changed after the first call is not seen; recompile to pick it up).  On with
    mode="max-autotune"."""
    cublas_devices: tuple[str, ...] = ("cuda",)
    """Devices whose matrix products run in cuBLAS: pad_mm pads their unaligned sizes (the fast
    kernels need 16-byte-aligned leading dimensions) and unfuse_addmm / unfuse_conv_bias move
    the bias adds of matrix products and (cuDNN) convolutions into the consumer kernels.  CPU
    BLAS and oneDNN need neither."""

    # --- autograd -------------------------------------------------------------------------------
    partitioner: str = "min_cut"
    """How AOTAutograd splits a training graph into forward and backward.  'min_cut' saves the
    fewest bytes for the backward and recomputes cheap pointwise values there (GELU's
    intermediates, log-softmax from the logits), where they fuse into the backward's kernels;
    'default' saves every forward value the backward reads."""

    # --- fusion ---------------------------------------------------------------------------------
    fuse: bool = True
    """When False every lowered op becomes its own kernel (useful to bisect fusion bugs)."""
    inline_max_cost: int = 12
    """A pointwise value with several consumers is recomputed in each of them (instead of being
    written to memory) only if its expression costs at most this much (see ir.nodes.cost)."""
    max_fusion_size: int = 64
    """Upper bound on buffers in one kernel, to keep compile time and register pressure sane."""

    split_reductions: bool = True
    """Reduce few long rows (x.sum(), [8, 8M].sum(1), column sums of [8M, 8]) in two kernels:
    partials over chunks of each row, then the partials, so the first kernel fills every SM or
    thread (see scheduler/split.py)."""
    split_min_chunk: int = 0
    """Fewest reduced elements per partial of a split reduction; 0 picks the device's default
    (tests set it small to split small tensors)."""

    compile_workers: int = 0
    """Worker processes that compile a graph's Triton kernels in parallel before its first call
    (0: one per CPU core, at most 16; 1: compile each kernel on its first launch, as Triton
    does).  See runtime/compile_workers.py."""

    # --- backends ---------------------------------------------------------------------------
    cpu_backend: str = "cpp"
    """'cpp' (C++/OpenMP), 'triton' (Triton, under TRITON_INTERPRET=1 on CPU) or 'interpreter'."""
    num_threads: int = 0
    """OpenMP threads for CPU kernels; 0 means torch.get_num_threads()."""
    parallel_threshold: int = 32768
    """Loops with fewer elements than this run on one thread (OpenMP start-up costs microseconds)."""

    cudagraphs: bool = False
    """Replay each compiled CUDA graph through a captured CUDA graph (mode="reduce-overhead"),
    by PyTorch's CUDA graph trees (see runtime/cudagraphs.py)."""
    cudagraph_max_sizes: int = 8
    """Captures per graph for distinct dynamic sizes; past it new sizes run without CUDA graphs
    (logged once).  0: no bound."""
    autotune: bool = False
    """Benchmark a few block-size configurations per Triton kernel and remember the winner on disk
    (mode="max-autotune")."""

    # --- ops ------------------------------------------------------------------------------------
    fallback_ops: tuple[str, ...] = ()
    """Extra aten op names (e.g. 'aten.gelu.default') to always run through ATen."""

    @staticmethod
    def from_options(options: Mapping[str, Any] | None = None, mode: str | None = None) -> "Config":
        env: dict[str, Any] = {}
        if os.environ.get("TORCHFUSE_DEBUG", "") not in ("", "0"):
            env["debug"] = True
            if os.environ["TORCHFUSE_DEBUG"] not in ("1", "true", "True"):
                env["debug_dir"] = Path(os.environ["TORCHFUSE_DEBUG"])
        if os.environ.get("TORCHFUSE_STRICT", "") not in ("", "0"):
            env["strict"] = True
        modes = {None: {}, "default": {}, "reduce-overhead": {"cudagraphs": True},
                 "max-autotune": {"autotune": True, "cudagraphs": True, "freezing": True},
                 "max-autotune-no-cudagraphs": {"autotune": True}}
        if mode not in modes:
            raise ValueError(f"torchfuse: unknown mode {mode!r}; valid modes are {sorted(m for m in modes if m)}")
        merged = {**env, **modes[mode], **dict(options or {})}
        known = {f.name: f for f in dataclasses.fields(Config)}
        unknown = sorted(set(merged) - set(known))
        if unknown:
            raise ValueError(f"torchfuse: unknown option(s) {unknown}; valid options are {sorted(known)}")
        if merged.get("partitioner", "min_cut") not in ("min_cut", "default"):
            raise ValueError(f"torchfuse: unknown partitioner {merged['partitioner']!r}; "
                             "valid partitioners are ['default', 'min_cut']")
        for key in ("cache_dir", "debug_dir"):
            if key in merged:
                merged[key] = Path(merged[key])
        for key in ("cxx_flags", "passes", "fallback_ops", "conv_bn_fold_devices", "cublas_devices"):
            if key in merged:
                merged[key] = tuple(merged[key])
        return Config(**merged)

    def replace(self, **changes: Any) -> "Config":
        return dataclasses.replace(self, **changes)
