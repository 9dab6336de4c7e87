"""Process-wide counters: how many graphs, kernels, builds, cache hits and fallbacks we saw."""
from __future__ import annotations

import collections
import threading


class Counters(collections.Counter):
    """A `collections.Counter` with a lock for increments from several threads.

    Keys used by torchfuse:
      graphs_compiled   aten graphs that went through the pipeline
      kernels_generated fused kernels emitted (any backend)
      kernel_builds     real C++ compiler runs (not cache hits)
      cache_hits_disk   kernel libraries loaded from the on-disk cache
      cache_hits_memory kernel libraries found already loaded in this process
      fallback_ops      aten ops executed through ATen inside compiled graphs
      eager_fallbacks   whole graphs run eagerly because a kernel failed to build
      kernels_precompiled Triton kernels compiled in parallel before a graph's first call
    """

    _lock = threading.Lock()

    def bump(self, key: str, amount: int = 1) -> None:
        with self._lock:
            self[key] += amount

    @property
    def cache_hits(self) -> int:
        return self["cache_hits_disk"] + self["cache_hits_memory"]


counters = Counters()
