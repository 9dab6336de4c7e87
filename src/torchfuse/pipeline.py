"""The compile driver for one aten graph: passes -> lowering -> fusion -> codegen -> build -> wrapper.

Both front doors (frontend/dynamo.py for Dynamo/AOTAutograd, lazy/cache.py for the lazy mode)
call `compile_graph` (or `try_compile_graph`, which returns an `EagerFallback` instead of
warning).  The graph's backend (backends.for_device) generates and builds the kernels; nothing
here depends on which backend it is.  Every stage can be written to the debug folder as text.
"""
from __future__ import annotations

import dataclasses
import itertools
import logging
import os
import re
import time
import warnings
from concurrent.futures import Future
from pathlib import Path
from typing import Any, Callable

import torch
import torch.fx as fx

from . import backends
from .backends.base import GeneratedCode, GraphCode
from .codegen.wrapper import WrapperBuilder, make_callable
from .report import Explanation, FallbackInfo, KernelInfo
from .config import Config
from .counters import counters
from .ir.buffers import LoweredGraph, Unsupported
from .lowering.graph import lower_graph
from .lowering.values import graph_device
from .passes import PassContext, run_passes
from .passes.host_scalars import move_host_scalars
from . import progress
from .runtime.subgraphs import compile_subgraphs
from .scheduler.fusion import buffer_readers, schedule
from .scheduler.loops import plan_loops
from .scheduler.naming import name_kernels, user_ops
from .scheduler.overlap import describe as describe_collectives
from .scheduler.split import split_reductions

log = logging.getLogger("torchfuse")
_graph_ids = itertools.count()


class DebugWriter:
    """Writes each stage of one graph's compilation to `<debug_dir>/<graph name>/NN_stage.txt`."""

    def __init__(self, config: Config, name: str):
        self.dir: Path | None = Path(config.debug_dir) / name if config.debug else None
        self.step = 0
        if self.dir is not None:
            try:
                self.dir.mkdir(parents=True, exist_ok=True)
            except OSError as e:      # debugging output must never stop a compile
                _warn_debug_once(f"torchfuse: cannot write the debug folder {self.dir} ({e}); compiling "
                                 "without it (set TORCHFUSE_DEBUG or options['debug_dir'] to a writable folder)")
                self.dir = None

    def write(self, stage: str, text: str | Callable[[], str]) -> None:
        """`text` may be a function, so a stage is printed only when debugging."""
        if self.dir is None:
            return
        try:
            (self.dir / f"{self.step:02d}_{stage}").write_text(text() if callable(text) else text)
        except OSError as e:
            _warn_debug_once(f"torchfuse: cannot write to the debug folder {self.dir} ({e}); compiling without it")
            self.dir = None
        self.step += 1


_debug_warned = False


def _warn_debug_once(message: str) -> None:
    global _debug_warned
    if not _debug_warned:
        warnings.warn(message)
        _debug_warned = True


def compile_graph(gm: fx.GraphModule, config: Config, *, inference: bool, kind: str = "forward",
                  report: Explanation | None = None, static_inputs: set[int] | None = None,
                  tiered: bool = False) -> Callable:
    """Compile an aten graph into a boxed callable `fn(list_of_inputs) -> tuple_of_outputs`;
    a graph that cannot be compiled runs eagerly, with a warning (and counters["eager_fallbacks"]).

    `static_inputs` are the positions of parameters and buffers (AOTAutograd's
    static_input_indices): in an inference graph what is computed from them alone is hoisted
    out of the per-call path (passes/hoist_static.py).  `tiered`: calls made while the kernels
    still compile in the background run `gm` through ATen instead of waiting
    (Config.first_calls, runtime/tiered.py); a build failing there is reported at the switch."""
    result = try_compile_graph(gm, config, inference=inference, kind=kind, report=report,
                               static_inputs=static_inputs, tiered=tiered)
    fallback = eager_fallback(result)
    if fallback is not None:
        warnings.warn(fallback.message)
        counters.bump("eager_fallbacks")
    return result


def try_compile_graph(gm: fx.GraphModule, config: Config, *, inference: bool, kind: str = "forward",
                      report: Explanation | None = None, static_inputs: set[int] | None = None,
                      tiered: bool = False) -> Callable:
    """compile_graph without its warning: the result is an EagerFallback (see `eager_fallback`)
    where the graph cannot be compiled, and the caller decides what to say."""
    with progress.compiling(config):
        return _compile_graph(gm, config, inference, kind, report, static_inputs, tiered)


