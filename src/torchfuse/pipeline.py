"""The core pipeline for one aten graph: passes -> lowering -> fusion -> codegen -> build -> wrapper.

Both front doors (Dynamo/AOTAutograd and, later, lazy eager fusion) call `compile_graph`.
Every stage can be written to the debug folder as text.
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

from .report import Explanation, FallbackInfo, KernelInfo
from .config import Config
from .counters import counters
from .ir.buffers import Unsupported
from .lowering.graph import lower_graph
from .lowering.values import graph_device
from .passes import PassContext, run_passes
from .passes.host_scalars import move_host_scalars
from . import progress
from .runtime.subgraphs import compile_subgraphs
from .scheduler.fusion import buffer_readers, schedule
from .scheduler.loops import plan_loops, rows_contiguous
from .scheduler.naming import name_kernels
from .scheduler.split import SplitParams, split_reductions

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
                  report: Explanation | None = None, static_inputs: set[int] | None = None) -> Callable:
    """Compile an aten graph into a boxed callable `fn(list_of_inputs) -> tuple_of_outputs`.

    `static_inputs` are the positions of parameters and buffers (AOTAutograd's
    static_input_indices): in an inference graph what is computed from them alone is hoisted
    out of the per-call path (passes/hoist_static.py)."""
    with progress.compiling(config):
        return _compile_graph(gm, config, inference, kind, report, static_inputs)


def _compile_graph(gm: fx.GraphModule, config: Config, inference: bool, kind: str,
                   report: Explanation | None, static_inputs: set[int] | None) -> Callable:
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
                                                      index_add_devices=config.index_add_devices,
                                                      fp32_matmul_tf32=_fp32_matmul_tf32()))
    after = gm.print_readable(print_output=False) if readable else ""
    debug.write("passes.txt", "\n".join(map(str, records)) + "\n\n" + after)
    # the blocks of torch.compiler.nested_compile_region: each compiled once, called per use
    compile_subgraphs(gm, lambda sub, name: compile_graph(sub, config, inference=inference, kind=f"{kind}_{name}",
                                                          report=report))
    if report is not None:
        report.graphs += [f"# {graph_name}: aten graph\n{before}", f"# {graph_name}: after passes\n{after}"]
        report.passes += [f"{graph_name}: {r}" for r in records]
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
        return StaticPrologue(_lower_and_build(gm, config, graph_name, debug, report, t0), hoisted,
                              config.freezing)
    return _lower_and_build(gm, config, graph_name, debug, report, t0)


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


def _lower_and_build(gm: fx.GraphModule, config: Config, graph_name: str, debug: "DebugWriter",
                     report: Explanation | None, t0: float) -> Callable:
    """The stages after the graph passes: lowering, fusion, codegen, build, wrapper."""
    try:
        with counters.timed("lowering"):
            program, fallbacks = lower_graph(gm, config)
    except Unsupported as e:
        warnings.warn(f"torchfuse: {graph_name} runs eagerly: {e}")
        counters.bump("eager_fallbacks")
        return _eager(gm)
    debug.write("loop_ir.txt", lambda: str(program))
    with counters.timed("schedule"):
        sched = schedule(program, config)
        if config.split_reductions:
            sched = split_reductions(sched, program, buffer_readers(sched, program), _split_params(program, config))
        sched = name_kernels(sched)
    debug.write("fusion.txt", lambda: str(sched))
    counters.bump("fallback_ops", len(fallbacks))
    for node, op, reason in fallbacks:
        log.debug("%s: %s runs through ATen: %s", graph_name, op, reason)

    from .codegen.wrapper import WrapperBuilder, py_index

    t_codegen = time.perf_counter()
    readers = buffer_readers(sched, program)
    dtypes = {name: meta[2] for name, meta in program.buffer_meta.items()}
    device = program_device(program)
    backend = "triton" if device == "cuda" else config.cpu_backend
    plans = [plan_loops(kernel, readers, split=backend == "cpp") for kernel in sched.kernels]
    stored = set().union(*(p.stored for p in plans)) if plans else set()
    kernel_args: dict[str, tuple[list[str], list[str]]] = {}
    kernel_calls: dict[str, str] = {}
    site_calls: dict[str, str] = {}
    sites: dict[str, tuple] = {}
    sources, infos = [], []
    traces = {n.name: n.meta.get("stack_trace") for n in gm.graph.nodes} if report is not None else {}
    unique: dict[str, str] = {}
    aliases: dict[str, str] = {}
    register_only: set[str] = set()
    int32_buffers = _int32_addressable(program) if backend != "triton" else frozenset()
    try:
        for plan in plans:
            kernel = plan.kernel
            if backend == "triton":
                from .backends.triton import codegen as tgen
                src, bufs, syms = tgen.kernel_source(plan, dtypes)
                xnumel = py_index(_product(plan.outer))
                big = _needs_64bit_expr(program, bufs, plan)
                tile = tgen.tile_dims(plan)
                if tile is not None:
                    ny, nx = (py_index(plan.outer[d]) for d in tile)
                    helper, variants, sizes, kw = "_launch_tiled", [f"{kernel.name}_tiled"], [nx, ny, xnumel, big], {}
                    sym = tuple(_symbolic(plan.outer[d]) for d in reversed(tile))
                elif kernel.kind == "pointwise":
                    helper, variants, sizes, kw = "_launch_pointwise", [kernel.name], [xnumel, big], {}
                    sym = (_symbolic(_product(plan.outer)),)
                else:
                    helper, variants = "_launch_reduction", [f"{kernel.name}_persistent", f"{kernel.name}_looped"]
                    sizes = [xnumel, py_index(_product(plan.inner)), big]
                    kw = {"xfast": True} if rows_contiguous(plan) else {}
                    if not kw and _always_persistent(plan):
                        # values the row's later loops read back stay in registers: no buffer
                        register_only |= plan.carried
                    sym = (_symbolic(_product(plan.outer)), _symbolic(_product(plan.inner)))
                if any(sym):       # block sizes that hold for every value (triton_launch._LARGE)
                    kw["sym"] = sym
                # the wrapper calls the kernel's own call site; the helper call (the same launch)
                # is what the parallel precompile plans from
                kernel_calls[kernel.name] = (f"{helper}({', '.join(variants + sizes + bufs + syms)}"
                                             + "".join(f", {k}={v!r}" for k, v in kw.items()) + ")")
                site_calls[kernel.name] = f"{kernel.name}_site({', '.join(sizes + bufs + syms)})"
                sites[kernel.name] = (helper, variants, len(sizes), len(bufs), len(syms), kw)
            else:
                from .backends.cpp import codegen as cpp
                src, bufs, syms = cpp.kernel_source(plan, dtypes, config.parallel_threshold, int32_buffers)
            kernel_args[kernel.name] = (bufs, syms)
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
                infos.append(KernelInfo(kernel.name, backend, src, list(kernel.origins), kernel.kind, graph_name,
                                        source_lines(traces, kernel.origins), writes))
    except NotImplementedError as e:
        if config.strict:
            raise
        warnings.warn(f"torchfuse: {graph_name} runs eagerly: code generation failed: {e}")
        counters.bump("eager_fallbacks")
        return _eager(gm)
    counters.bump("kernels_generated", len(sources))
    builder = WrapperBuilder(program, sched.items, kernel_args, stored, site_calls, register_only,
                             reductions_in_place=backend == "triton")
    wrapper_src = builder.build()
    counters.bump("buffers_reused_in_place", builder.reused)
    debug.write("memory.txt", builder.memory.describe() + "\n")
    if report is not None:
        report.memory.append(f"{graph_name}: {builder.memory.describe()}")
    counters.add_seconds("codegen", time.perf_counter() - t_codegen)
    debug.write("wrapper.py", wrapper_src)
    if report is not None:
        report.kernels += infos
        report.fallbacks += [FallbackInfo(n, op, reason, graph_name) for n, op, reason in fallbacks]
        report.refused_fusions += sched.refused
    code = GeneratedCode(backend, wrapper_src, builder.globals, sources,
                         {k: v for k, v in kernel_args.items() if k not in aliases}, aliases, sites)
    try:
        call = build_and_link(code, config, debug, lambda kernels: _precompile({**code.globals, **kernels}, kernel_calls,
                                                                               sched, program, config))
    except Exception as e:   # a kernel that fails to build: warn once, run this graph eagerly
        if config.strict:
            raise
        warnings.warn(f"torchfuse: building the kernels of {graph_name} failed, so this graph runs "
                      f"eagerly (set options={{'strict': True}} to raise instead).\n{e}")
        counters.bump("eager_fallbacks")
        return _eager(gm)
    log.info("torchfuse: compiled %s: %d kernels, %d ATen fallbacks in %.1f ms", graph_name, len(sources),
             len(fallbacks), 1e3 * (time.perf_counter() - t0))
    return call


@dataclasses.dataclass
class GeneratedCode:
    """What code generation made of one graph, all a restart needs to link it again without
    running any stage (frontend/saved_program.py stores it): the wrapper, its constants, the
    kernel sources and argument lists, kernels identical to an earlier one, and the Triton
    kernels' launch sites."""
    backend: str
    wrapper: str
    globals: dict
    sources: list[str]
    kernel_args: dict[str, tuple[list[str], list[str]]]
    aliases: dict[str, str]
    sites: dict[str, tuple]


