"""The Triton backend: one Triton module per graph (codegen.py), loaded and launched through
launch.py's helpers (one call site per kernel call, bound to Triton's C launcher after the first
launch), compiled ahead of the first call in worker processes (precompile.py, compile_workers.py).
CPU tensors run under Triton's interpreter (`cpu_backend="triton"`)."""
from __future__ import annotations

import dataclasses
import os
from concurrent.futures import Future
from typing import Any, Callable

import torch

from ...config import Config
from ...counters import counters
from ...ir.nodes import py_index
from ...scheduler.loops import LoopPlan, rows_contiguous
from ...scheduler.split import SplitParams
from ..base import Backend, Features, GeneratedCode, GraphCode, KernelCode, product, span
from . import codegen


def gpu_split_params(sms: int, min_chunk: int = 0) -> SplitParams:
    """How reductions split on a GPU of `sms` SMs (also for a CPU probe that runs a GPU's
    kernels under the interpreter, benchmarks/probes/accuracy_bisect.py).
    A launch costs a few microseconds: below ~256K elements one program is as fast.
    Reductions whose body gathers (a cross entropy's target logits, one per row) are
    latency-bound, not bandwidth-bound: they split at fewer elements, into shorter chunks.
    Column tiles split in fewer than 4 parts measured level with the unsplit tiles (the
    weight-gradient sums of a training step) and cost a second kernel."""
    from .launch import COLUMN_XBLOCK
    return SplitParams.make(2 * sms, 4096, 1 << 18, gather_chunk=256, gather_numel=1 << 12,
                            column_tile=COLUMN_XBLOCK, column_fewest=4, min_chunk=min_chunk)


class _WithDeviceAtomics:
    """TritonBackend.features: the class's Features (what a test patches on the class), read
    through an instance with its device's 16-bit atomic adds (`half_atomic_adds`), which only
    an instance knows."""

    def __init__(self, base: Features) -> None:
        self.base = base

    def __get__(self, obj: Any, cls: Any = None) -> Features:
        if obj is None:
            return self.base
        made = obj.__dict__.get("_device_features")
        if made is None:
            made = obj.__dict__["_device_features"] = dataclasses.replace(
                self.base, half_atomic_add=half_atomic_adds(obj.device_type))
        return made


