"""The core pipeline for one aten graph: passes -> lowering -> fusion -> codegen -> build -> wrapper.

Both front doors (Dynamo/AOTAutograd and, later, lazy eager fusion) call `compile_graph`.
Every stage can be written to the debug folder as text.
"""
from __future__ import annotations

import itertools
import logging
import time
import warnings
from pathlib import Path
from typing import Any, Callable

import torch
import torch.fx as fx

from ..api import Explanation, FallbackInfo, KernelInfo
from ..config import Config
from ..counters import counters
from ..ir.buffers import Unsupported
from ..ir.lowering import lower_graph
from ..passes import PassContext, run_passes
from ..scheduler.fusion import buffer_readers, schedule
from ..scheduler.loops import plan_loops

log = logging.getLogger("torchfuse")
_graph_ids = itertools.count()


def _eager(gm: fx.GraphModule) -> Callable:
    def run(args: list) -> Any:
        out = gm(*args)
        args.clear()
        return out
    run._boxed_call = True  # type: ignore[attr-defined]
    return run


class DebugWriter:
    """Writes each stage of one graph's compilation to `<debug_dir>/<graph name>/NN_stage.txt`."""

    def __init__(self, config: Config, name: str):
        self.dir: Path | None = Path(config.debug_dir) / name if config.debug else None
        self.step = 0
        if self.dir is not None:
            self.dir.mkdir(parents=True, exist_ok=True)

    def write(self, stage: str, text: str) -> None:
        if self.dir is None:
            return
        (self.dir / f"{self.step:02d}_{stage}").write_text(text)
        self.step += 1


def compile_graph(gm: fx.GraphModule, config: Config, *, inference: bool, kind: str = "forward",
                  report: Explanation | None = None) -> Callable:
    """Compile an aten graph into a boxed callable `fn(list_of_inputs) -> tuple_of_outputs`."""
    graph_name = f"graph{next(_graph_ids)}_{kind}"
    debug = DebugWriter(config, graph_name)
    counters.bump("graphs_compiled")
    t0 = time.perf_counter()
    before = gm.print_readable(print_output=False)
    debug.write("aten_graph.txt", before)
    records = run_passes(gm, config.passes, PassContext(inference=inference))
    after = gm.print_readable(print_output=False)
    debug.write("passes.txt", "\n".join(map(str, records)) + "\n\n" + after)
    if report is not None:
        report.graphs += [f"# {graph_name}: aten graph\n{before}", f"# {graph_name}: after passes\n{after}"]
        report.passes += [f"{graph_name}: {r}" for r in records]
    try:
        program, fallbacks = lower_graph(gm, config)
    except Unsupported as e:
        warnings.warn(f"torchfuse: {graph_name} runs eagerly: {e}")
        counters.bump("eager_fallbacks")
        return _eager(gm)
    debug.write("loop_ir.txt", str(program))
    sched = schedule(program, config)
    debug.write("fusion.txt", str(sched))
    counters.bump("fallback_ops", len(fallbacks))
    for node, op, reason in fallbacks:
        log.debug("%s: %s runs through ATen: %s", graph_name, op, reason)

    from ..codegen import cpp
    from ..runtime.cpp_build import CompileError, load_library
    from ..runtime.wrapper import WrapperBuilder, make_callable

    readers = buffer_readers(sched, program)
    dtypes = {name: meta[2] for name, meta in program.buffer_meta.items()}
    sources, kernel_args, stored, infos = [], {}, set(), []
    for kernel in sched.kernels:
        plan = plan_loops(kernel, readers)
        src, bufs, syms = cpp.kernel_source(plan, dtypes, config.parallel_threshold)
        sources.append(src)
        kernel_args[kernel.name] = (bufs, syms)
        stored |= plan.stored
        infos.append(KernelInfo(kernel.name, "cpp", src, [f"{o}" for o in kernel.origins], kernel.kind))
    counters.bump("kernels_generated", len(sources))
    unit = cpp.translation_unit(sources)
    debug.write("kernels.cpp", unit)
    builder = WrapperBuilder(program, sched.items, kernel_args, stored)
    wrapper_src = builder.build()
    debug.write("wrapper.py", wrapper_src)
    if report is not None:
        report.kernels += infos
        report.fallbacks += [FallbackInfo(n, op, reason) for n, op, reason in fallbacks]
        report.refused_fusions += sched.refused
    kernels: dict[str, Callable] = {}
    if sources:
        try:
            lib = load_library(unit, config)
        except CompileError as e:
            if config.strict:
                raise
            warnings.warn(f"torchfuse: building the kernels of {graph_name} failed, so this graph runs "
                          f"eagerly (set options={{'strict': True}} to raise instead).\n{e}")
            counters.bump("eager_fallbacks")
            return _eager(gm)
        lib.tf_set_num_threads(config.num_threads or torch.get_num_threads())
        for name in kernel_args:
            kernels[name] = getattr(lib, name)
            _set_argtypes(kernels[name], kernel_args[name])
    call = make_callable(wrapper_src, builder.globals, kernels)
    call._boxed_call = True  # type: ignore[attr-defined]
    call._torchfuse_lib = kernels  # keep the library alive as long as the callable
    log.info("torchfuse: compiled %s: %d kernels, %d ATen fallbacks in %.1f ms", graph_name, len(sources),
             len(fallbacks), 1e3 * (time.perf_counter() - t0))
    return call


def _set_argtypes(fn: Any, args: tuple[list[str], list[str]]) -> None:
    import ctypes
    bufs, syms = args
    fn.argtypes = [ctypes.c_void_p] * len(bufs) + [ctypes.c_int64] * len(syms)
    fn.restype = None