def build_and_link(code: GeneratedCode, config: Config, debug: "DebugWriter",
                   precompile: Callable[[dict], Future | None] | None = None) -> Callable:
    """Build (or load from the kernel cache) the kernels of `code` and bind its wrapper to them;
    `precompile` starts compiling Triton kernels ahead of their first launch (a fresh compile
    knows the launches; a restart leaves that to Triton's own cache), and the first call waits
    for it."""
    with counters.timed("build"):
        kernels = _build(code.backend, code.sources, code.kernel_args, config, debug)
    for dup, first in code.aliases.items():
        for suffix in ("", "_persistent", "_looped", "_tiled"):
            if first + suffix in kernels:
                kernels[dup + suffix] = kernels[first + suffix]
    if code.sites:
        from .backends.triton.launch import make_site
        for name, (helper, variants, n_sizes, n_bufs, n_syms, kw) in code.sites.items():
            kernels[f"{name}_site"] = make_site(kernels[helper], [kernels[v] for v in variants], n_sizes, n_bufs,
                                                n_syms, **kw)
    pending = None
    if precompile is not None and code.backend == "triton" and not config.autotune and config.compile_workers != 1:
        with counters.timed("precompile"):
            pending = precompile(kernels)
    from .codegen.wrapper import make_callable
    call = make_callable(code.wrapper, code.globals, kernels)
    if pending is not None:
        call = _first_call_waits(pending, call)
    call._boxed_call = True  # type: ignore[attr-defined]
    call._torchfuse_lib = kernels  # type: ignore[attr-defined]  (the libraries live as long as the callable)
    call._torchfuse_code = code  # type: ignore[attr-defined]
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