class TritonBackend(Backend):
    name = "triton"
    title = "Triton"
    # embedding bags stay in ATen's kernels, as under Inductor: the gather-scatter decomposition
    # measured 1.01x ATen's in inference and 0.87x in a training step on an H100 (8 tables of
    # 100k x 64, 2048 bags of 20; benchmarks/probes/embbag_features.py)
    features = _WithDeviceAtomics(Features(reductions_in_place=True, scatter_dtypes=codegen.SCATTER_DTYPES,
                                           scatter_wide_sums=True, embedding_bag_kernels=False,
                                           scatter_in_reductions=True))
    variant_suffixes = ("", "_persistent", "_looped", "_tiled")

    def split_params(self, num_threads: int, min_chunk: int = 0) -> SplitParams:
        if self.device_type != "cuda":
            # Triton's interpreter on a CPU does not count tiles
            return SplitParams.on_cpu(num_threads, min_chunk)
        sms = torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count
        return gpu_split_params(sms, min_chunk)

    def kernel(self, plan: LoopPlan, graph: GraphCode) -> KernelCode:
        kernel = plan.kernel
        checks: list = []
        src, bufs, syms = codegen.kernel_source(plan, graph.dtypes, checks, graph.config.runtime_checks)
        # a kernel with run-time checks stores their failures in error slots of its own
        err = [f"_tferr_{kernel.name}"] if checks else []
        slots = (err[0], tuple(c[:2] for c in checks),
                 [py_index(c[2]) if c[2] is not None else "0" for c in checks],
                 _device_of(graph.program, bufs, self.device_type)) if checks else None
        xnumel = py_index(product(plan.outer))
        big = _needs_64bit_expr(graph.program, bufs, plan)
        tile = codegen.tile_dims(plan)
        register_only: set[str] = set()
        if tile is not None:
            xsize = product([plan.outer[d] for d in tile.xs])
            ny, nx = py_index(plan.outer[tile.y]), py_index(xsize)
            helper, variants, sizes, kw = "_launch_tiled", [f"{kernel.name}_tiled"], [nx, ny, xnumel, big], {}
            if plan.kernel.scatter is not None:
                kw["rows"] = True       # whole rows per tile (launch.row_tile_blocks)
            sym = (_symbolic(xsize), _symbolic(plan.outer[tile.y]))
        elif kernel.kind == "pointwise":
            helper, variants, sizes, kw = "_launch_pointwise", [kernel.name], [xnumel, big], {}
            sym = (_symbolic(product(plan.outer)),)
        else:
            helper, variants = "_launch_reduction", [f"{kernel.name}_persistent", f"{kernel.name}_looped"]
            sizes = [xnumel, py_index(product(plan.inner)), big]
            kw = {"xfast": True} if rows_contiguous(plan) else {}
            if not kw and _always_persistent(plan):
                # values the row's later loops read back stay in registers: no buffer
                register_only = set(plan.carried)
            sym = (_symbolic(product(plan.outer)), _symbolic(product(plan.inner)))
        if any(sym):       # block sizes that hold for every value (launch._LARGE)
            kw["sym"] = sym
        # the wrapper calls the kernel's own call site; the helper call (the same launch) is what
        # the parallel precompile plans from
        launch_call = (f"{helper}({', '.join(variants + sizes + bufs + err + syms)}"
                       + "".join(f", {k}={v!r}" for k, v in kw.items()) + ")")
        site_call = f"{kernel.name}_site({', '.join(sizes + bufs + err + syms)})"
        return KernelCode(src, bufs, syms, site=(helper, variants, len(sizes), len(bufs + err), len(syms), kw),
                          site_call=site_call, launch_call=launch_call, register_only=register_only,
                          error_slots=slots)

    def build(self, code: GeneratedCode, config: Config, debug: Callable[[str, str], None]) -> dict[str, Any]:
        kernels: dict[str, Any] = {}
        if code.sources:
            from .module import module_source
            from .launch import (ensure_interpreter_if_cpu, launch_pointwise, launch_reduction, launch_tiled,
                                 load_module)
            ensure_interpreter_if_cpu("cpu" if config.cpu_backend == "triton" else "cuda")
            module_src = module_source(code.sources, interpreter=os.environ.get("TRITON_INTERPRET") == "1")
            debug("kernels_triton.py", module_src)
            module = load_module(module_src, config)
            for name in code.kernel_args:
                for variant in (name + suffix for suffix in self.variant_suffixes):
                    if hasattr(module, variant):
                        kernels[variant] = getattr(module, variant)
            kernels["_launch_pointwise"] = launch_pointwise
            kernels["_launch_reduction"] = launch_reduction
            kernels["_launch_tiled"] = launch_tiled
        return kernels

    def link(self, code: GeneratedCode, kernels: dict[str, Any]) -> None:
        """Bind each kernel's launch site (one per kernel call in the wrapper) into `kernels`."""
        if code.sites:
            from .launch import make_site
            for name, (helper, variants, n_sizes, n_bufs, n_syms, kw) in code.sites.items():
                kernels[f"{name}_site"] = make_site(kernels[helper], [kernels[v] for v in variants], n_sizes,
                                                    n_bufs, n_syms, **kw)

    def precompile(self, scope: dict[str, Any], launches: list[tuple[str, list]], schedule: Any,
                   program: Any, config: Config) -> Future | None:
        """Compile the graph's kernels in parallel instead of one by one on first launch.  `scope`:
        the wrapper's globals and kernels (a split reduction's binding calls `_split_factor`:
        without it, a symbolic graph's split reductions compiled one by one on first launch)."""
        if config.autotune or config.compile_workers == 1:
            return None
        from .precompile import default_workers, enabled, plan_launches, precompile, symbol_values
        with counters.timed("precompile"):
            if not enabled():
                return None
            dtypes = {name: meta[2] for name, meta in program.buffer_meta.items()}
            planned = plan_launches(launches, scope, dtypes, symbol_values(program))
            return precompile(planned, config.compile_workers or default_workers())

    def warm_up(self, config: Config) -> None:
        """A GPU graph's kernels compile in worker processes; start a few now, so they start
        (import Triton, compile a first kernel) while the graph is traced and lowered.  More start
        when a graph's kernels are known and outnumber them (compile_workers.WorkerPool.submit)."""
        if self.device_type != "cuda" or config.compile_workers == 1 or config.autotune:
            return
        from . import compile_workers, precompile
        if precompile.enabled():
            from triton.runtime.driver import driver
            compile_workers.pool(config.compile_workers or precompile.default_workers()).start(
                driver.active.get_current_target(), count=compile_workers.EARLY_WORKERS)

    @property
    def environment(self) -> dict[str, str]:
        # Triton runs CPU tensors only under its interpreter, read when Triton is imported
        return {"TRITON_INTERPRET": "1"} if self.device_type == "cpu" else {}


