"""The C++/OpenMP backend: one translation unit per graph (codegen.py), built by g++ into a
shared library and cached (build.py)."""
from __future__ import annotations

import ctypes
import os
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable

import torch

from ...config import Config
from ...scheduler.loops import LoopPlan
from ...scheduler.split import SplitParams
from ..base import Backend, Features, GeneratedCode, GraphCode, KernelCode, span
from . import codegen, scatter


class CppBackend(Backend):
    name = "cpp"
    title = "C++"
    features = Features(
        # g++ does not vectorize a pooling window's masked loads: 6-40x slower than ATen's oneDNN
        # pooling on channels-last tensors, and a fused producer is recomputed per window element
        pooling=False,
        split_loops=True,
        # the vector loop has no memory latency to hide a fused cat's per-part tests and loads
        # behind: an LSTM's or GRU's stack of hidden states and DenseNet's feature cats ran faster
        # through ATen's cat, which copies the stored parts in one pass, above 4 parts
        max_fused_cat_parts=4,
        scatter_dtypes=scatter.SCATTER_DTYPES,
        # 16-bit sums go through fp32 (an fp32 atomic or a private copy is also faster than a
        # 16-bit compare-and-swap), and a deterministic scatter runs serially or through the
        # per-thread copies, combined in thread order (scatter.py)
        scatter_wide_sums=True,
        deterministic_scatters=True,
        # ATen's CPU embedding_bag (fbgemm) beats its decomposition (searchsorted for the bags,
        # a gather-scatter, a count for means): 4096 bags of 20 rows of 64, 1 thread, mean
        # inference 4.1 vs 2.5 ms, a sum with per-sample weights trained 51 vs 35 ms
        embedding_bag_kernels=False,
    )

    def split_params(self, num_threads: int, min_chunk: int = 0) -> SplitParams:
        # codegen.COLUMN_TILE: a batch norm's 64 channels are one tile, one thread unless the rows split
        return SplitParams.on_cpu(num_threads, min_chunk, column_tile=codegen.COLUMN_TILE)

    def kernel(self, plan: LoopPlan, graph: GraphCode) -> KernelCode:
        if "int32" not in graph.scratch:
            graph.scratch["int32"] = _int32_addressable(graph.program)
        checks: list = []
        src, bufs, syms = codegen.kernel_source(plan, graph.dtypes, graph.config.parallel_threshold,
                                                graph.scratch["int32"], checks, graph.config.runtime_checks)
        return KernelCode(src, bufs, syms, checks=checks)

    def build(self, code: GeneratedCode, config: Config, debug: Callable[[str, str], None]) -> dict[str, Any]:
        return self._build(code, config, debug, config.num_threads or torch.get_num_threads())

    def start_build(self, code: GeneratedCode, config: Config,
                    debug: Callable[[str, str], None]) -> Future | None:
        """g++ in a background thread (it waits on the compiler's process, holding no lock a
        call needs), unless the library is loaded or on disk already: loading it takes
        milliseconds."""
        from .build import is_built
        if not code.sources or is_built(codegen.translation_unit(code.sources), config):
            return None
        # (read here: OpenMP's thread count is per thread, and the caller's is the one that counts)
        threads = config.num_threads or torch.get_num_threads()
        return _builds.submit(self._build, code, config, debug, threads)

    def _build(self, code: GeneratedCode, config: Config, debug: Callable[[str, str], None],
               threads: int) -> dict[str, Any]:
        from .build import load_library
        kernels: dict[str, Any] = {}
        if not code.sources:
            return kernels
        unit = codegen.translation_unit(code.sources)
        debug("kernels.cpp", unit)
        lib = load_library(unit, config)
        lib.tf_set_num_threads(threads)
        checks = getattr(code, "checks", {})
        for name, (bufs, syms) in code.kernel_args.items():
            fn = kernels[name] = getattr(lib, name)
            fn.argtypes = [ctypes.c_void_p] * len(bufs) + [ctypes.c_int64] * len(syms)
            fn.restype = ctypes.c_int64 if name in checks else None    # (non-zero: a run-time check failed)
        if checks:
            last_error = kernels["_tf_last_error"] = lib.tf_last_error
            last_error.argtypes, last_error.restype = [ctypes.c_void_p], None
        return kernels


# Graphs whose libraries build while their first calls run (Config.first_calls): a forward and
# its backward build side by side, as would the graphs of a model with graph breaks.
_builds = ThreadPoolExecutor(max(1, min(4, os.cpu_count() or 1)), thread_name_prefix="torchfuse-g++")


def _int32_addressable(program: Any) -> frozenset[str]:
    """Buffers of static layout whose every element offset fits an int32 (C++ gathers from them
    index with int32: see codegen.py's Emitter)."""
    out = set()
    for name, meta in program.buffer_meta.items():
        s = span(meta)
        if s.op == "const" and s.arg < 2 ** 31 - 2 ** 20:
            out.add(name)
    return frozenset(out)
