"""One aten graph through torchfuse: what Dynamo's backend (dynamo.py) runs for each graph
AOTAutograd hands it, and what a loaded saved program (saved_program.py, the layer below Dynamo's)
runs for a graph whose stored code it cannot link.
"""
from __future__ import annotations

import logging
from typing import Callable

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
    # here, not when Dynamo calls the backend: a graph-cache hit compiles nothing, and sixteen
    # workers starting beside a warm start's Dynamo trace slowed it (resnet50: 2.7 vs 1.8 s)
    _start_compile_workers([n.meta.get("val") for n in placeholders], config)
    n_inputs = len(placeholders)
    call = compile_graph(gm, config, inference=kind == "inference", kind=kind, report=report,
                         static_inputs=static if kind == "inference" else None)
    if not config.cudagraphs:
        return call
    # gm is now the graph as lowered: values hoisted out of it are trailing inputs,
    # computed from parameters, so static too
    hoisted = range(n_inputs, len(list(gm.graph.find_nodes(op="placeholder"))))
    plan = cudagraphs.plan_capture(gm, kind, sorted(static | set(hoisted)))
    article = "an" if kind[:1] in "aeiou" else "a"       # (an inference graph, a forward graph)
    return cudagraphs.wrap(call, plan, training, config.cudagraph_max_sizes, f"{article} {kind} graph")


def _start_compile_workers(example_inputs: list, config: Config) -> None:
    """Let the backends of the inputs' devices start what they need early (Triton on a GPU: its
    compile workers), while torchfuse lowers the graph."""
    for device_type in dict.fromkeys(x.device.type for x in example_inputs if isinstance(x, torch.Tensor)):
        try:
            backends.for_device(device_type, config).warm_up(config)
        except Exception as e:    # only a head start: without workers, the kernels compile in this process
            log.debug("torchfuse: compile workers not started: %s: %s", type(e).__name__, e)