def half_atomic_adds(device_type: str) -> frozenset:
    """The 16-bit dtypes whose `tl.atomic_add` works on this device (Features.half_atomic_add):
    on CUDA, fp16 from sm_70 and bf16 from sm_90 (the PTX `red.add.noftz` forms Triton emits;
    Inductor takes bf16 atomics from sm_90 too); Triton's interpreter (CPU tensors) adds fp16 but
    raises "Unsupported data type" for bf16.  ROCm and a CUDA graph traced without a GPU keep
    the wide sums.

    bf16 was once left out on CUDA: on an H200 (Triton 3.6) the bf16 atomic adds made
    torch_geometric's bf16 GCN, GraphSAGE and GIN inference 2.5-4x slower than the fp32-buffer
    sums (GIN 4.88 ms a call against 2.52; eager's own bf16 atomics 4.97), where Inductor takes
    1.21.  Those adds were scalar (`red.add.noftz.bf16`, one per element): the scatter's masked
    address hid its contiguity from Triton.  With the bare offset (codegen `_emit_scatter`) a
    row of 256 bf16 adds 8 at a time (`red.global.add.noftz.v8.bf16`, Inductor's form; probe:
    benchmarks/probes/ptx_atomics.py), and half the bytes of the fp32 buffer, with no rounding
    pass after it.  Not yet re-measured on a GPU.  fp16 on a GPU has not been measured."""
    if device_type == "cpu":
        return frozenset({torch.float16})
    if device_type != "cuda" or not torch.cuda.is_available() or torch.version.hip is not None:
        return frozenset()
    cap = torch.cuda.get_device_capability()
    return frozenset(([torch.float16] if cap >= (7, 0) else []) + ([torch.bfloat16] if cap >= (9, 0) else []))


def _needs_64bit_expr(program: Any, bufs: list[str], plan: LoopPlan) -> str:
    """A Python expression: can any element offset of this kernel pass 2**31?  Offsets are at
    most sum((size-1)*stride) of each buffer's layout (and the loop's own numel); for static
    shapes this folds to a constant at compile time."""
    terms = [py_index(product(plan.outer + plan.inner))]
    terms += [py_index(span(program.buffer_meta[b])) for b in bufs]
    if all(t.lstrip("-").isdigit() for t in terms):
        return str(max(int(t) for t in terms) >= 2 ** 31 - 2 ** 20)
    return f"max({', '.join(terms)}) >= {2 ** 31 - 2 ** 20}"


def _always_persistent(plan: LoopPlan) -> bool:
    """Does the launcher always pick this reduction's persistent variant (the whole row in
    registers)?  Rows of a known length within the limit, not walked as column tiles."""
    from .launch import PERSISTENT_LIMIT
    rnumel = product(plan.inner)
    return rnumel.op == "const" and rnumel.arg <= PERSISTENT_LIMIT


def _symbolic(size: Any) -> bool:
    return size.op != "const"


def _device_of(program: Any, bufs: list[str], device_type: str) -> Any:
    """The device of a kernel's buffers (where its error slots go)."""
    for b in bufs:
        meta = program.buffer_meta.get(b)
        if meta is not None and meta[3] is not None:
            return torch.device(meta[3])
    return torch.device(device_type)