def _compile_graph(gm: fx.GraphModule, config: Config, inference: bool, kind: str,
                   report: Explanation | None, static_inputs: set[int] | None, tiered: bool = False) -> Callable:
    graph_name = f"graph{next(_graph_ids)}_{kind}"
    debug = DebugWriter(config, graph_name)
    counters.bump("graphs_compiled")
    t0 = time.perf_counter()
    # printing a large graph costs tens of ms: only when someone reads it
    readable = debug.dir is not None or report is not None
    before = gm.print_readable(print_output=False) if readable else ""
    debug.write("aten_graph.txt", before)
    device = _graph_device(gm)
    move_host_scalars(gm)          # (not a configurable pass: GPU kernels cannot read host memory)
    passes = [p for p in config.passes if p != "conv_bn_fold" or device in config.conv_bn_fold_devices]
    with counters.timed("passes"):
        records = run_passes(gm, passes, PassContext(inference=inference, cublas_devices=config.cublas_devices,
                                                      channels_last_devices=config.channels_last_devices,
                                                      channels_last=config.channels_last_convs,
                                                      index_add_devices=config.index_add_devices,
                                                      fp32_matmul_tf32=_fp32_matmul_tf32()))
    after = gm.print_readable(print_output=False) if readable else ""
    debug.write("passes.txt", "\n".join(map(str, records)) + "\n\n" + after)
    # the blocks of torch.compiler.nested_compile_region: each compiled once, called per use
    compile_subgraphs(gm, lambda sub, name: compile_graph(sub, config, inference=inference, kind=f"{kind}_{name}",
                                                          report=report, tiered=tiered))
    if report is not None:
        report.graphs += [f"# {graph_name}: aten graph\n{before}", f"# {graph_name}: after passes\n{after}"]
        report.passes += [f"{graph_name}: {r}" for r in records]
        if "torchfuse_layout" in gm.meta:
            report.layouts.append(f"{graph_name}: {gm.meta['torchfuse_layout']}")
    hoisted = None
    if inference and static_inputs:
        from .passes.hoist_static import hoist_static
        with counters.timed("passes"):
            hoisted = hoist_static(gm, static_inputs)
    if hoisted is not None:
        what = ("frozen (computed once; later parameter changes are not seen)" if config.freezing
                else "cached until a parameter changes")
        line = f"{graph_name}: {hoisted.describe()}; {what}"
        log.debug("%s", line)
        debug.write("hoisted.txt", lambda: line + "\n\n" + hoisted.const_gm.print_readable(print_output=False))
        if report is not None:
            report.frozen.append(line)
        from .runtime.static_values import StaticPrologue
        return StaticPrologue(_lower_and_build(gm, config, graph_name, debug, report, t0, tiered), hoisted,
                              config.freezing)
    return _lower_and_build(gm, config, graph_name, debug, report, t0, tiered)


_FRAME = re.compile(r'File "([^"]+)", line (\d+), in [^\n]*\n\s*(.*)')


def source_lines(traces: dict[str, str | None], names: list[str]) -> list[str]:
    """The user's source lines behind graph nodes (`traces`: node name -> Dynamo's stack trace;
    its innermost frame), as "file.py:42  code", in order, without repeats; empty where the
    graph has none."""
    out: list[str] = []
    for name in names:
        trace = traces.get(name)
        frames = _FRAME.findall(trace) if trace else []
        if frames:
            path, line, code = frames[-1]
            text = f"{os.path.basename(path)}:{line}  {code.strip()}"
            if text not in out:
                out.append(text)
    return out


@dataclasses.dataclass(eq=False)     # (hashed by identity, as any compiled callable)
class EagerFallback:
    """A graph torchfuse could not compile, run as ATen ran it, with the reason: what
    `try_compile_graph` returns instead of a compiled graph.  Boxed like a compiled graph."""
    gm: fx.GraphModule
    graph_name: str
    stage: str          # "lowering", "codegen" or "build"
    reason: str

    _boxed_call = True

    def __call__(self, args: list) -> Any:
        out = self.gm(*args)
        args.clear()
        return out

    @property
    def message(self) -> str:
        if self.stage == "build":
            return (f"torchfuse: building the kernels of {self.graph_name} failed, so this graph runs "
                    f"eagerly (set options={{'strict': True}} to raise instead).\n{self.reason}")
        if self.stage == "codegen":
            return f"torchfuse: {self.graph_name} runs eagerly: code generation failed: {self.reason}"
        return f"torchfuse: {self.graph_name} runs eagerly: {self.reason}"