def _precompile(scope: dict, kernel_calls: dict[str, str], sched, program, config: Config) -> Future | None:
    """Start compiling the graph's Triton kernels in parallel instead of one by one on first launch.
    `scope`: the wrapper's globals and kernels (a split reduction's binding calls `_split_factor`:
    without it, a symbolic graph's split reductions compiled one by one on first launch, 76
    of a ResNet-18 training step's 120 kernels on an H200)."""
    from .backends.triton.precompile import default_workers, enabled, plan_launches, precompile, symbol_values
    if not enabled():
        return None
    calls = [(kernel_calls[k.name], k.bindings) for k in sched.kernels if k.name in kernel_calls]
    dtypes = {name: meta[2] for name, meta in program.buffer_meta.items()}
    launches = plan_launches(calls, scope, dtypes, symbol_values(program))
    return precompile(launches, config.compile_workers or default_workers())


def _split_params(program, config: Config) -> SplitParams:
    device = program_device(program)
    if device == "cuda" and not torch.cuda.is_available():
        device = "cpu"
    backend = "triton" if device == "cuda" else config.cpu_backend
    return SplitParams.for_device(device, config.num_threads or torch.get_num_threads(), config.split_min_chunk,
                                  backend)


def _needs_64bit_expr(program, bufs: list[str], plan) -> str:
    """A Python expression: can any element offset of this kernel pass 2**31?  Offsets are at
    most sum((size-1)*stride) of each buffer's layout (and the loop's own numel); for static
    shapes this folds to a constant at compile time."""
    from .codegen.wrapper import py_index
    terms = [py_index(_product(plan.outer + plan.inner))]
    terms += [py_index(_span(program.buffer_meta[b])) for b in bufs]
    if all(t.lstrip("-").isdigit() for t in terms):
        return str(max(int(t) for t in terms) >= 2 ** 31 - 2 ** 20)
    return f"max({', '.join(terms)}) >= {2 ** 31 - 2 ** 20}"


