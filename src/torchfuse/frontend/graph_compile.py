"""One aten graph through torchfuse: what Dynamo's backend (dynamo.py) runs for each graph
AOTAutograd hands it, and what a loaded saved program (saved_program.py, the layer below Dynamo's)
runs for a graph whose stored code it cannot link.
"""
from __future__ import annotations

import contextlib
import logging
import threading
from typing import Callable, Iterator

import torch
import torch.fx as fx

from .. import backends
from ..config import Config
from ..report import Explanation
from ..runtime import cudagraphs

log = logging.getLogger("torchfuse")


def compile_aten_graph(config: Config, report: Explanation | None, kind: str, gm: fx.GraphModule,
                       static: set[int], training: "cudagraphs.TrainingState") -> Callable:
    """One aten graph through torchfuse (and CUDA graphs under reduce-overhead)."""
    from ..pipeline import compile_graph
    placeholders = list(gm.graph.find_nodes(op="placeholder"))
    # (usually started already by `workers_start_early`; not right when Dynamo calls the
    # backend: a graph-cache hit compiles nothing, and sixteen workers starting beside a warm
    # start's Dynamo trace slowed it, resnet50: 2.7 vs 1.8 s)
    _start_compile_workers([n.meta.get("val") for n in placeholders], config)
    n_inputs = len(placeholders)
    # (CUDA graphs must capture the compiled graph: their first calls wait for it)
    call = compile_graph(gm, config, inference=kind == "inference", kind=kind, report=report,
                         static_inputs=static if kind == "inference" else None,
                         tiered=config.first_calls == "eager" and not config.cudagraphs)
    if not config.cudagraphs:
        return call
    # gm is now the graph as lowered: values hoisted out of it are trailing inputs,
    # computed from parameters, so static too
    hoisted = range(n_inputs, len(list(gm.graph.find_nodes(op="placeholder"))))
    plan = cudagraphs.plan_capture(gm, kind, sorted(static | set(hoisted)))
    article = "an" if kind[:1] in "aeiou" else "a"       # (an inference graph, a forward graph)
    return cudagraphs.wrap(call, plan, training, config.cudagraph_max_sizes, f"{article} {kind} graph")


# A graph cache hit (a restart) spends about this long in the backend, or less, and needs no
# compile workers; a miss spends seconds in AOTAutograd before torchfuse's stages, time the
# workers can use to start (a GPT-2 on an H200: 5 s of AOTAutograd, workers ready in ~1 s).
EARLY_START_DELAY = 0.2


@contextlib.contextmanager
def workers_start_early(example_inputs: list, config: Config) -> Iterator[None]:
    """Start the inputs' backends' compile workers (`_start_compile_workers`) if the compile
    inside this block is still running after EARLY_START_DELAY seconds: before AOTAutograd
    has traced the graph, instead of after."""
    if not _starts_workers(example_inputs, config):
        yield
        return
    timer = threading.Timer(EARLY_START_DELAY, _start_compile_workers, (list(example_inputs), config))
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        timer.cancel()


def _starts_workers(example_inputs: list, config: Config) -> bool:
    """Whether a backend of the inputs' devices has something to start (C++ compiles in this
    process: none)."""
    from ..backends.base import Backend
    for device_type in dict.fromkeys(x.device.type for x in example_inputs if isinstance(x, torch.Tensor)):
        try:
            if type(backends.for_device(device_type, config)).warm_up is not Backend.warm_up:
                return True
        except Exception:        # a device no backend takes: its graph fails (or falls back) later
            continue
    return False


def _start_compile_workers(example_inputs: list, config: Config) -> None:
    """Let the backends of the inputs' devices start what they need early (Triton on a GPU: its
    compile workers), while torchfuse lowers the graph."""
    for device_type in dict.fromkeys(x.device.type for x in example_inputs if isinstance(x, torch.Tensor)):
        try:
            backends.for_device(device_type, config).warm_up(config)
        except Exception as e:    # only a head start: without workers, the kernels compile in this process
            log.debug("torchfuse: compile workers not started: %s: %s", type(e).__name__, e)