def eager_fallback(fn: Callable) -> EagerFallback | None:
    """The EagerFallback that `fn` (what try_compile_graph returned) is or runs, if any."""
    inner = getattr(fn, "main", None)      # (runtime/static_values.StaticPrologue)
    return fn if isinstance(fn, EagerFallback) else inner if isinstance(inner, EagerFallback) else None


def _lower_and_build(gm: fx.GraphModule, config: Config, graph_name: str, debug: "DebugWriter",
                     report: Explanation | None, t0: float, tiered: bool = False) -> Callable | EagerFallback:
    """The stages after the graph passes: lowering, fusion, codegen, build, wrapper."""
    try:
        with counters.timed("lowering"):
            program, fallbacks = lower_graph(gm, config)
    except Unsupported as e:
        return EagerFallback(gm, graph_name, "lowering", str(e))
    debug.write("loop_ir.txt", lambda: str(program))
    device = program_device(program)
    backend = backends.for_device(device, config)
    with counters.timed("schedule"):
        sched = schedule(program, config, scatter_in_reductions=config.scatters_in_reductions and
                         backend.features.scatter_in_reductions)
        if config.split_reductions and backend.features.split_reductions:
            sched = split_reductions(sched, program, buffer_readers(sched, program),
                                     backends.split_params(device, config))
        sched = name_kernels(sched, user_ops(gm.graph))
    debug.write("fusion.txt", lambda: str(sched))
    counters.bump("fallback_ops", len(fallbacks))
    for node, op, reason in fallbacks:
        log.debug("%s: %s runs through ATen: %s", graph_name, op, reason)

    t_codegen = time.perf_counter()
    readers = buffer_readers(sched, program)
    graph = GraphCode(program, {name: meta[2] for name, meta in program.buffer_meta.items()}, config)
    plans = [plan_loops(kernel, readers, split=backend.features.split_loops) for kernel in sched.kernels]
    stored = set().union(*(p.stored for p in plans)) if plans else set()
    kernel_args: dict[str, tuple[list[str], list[str]]] = {}
    launch_calls: dict[str, str] = {}
    kernel_checks: dict[str, list] = {}      # kernel -> its run-time check sites (codegen/checks.py)
    error_slots: dict[str, tuple] = {}       # kernel -> where its failed checks are stored (Triton)
    site_calls: dict[str, str] = {}
    sites: dict[str, tuple] = {}
    sources, infos = [], []
    traces = {n.name: n.meta.get("stack_trace") for n in gm.graph.nodes} if report is not None else {}
    unique: dict[str, str] = {}
    aliases: dict[str, str] = {}
    register_only: set[str] = set()
    try:
        for plan in plans:
            kernel = plan.kernel
            foreign = foreign_reads(program, plan, device)
            if foreign:
                raise NotImplementedError(f"{kernel.name} would read {', '.join(foreign)}, which a kernel on "
                                          f"{device} cannot access (passes/host_scalars.py copies such tensors)")
            code = backend.kernel(plan, graph)
            src, bufs = code.source, code.buffers
            kernel_args[kernel.name] = (bufs, code.symbols)
            register_only |= code.register_only
            if code.site is not None:
                sites[kernel.name], site_calls[kernel.name] = code.site, code.site_call
            if code.launch_call is not None:
                launch_calls[kernel.name] = code.launch_call
            if code.checks and code.error_slots is None:
                kernel_checks[kernel.name] = code.checks
            if code.error_slots is not None:
                error_slots[kernel.name] = code.error_slots
            # Identical kernels (every layer of a transformer) are compiled once: compare sources
            # with buffer names replaced by their argument positions.
            canon = _canonical(src, kernel.name, bufs)
            if canon in unique:
                aliases[kernel.name] = unique[canon]
            else:
                unique[canon] = kernel.name
                sources.append(src)
            if report is not None:
                writes = [f"{m.buffer.name} ({m.buffer.origins[-1] if m.buffer.origins else '?'})"
                          for m in kernel.members if m.buffer.name in plan.stored]
                infos.append(KernelInfo(kernel.name, backend.name, src, list(kernel.origins), kernel.kind, graph_name,
                                        source_lines(traces, kernel.origins), writes))
    except NotImplementedError as e:
        if config.strict:
            raise
        return EagerFallback(gm, graph_name, "codegen", str(e))
    counters.bump("kernels_generated", len(sources))
    builder = WrapperBuilder(program, sched.items, kernel_args, stored, site_calls, register_only,
                             reductions_in_place=backend.features.reductions_in_place,
                             kernel_checks=kernel_checks, triton_checks=error_slots,
                             sync_checks=config.strict if config.sync_checks is None else config.sync_checks)
    wrapper_src = builder.build()
    counters.bump("buffers_reused_in_place", builder.reused)
    collectives = describe_collectives(graph_name, builder.items)
    if collectives:          # where each collective starts and waits: what overlaps the communication
        counters.bump("collectives", len(collectives))
        debug.write("collectives.txt", "\n".join(collectives) + "\n")
        if report is not None:
            report.collectives += collectives
    debug.write("memory.txt", builder.memory.describe() + "\n")
    if report is not None:
        report.memory.append(f"{graph_name}: {builder.memory.describe()}")
    counters.add_seconds("codegen", time.perf_counter() - t_codegen)
    debug.write("wrapper.py", wrapper_src)
    if report is not None:
        report.kernels += infos
        report.fallbacks += [FallbackInfo(n, op, reason, graph_name) for n, op, reason in fallbacks
                             if n not in builder.copies_in_place]
        report.refused_fusions += sched.refused
    code = GeneratedCode(backend.name, wrapper_src, builder.globals, sources,
                         {k: v for k, v in kernel_args.items() if k not in aliases}, aliases, sites,
                         {k: v for k, v in kernel_checks.items() if k not in aliases})
    launches = [(launch_calls[k.name], k.bindings) for k in sched.kernels if k.name in launch_calls]
    try:
        call = build_and_link(code, config, debug, lambda kernels: backend.precompile(
            {**code.globals, **kernels}, launches, sched, program, config),
            tier=(gm, graph_name) if tiered else None)
    except Exception as e:   # a kernel that fails to build: this graph runs eagerly
        if config.strict:
            raise
        return EagerFallback(gm, graph_name, "build", str(e))
    log.info("torchfuse: compiled %s: %d kernels, %d ATen fallbacks in %.1f ms", graph_name, len(sources),
             len(fallbacks), 1e3 * (time.perf_counter() - t0))
    if report is not None and getattr(call, "_torchfuse_tier", None) is not None:
        report.first_calls.append(f"{graph_name}: its kernels compile in the background; calls until then run its "
                                  "aten graph through ATen (first_calls='eager')")
    return call