def _span(meta) -> Node:
    """The largest element offset of a buffer's layout: sum((size-1)*stride)."""
    from .ir.nodes import const
    sizes, strides = meta[0], meta[1]
    span = const(0)
    for sz, st in zip(sizes, strides):
        span = span + (sz - 1) * st
    return span


def _int32_addressable(program) -> frozenset[str]:
    """Buffers of static layout whose every element offset fits an int32 (C++ gathers from them
    index with int32: see backends/cpp/codegen.py's Emitter)."""
    out = set()
    for name, meta in program.buffer_meta.items():
        span = _span(meta)
        if span.op == "const" and span.arg < 2 ** 31 - 2 ** 20:
            out.add(name)
    return frozenset(out)


def _canonical(src: str, name: str, bufs: list[str]) -> str:
    """The kernel's source with its arguments named by position and every other buffer name
    (accumulators such as `acc_buf38`, locals) by order of first appearance: kernels equal
    under this renaming are the same code."""
    import re
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


def program_device(program) -> str:
    device = graph_device(val for _, val in program.inputs)
    if device is not None:
        return device.type
    for meta in program.buffer_meta.values():
        if meta[3] is not None:
            return torch.device(meta[3]).type
    return "cpu"


def _always_persistent(plan: Any) -> bool:
    """Does the launcher always pick this Triton reduction's persistent variant (the whole row
    in registers)?  Rows of a known length within the limit, not walked as column tiles."""
    from .backends.triton.launch import PERSISTENT_LIMIT
    rnumel = _product(plan.inner)
    return rnumel.op == "const" and rnumel.arg <= PERSISTENT_LIMIT


def _symbolic(size: Any) -> bool:
    return size.op != "const"


def _product(sizes):
    from .ir.nodes import const
    out = const(1)
    for s in sizes:
        out = out * s
    return out


def _build(backend: str, sources: list[str], kernel_args: dict, config: Config, debug: DebugWriter) -> dict:
    """Compile all kernels of a graph (one C++ translation unit / one Triton module)."""
    kernels: dict[str, Any] = {}
    if not sources:
        return kernels
    if backend == "triton":
        from .backends.triton.codegen import module_source
        from .backends.triton.launch import (ensure_interpreter_if_cpu, launch_pointwise, launch_reduction, launch_tiled, load_module)
        ensure_interpreter_if_cpu("cpu" if config.cpu_backend == "triton" else "cuda")
        module_src = module_source(sources, interpreter=os.environ.get("TRITON_INTERPRET") == "1")
        debug.write("kernels_triton.py", module_src)
        module = load_module(module_src, config)
        for name in kernel_args:
            for variant in (name, f"{name}_persistent", f"{name}_looped", f"{name}_tiled"):
                if hasattr(module, variant):
                    kernels[variant] = getattr(module, variant)
        kernels["_launch_pointwise"] = launch_pointwise
        kernels["_launch_reduction"] = launch_reduction
        kernels["_launch_tiled"] = launch_tiled
        return kernels
    from .backends.cpp import codegen as cpp
    from .backends.cpp.build import load_library
    unit = cpp.translation_unit(sources)
    debug.write("kernels.cpp", unit)
    lib = load_library(unit, config)
    lib.tf_set_num_threads(config.num_threads or torch.get_num_threads())
    for name in kernel_args:
        kernels[name] = getattr(lib, name)
        _set_argtypes(kernels[name], kernel_args[name])
    return kernels


def _set_argtypes(fn: Any, args: tuple[list[str], list[str]]) -> None:
    import ctypes
    bufs, syms = args
    fn.argtypes = [ctypes.c_void_p] * len(bufs) + [ctypes.c_int64] * len(syms)
    fn.restype = None


def _fp32_matmul_tf32() -> bool:
    """Whether cuBLAS may use TF32 for fp32 products (torch >= 2.9 reports both of its APIs here)."""
    try:
        return torch.backends.cuda.matmul.fp32_precision == "tf32"
    except (AttributeError, RuntimeError):
        return True        # unknown: treat products as tensor-core ones (pad_mm pads, as it did)
