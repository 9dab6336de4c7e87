"""Process-wide counters: how many graphs, kernels, builds, cache hits and fallbacks we saw."""
from __future__ import annotations

import collections
import contextlib
import threading
import time
from typing import Callable, Iterator


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
      buffers_reused_in_place  kernel outputs written into a buffer that died at that kernel
      collectives       functional collectives (torch.distributed's `_c10d_functional` ops: tensor
                        parallelism, FSDP2) in compiled graphs, scheduled by scheduler/overlap.py
      kernels_precompiled Triton kernels compiled in parallel before a graph's first call
      kernels_compiled_in_workers  of those, the ones a worker process compiled
      kernels_compiled_while_waiting  of those, the ones the first call compiled in its own
                        thread while it waited (no worker would have taken them sooner)
      calls_tiered      graph calls run through ATen because the graph's kernels were still
                        compiling in the background (Config.first_calls="eager", runtime/tiered.py)
      tiered_switches   graphs that went on to their compiled kernels after such calls
      channels_last_training  Dynamo graphs of a training step re-laid channels-last before
                        AOTAutograd (frontend/channels_last_training.py)
      constant_masks_dropped  SDPA attention masks computed from constants that mask nothing,
                        dropped before AOTAutograd (frontend/constant_masks.py)
      causal_masks_replaced  SDPA causal masks computed from constants, replaced by
                        is_causal=True before AOTAutograd (frontend/constant_masks.py)
      upsample_aten_backward  upsamples (nearest, linear modes) of training graphs differentiated by
                        ATen's upsample backward (frontend/upsample_training.py)
      graph_cache_hits  graphs loaded from the graph cache or a saved program (AOTAutograd skipped)
      compiled_graph_loads  of those, graphs whose stored generated code was linked as it was
                        (torchfuse's passes, lowering, scheduling and codegen skipped too)

    `seconds` adds up the wall time of each compile stage (passes, lowering, schedule, codegen,
    build, precompile), so compile time can be split between torchfuse and what comes before it;
    "build: background" is a build that ran while the graph's first calls did not wait for it,
    and "first calls: ATen" the time those calls took (runtime/tiered.py).
    """

    def __init__(self) -> None:
        super().__init__()
        self.seconds: collections.Counter = collections.Counter()
        # told the name of each stage as it starts, while a compile shows progress (progress.py)
        self.on_stage: Callable[[str], None] | None = None

    _lock = threading.Lock()

    def bump(self, key: str, amount: int = 1) -> None:
        with self._lock:
            self[key] += amount

    def add_seconds(self, stage: str, seconds: float) -> None:
        with self._lock:
            self.seconds[stage] += seconds

    @contextlib.contextmanager
    def timed(self, stage: str) -> Iterator[None]:
        if self.on_stage is not None:
            self.on_stage(stage)
        start = time.perf_counter()
        try:
            yield
        finally:
            self.add_seconds(stage, time.perf_counter() - start)

    @property
    def cache_hits(self) -> int:
        return self["cache_hits_disk"] + self["cache_hits_memory"]


counters = Counters()