def build_and_link(code: GeneratedCode, config: Config, debug: "DebugWriter",
                   precompile: Callable[[dict], Future | None] | None = None,
                   tier: tuple[fx.GraphModule, str] | None = None) -> Callable:
    """Build (or load from the kernel cache) the kernels of `code` and bind its wrapper to them;
    `precompile` starts compiling the kernels ahead of their first launch (a fresh compile knows
    the launches; a restart leaves that to the backend's own cache), and the first call waits
    for it.  With `tier` (the aten graph `code` was generated from, and its name), a build the
    backend runs in the background (`Backend.start_build`) or a precompile not done yet makes
    no call wait: calls run the aten graph through ATen until the kernels are ready
    (runtime/tiered.py)."""
    backend = backends.by_name(code.backend)
    started = backend.start_build(code, config, debug.write) if tier is not None else None
    if started is not None:
        compiled: Future = Future()

        def built(future: Future) -> None:
            # (the build's thread): link, start the precompile, and finish once that is done
            try:
                call, pending = _link(code, backend, future.result(), precompile)
            except BaseException as e:
                compiled.set_exception(e)
                return
            counters.add_seconds("build: background", time.perf_counter() - start)
            _when_done(pending, compiled, call)
        start = time.perf_counter()
        started.add_done_callback(built)
        return _tiered(code, tier, compiled, config)
    with counters.timed("build"):
        kernels = backend.build(code, config, debug.write)
    call, pending = _link(code, backend, kernels, precompile)
    if pending is None:
        return call
    if tier is not None:
        compiled = Future()
        _when_done(pending, compiled, call)
        return _tiered(code, tier, compiled, config)
    waiting = _first_call_waits(pending, call)
    waiting._boxed_call = True  # type: ignore[attr-defined]
    waiting._torchfuse_lib = kernels  # type: ignore[attr-defined]
    waiting._torchfuse_code = code  # type: ignore[attr-defined]
    return waiting


def _link(code: GeneratedCode, backend: backends.Backend, kernels: dict,
          precompile: Callable[[dict], Future | None] | None) -> tuple[Callable, Future | None]:
    """The wrapper bound to the built `kernels`, and the precompile it started (or None)."""
    for dup, first in code.aliases.items():
        for suffix in backend.variant_suffixes:
            if first + suffix in kernels:
                kernels[dup + suffix] = kernels[first + suffix]
    backend.link(code, kernels)
    pending = precompile(kernels) if precompile is not None else None
    call = make_callable(code.wrapper, code.globals, kernels)
    call._boxed_call = True  # type: ignore[attr-defined]
    call._torchfuse_lib = kernels  # type: ignore[attr-defined]  (the libraries live as long as the callable)
    call._torchfuse_code = code  # type: ignore[attr-defined]
    return call, pending


def _when_done(pending: Future | None, compiled: Future, call: Callable) -> None:
    """`compiled` gets `call` once `pending` (a precompile; it logs its own failures, a kernel
    that failed compiles again, with its error, at its first launch) has ended."""
    if pending is None:
        compiled.set_result(call)
    else:
        pending.add_done_callback(lambda _: compiled.set_result(call))


def _tiered(code: GeneratedCode, tier: tuple[fx.GraphModule, str], compiled: Future, config: Config) -> Callable:
    from .runtime.tiered import tiered
    gm, graph_name = tier

    def on_failure(error: BaseException) -> Callable:
        # as a build failing in the foreground: one warning, and the graph runs eagerly
        fallback = EagerFallback(gm, graph_name, "build", str(error))
        warnings.warn(fallback.message)
        counters.bump("eager_fallbacks")
        return fallback
    call = tiered(gm, graph_name, compiled, config.strict, on_failure)
    call._torchfuse_code = code  # type: ignore[attr-defined]   (what the graph cache stores)
    return call


def _first_call_waits(pending: Future, call: Callable) -> Callable:
    """`call`, whose first call first waits for its kernels' background compile to end."""
    waiting = [pending]

    def call_after_precompile(args: list) -> Any:
        if waiting:
            start = time.perf_counter()
            waiting.pop().result()          # (the job logs its own failures; it never raises)
            counters.add_seconds("precompile: wait", time.perf_counter() - start)
        return call(args)
    return call_after_precompile


def _canonical(src: str, name: str, bufs: list[str]) -> str:
    """The kernel's source with its arguments named by position and every other buffer name
    (accumulators such as `acc_buf38`, locals) by order of first appearance: kernels equal
    under this renaming are the same code."""
    mapping = {b: f"arg{i}" for i, b in enumerate(bufs)}

    def rename(m: re.Match) -> str:
        return mapping.setdefault(m.group(0), f"local{len(mapping) - len(bufs)}")
    # buffer names also appear inside other identifiers (acc_buf38, acc_buf39_k): not after a
    # letter or digit, not followed by one
    src = re.sub(r"(?<![A-Za-z0-9])(?:in|buf|const)\d+(?:_part)?(?![A-Za-z0-9])", rename, src)
    # Triton reduction and tiled kernels are named <kernel>_persistent / _looped / _tiled
    return re.sub(rf"\b{re.escape(name)}(?=_persistent\b|_looped\b|_tiled\b|\b)", "KERNEL", src)


def _graph_device(gm: fx.GraphModule) -> str:
    device = graph_device(node.meta.get("val") for node in gm.graph.find_nodes(op="placeholder"))
    return device.type if device is not None else "cpu"


def program_device(program: LoweredGraph) -> str:
    device = graph_device(val for _, val in program.inputs)
    if device is not None:
        return device.type
    for meta in program.buffer_meta.values():
        if meta[3] is not None:
            return torch.device(meta[3]).type
    return "cpu"


def foreign_reads(program, plan: Any, device: str) -> list[str]:
    """The buffers a kernel of a graph on `device` would read from another device ("in0 (cpu)"):
    a pointer a GPU kernel cannot follow (Triton fails at launch, or reads garbage)."""
    from .ir.nodes import walk
    out: list[str] = []
    for m in plan.members:
        for n in walk(m.body):
            meta = program.buffer_meta.get(n.arg) if n.op == "load" else None
            if meta is not None and meta[3] is not None and torch.device(meta[3]).type != device:
                text = f"{n.arg} ({torch.device(meta[3]).type})"
                if text not in out:
                    out.append(text)
    return out


def _fp32_matmul_tf32() -> bool:
    """Whether cuBLAS may use TF32 for fp32 products (torch >= 2.9 reports both of its APIs here)."""
    try:
        return torch.backends.cuda.matmul.fp32_precision == "tf32"
    except (AttributeError, RuntimeError):
        return True        # unknown: treat products as tensor-core ones (pad_mm pads, as it did)
