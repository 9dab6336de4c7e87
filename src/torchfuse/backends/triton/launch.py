"""Loading generated Triton modules and launching their kernels with shape-based block sizes.

Block sizes are chosen per launch from the actual sizes (kernels are shape-generic; Triton
specializes on the constexpr block sizes).  With `autotune` (mode="max-autotune") a few
configurations are timed on first use of each (kernel, size class) and the winner is kept in
memory and in `<cache_dir>/triton/autotune.json`.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import linecache
import logging
import os
from collections import OrderedDict
from pathlib import Path
from types import ModuleType
from typing import Any, Callable, Iterator

from torch import Tensor as _Tensor
from torch import dtype as _dtype

from ...config import Config
from ...counters import counters
from ...runtime.cache_artifacts import record_triton_binary
from ...runtime.cache_dir import _private_folder, atomic_write, cache_folder, enforce_limit, touch
from .conventions import conventions as _conventions
from .conventions import launcher_kind as _launcher_kind

log = logging.getLogger("torchfuse")

# Rows up to this many elements are reduced by the persistent kernel (whole row in registers).
PERSISTENT_LIMIT = 32768
LOOPED_RBLOCK = 2048
POINTWISE_XBLOCK = 1024
TILE_BLOCK = 64
COLUMN_XBLOCK = 64     # rows per tile of a looped reduction over column-contiguous data
COLUMN_MIN_XBLOCK = 16
COLUMN_ELEMENTS = 8192  # elements per tile and step of that loop (XBLOCK x RBLOCK)
COLUMN_WARPS = 16
TILE_ELEMENTS = 4096
ROW_TILE_XBLOCK = 256    # widest row a scatter's row tile covers (a .v8 bf16 atomic per lane x 32)
ROW_TILE_ELEMENTS = 1024  # a scatter's row tile: 8 elements a thread of 4 warps (row_tile_blocks)
ROW_TILE_WARPS = 4

_modules: "OrderedDict[str, ModuleType]" = OrderedDict()   # LRU, bounded by config.memory_cache_size
_autotune_modules: dict[str, bool] = {}
_tuned: dict[str, tuple[int, int]] = {}
_tuned_path: Path | None = None
_TUNED_LIMIT = 4096


def ensure_interpreter_if_cpu(device_type: str) -> None:
    """Triton runs CPU tensors only under its interpreter (read when a kernel is defined)."""
    if device_type == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")


def load_module(source: str, config: Config) -> ModuleType:
    """Import generated Triton source (Triton's JIT needs a real file to read the source from)."""
    global _tuned_path
    key = hashlib.sha256(source.encode()).hexdigest()[:32]
    if key in _modules:
        counters.bump("cache_hits_memory")
        _modules.move_to_end(key)
        module = _modules[key]
        # the same source compiled again under other options: its launches follow the newest
        _autotune_modules[module.__name__] = module._tf_autotune = config.autotune
        return module
    try:
        folder = cache_folder(config, "triton")
        folder.mkdir(parents=True, exist_ok=True)
    except OSError:
        folder = _private_folder() / "triton"
        folder.mkdir(exist_ok=True)
    if config.autotune and _tuned_path is None:
        _tuned_path = folder / "autotune.json"
        _tuned.update(_read_tuned(_tuned_path))
    path = folder / f"tf_{key}.py"
    try:
        stored = path.read_text() == source    # a truncated or altered file is written again
    except (OSError, ValueError):              # (missing, unreadable, not text)
        stored = False
    if stored:
        counters.bump("cache_hits_disk")
        log.debug("torchfuse: Triton module loaded from the disk cache: %s", path)
        touch(path)
    else:
        try:
            atomic_write(path, source.encode())
        except OSError as e:        # read-only, full disk, quota: this process writes privately
            log.warning("torchfuse: cannot write the Triton module to %s (%s); using a private folder",
                        folder, e)
            path = _private_folder() / "triton" / path.name
            path.parent.mkdir(exist_ok=True)
            atomic_write(path, source.encode())
        counters.bump("kernel_builds")
        enforce_limit(config)
    # Run the source we generated, never what the file holds now, and no bytecode cache (a torn
    # or stale __pycache__ entry would load): Triton reads a kernel's source through linecache,
    # which is pinned to the same text (an entry without mtime is never re-read from disk).
    module = ModuleType(f"torchfuse_triton_{key}")
    module.__file__ = str(path)
    linecache.cache[str(path)] = (len(source), None, source.splitlines(True), str(path))
    exec(compile(source, str(path), "exec"), module.__dict__)
    module._tf_autotune = config.autotune
    _modules[key] = module
    _autotune_modules[module.__name__] = config.autotune
    while len(_modules) > max(1, config.memory_cache_size):
        _, old = _modules.popitem(last=False)
        _autotune_modules.pop(old.__name__, None)
        linecache.cache.pop(old.__file__, None)
    return module


def forget_modules() -> None:
    """Drop every loaded module from memory (the next load reads the disk cache), with the
    bookkeeping keyed by module."""
    for module in _modules.values():
        linecache.cache.pop(module.__file__, None)
    _modules.clear()
    _autotune_modules.clear()


def _read_tuned(path: Path) -> dict[str, tuple[int, ...]]:
    """The stored autotuning winners; a damaged file or entry is ignored (tuned again)."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(data, dict):
        return {}
    return {k: tuple(v) for k, v in data.items()
            if isinstance(v, list) and v and all(isinstance(i, int) and not isinstance(i, bool) and 0 < i <= 4096
                                                 for i in v)}


def _next_pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


def _autotune(kernel: Any, key: str, candidates: list[tuple[int, ...]], launch) -> tuple[int, ...]:
    """Time each candidate (block sizes..., warps) once per key; remember the fastest."""
    if key in _tuned and len(_tuned[key]) == len(candidates[0]):
        return _tuned[key]
    from triton.testing import do_bench
    best, best_ms = candidates[0], float("inf")
    for cand in candidates:
        try:
            ms = do_bench(lambda: launch(*cand), warmup=5, rep=20)
        except Exception:      # a configuration that does not compile (registers) is skipped
            continue
        if ms < best_ms:
            best, best_ms = cand, ms
    _tuned[key] = best
    while len(_tuned) > _TUNED_LIMIT:          # bounded: dynamic shapes under max-autotune add keys
        del _tuned[next(iter(_tuned))]
    if _tuned_path is not None:
        try:
            atomic_write(_tuned_path, json.dumps(_tuned).encode())
        except OSError:
            pass
    return best


def _tuning(kernel: Any) -> bool:
    """Autotune this kernel's launches?  Never one that does not compute the same when run again
    (atomics, in-place updates: codegen marks them `_tf_no_tune`)."""
    return _autotune_modules.get(kernel.fn.__module__, False) and not getattr(kernel, "_tf_no_tune", False)


# --------------------------------------------------------------------------------------------
# the lean launch path
# --------------------------------------------------------------------------------------------
# `kernel[grid](...)` re-binds and re-specializes every argument in Python on every call (~10-20 us).
# After the first launch of a specialization we call a launcher of the compiled binary directly:
# torch's static CUDA launcher (Inductor's) where this torch has one and the binary allows it,
# else Triton's own C launcher (the ways of calling them: conventions.py).  Their calling
# conventions change between releases, so a direct launcher is only used after it reproduced
# the slow launch bit for bit once; otherwise that kernel keeps the slow path.  (H200, Triton 3.6: kernel[grid] 13.2 us a launch, a bound direct
# launcher 5.5 us, of which cuLaunchKernel ~4.4; benchmarks/probes/launch_micro.py.)


def _spec_key(args: tuple) -> tuple:
    """What Triton specializes on: pointer dtype and 16-byte alignment; ints equal to 1, divisible
    by 16, or past 32 bits.  (Flat and branchy on purpose: it runs on every launch.)"""
    key = []
    for a in args:
        if type(a) is int:
            key.append(1 if a == 1 else 16 if a % 16 == 0 else 2 if -2147483648 <= a < 2147483648 else 3)
        elif isinstance(a, _Tensor):
            key.append(a.dtype)
            key.append(a.data_ptr() % 16 == 0)
        else:
            key.append(a if type(a) is bool else type(a))
    return tuple(key)


def _same(a: Any, b: Any) -> bool:
    import torch
    if a.dtype.is_floating_point:
        return bool(((a == b) | ((a != a) & (b != b))).all())
    return torch.equal(a, b)


def _pointer(a: Any) -> Any:
    return a.data_ptr() if isinstance(a, _Tensor) else a


# A calling convention verified on one binary holds for every binary with the same kind of
# launcher (they come from one Triton): a kernel whose arguments are too large to snapshot twice
# adopts it unverified, so the first call's peak memory is not two copies of the largest kernel.
_VERIFY_BYTES = 16 << 20
_trusted: dict[tuple, set[str]] = {}    # per kind of launcher: the conventions verified


def _snapshot(args: tuple) -> list | None:
    """Copies of the tensor arguments before a first launch, when they are small enough to verify
    a calling convention on (None otherwise)."""
    tensors = [a for a in args if isinstance(a, _Tensor)]
    if sum(t.numel() * t.element_size() for t in tensors) > _VERIFY_BYTES:
        return None
    return [t.clone() for t in tensors]


def _make_fast(binary: Any, args: tuple, constexprs: tuple, grid: tuple, before: list | None) -> Any:
    """A direct launcher for this binary (`fast(grid, args)`, with `fast.bind(grid, tail, n_args)`
    for a call site whose launch never changes), False if none works, or None to decide later.

    With `before` (the tensor arguments as they were before the launch just made through
    Triton's `kernel[grid](...)`), the first calling convention that reproduces that launch bit
    for bit, starting from the same inputs (so a kernel writing in place is verified too).
    Without it, the convention already verified for this kind of launcher, if any."""
    import torch
    if not all(hasattr(binary, a) for a in ("run", "function", "packed_metadata")):
        return False
    tensors = [a for a in args if isinstance(a, _Tensor)]
    device = tensors[0].device.index if tensors else torch.cuda.current_device()
    kind = _launcher_kind(binary)
    conventions = [(name, bind) for name, bind in _conventions(binary, constexprs, device) if bind is not None]

    def fast_for(bind: Callable) -> Callable:
        def fast(grid: tuple, args: tuple, bind: Callable = bind) -> None:
            bind(grid, (), len(args))(*map(_pointer, args))
        fast.bind = bind
        return fast

    if before is None:
        if kind not in _trusted:
            _verify_on_probe(device)
        trusted = _trusted.get(kind, ())
        return next((fast_for(bind) for name, bind in conventions if name in trusted), None)
    torch.cuda.synchronize()
    expected = [t.clone() for t in tensors]
    pointers = tuple(_pointer(a) for a in args)
    chosen = None
    for name, bind in conventions:
        # only what a launch wrote is put back, through `.data`: a copy_ into a tensor bumps its
        # version counter, and autograd refuses a backward whose saved input (token ids) was bumped
        for t, b in zip(tensors, before):
            if not _same(t, b):
                t.data.copy_(b)
        try:
            bind(grid, (), len(pointers))(*pointers)
            torch.cuda.synchronize()
        except Exception:
            continue
        if all(_same(t, e) for t, e in zip(tensors, expected)):
            _trusted.setdefault(kind, set()).add(name)
            chosen = chosen or fast_for(bind)
            # torch's launcher does not take every binary (scratch memory, hooks): one of
            # Triton's own is verified too, for those
            if name != "static":
                break
    for t, e in zip(tensors, expected):    # undo whatever a wrong convention wrote
        if not _same(t, e):
            t.data.copy_(e)
    return False if chosen is None else chosen


_probed: set[int] = set()


def probe_launch(dtype: Any = None) -> tuple:
    """The probe kernel's launch as (kernel, grid, args, constexprs, warps, names); with `dtype`,
    tensors replaced by it (as precompile plans launches)."""
    import torch

    from . import launch_probe as lp
    if dtype is None:
        x = torch.randn(lp.ARGS_N, device="cuda")
        tensors = (x, torch.zeros_like(x))
    else:
        tensors = (dtype, dtype)
    return (lp.probe, (1, 1, 1), (*tensors, lp.ARGS_N, lp.ARGS_STEP), (lp.XBLOCK, lp.BIG), 4, ("XBLOCK", "BIG"))


def _verify_on_probe(device: int) -> None:
    """Trust a calling convention verified on the probe kernel (launch_probe.py), once per device,
    for a kernel too large to verify on.  Not while a CUDA graph is being captured (the
    verification synchronizes); the kernel then waits for a later launch."""
    import torch
    if device in _probed or torch.cuda.is_current_stream_capturing():
        return
    _probed.add(device)
    try:
        with torch.cuda.device(device):
            kernel, grid, args, constexprs, warps, names = probe_launch()
            before = [a.clone() for a in args if isinstance(a, _Tensor)]     # 8 KB: always copied
            binary = kernel[grid](*args, **dict(zip(names, constexprs)), num_warps=warps)
            if not _make_fast(binary, args, constexprs, grid, before):
                log.debug("torchfuse: no direct launcher reproduced the probe kernel's launch")
    except Exception as e:       # launches keep Triton's own path
        log.debug("torchfuse: launch probe failed: %s: %s", type(e).__name__, e)


_hook: Any = None     # set by launch_hook(): planned launches go there instead of to the GPU


@contextlib.contextmanager
def launch_hook(fn: Any) -> Iterator[None]:
    """Within the block, every launch calls `fn(kernel, grid, args, constexprs, warps, names)`
    instead of running (triton_precompile.py plans a graph's launches this way)."""
    global _hook
    old, _hook = _hook, fn
    try:
        yield
    finally:
        _hook = old


def _launch(kernel: Any, grid: tuple, args: tuple, constexprs: tuple, warps: int,
            names: tuple[str, ...] = ("XBLOCK", "RBLOCK", "BIG")) -> Any:
    """Launch; return the direct launcher used for it (None or False if there is none)."""
    if _hook is not None:
        _hook(kernel, grid, args, constexprs, warps, names)
        return None
    # the table lives on the kernel object, so it dies with it (an id() key could be reused)
    table = kernel.__dict__.get("_tf_fast")
    if table is None:
        if os.environ.get("TRITON_INTERPRET") == "1":
            kernel[grid](*args, **dict(zip(names, constexprs)), num_warps=warps)
            return None
        table = kernel.__dict__.setdefault("_tf_fast", {})
    key = (constexprs, warps, _spec_key(args))
    fast = table.get(key)
    if fast:
        fast(grid, args)
        return fast
    # a calling convention is verified (inputs copied, the launch redone, outputs compared) once
    # per kind of launcher, not per kernel: copies of every kernel's arguments made a model's
    # first call hold up to 32 MiB more than its later calls, and synchronized after each kernel
    before = _snapshot(args) if fast is None and (not _trusted or key in table) else None
    binary = kernel[grid](*args, **dict(zip(names, constexprs)), num_warps=warps)
    record_triton_binary(binary)       # (once per binary: torch's portable cache carries it)
    if fast is None:
        table[key] = _make_fast(binary, args, constexprs, grid, before)
    return None       # (this launch went through Triton: a site binds on its next call)


# Per kernel, the launch decision for each size (block sizes, warps, grid, the trailing size
# arguments) is computed once and looked up afterwards: a launch then costs a dict lookup, the
# specialization key and the binary's launcher.  Bounded: dynamic shapes see many sizes.
_PLANS_LIMIT = 1024


def _plans(kernel: Any) -> dict:
    plans = kernel.__dict__.get("_tf_plans")
    if plans is None or len(plans) >= _PLANS_LIMIT:
        plans = kernel.__dict__["_tf_plans"] = {}
    return plans


def _run(plan: tuple, args: tuple) -> tuple[Any, tuple]:
    kernel, grid, tail, constexprs, warps, names = plan
    return _launch(kernel, grid, args + tail, constexprs, warps, names), plan


# Sizes that are symbols of a dynamic graph (`sym`, one flag per size the helper takes, from the
# generated code) choose block sizes that do not depend on their value: every block size, warp
# count and persistent/looped choice is part of Triton's compile key, and a choice made from the
# value compiled the kernel again for a new batch size (resnet18 training on an H100: 54 Triton
# compiles at the second new batch, 34 at the third).  A symbolic dim is taken as large (the
# block sizes that values above a few thousand all get), except a reduction's row length, below.
_LARGE = 1 << 20


def _pointwise_plan(kernel: Any, xnumel: int, big: bool, args: tuple, sym: tuple = ()) -> tuple:
    def plan(xblock: int, warps: int) -> tuple:
        return (kernel, ((xnumel + xblock - 1) // xblock, 1, 1), (xnumel, 1), (xblock, 1, big), warps,
                ("XBLOCK", "RBLOCK", "BIG"))

    xblock = min(POINTWISE_XBLOCK, _next_pow2(_LARGE if sym and sym[0] else xnumel))
    warps = 4 if xblock >= 512 else 2
    if _tuning(kernel) and xnumel >= 4096:
        key = f"{kernel.fn.__name__}:{kernel.fn.__module__}:{_next_pow2(xnumel)}"
        xblock, warps = _autotune(kernel, key, [(b, w) for b in (512, 1024, 2048, 4096) for w in (4, 8)],
                                  lambda *cand: _run(plan(*cand), args))
    return plan(xblock, warps)


def launch_pointwise(kernel: Any, xnumel: int, big: bool, *args: Any, sym: tuple = ()) -> Any:
    plans = kernel.__dict__.get("_tf_plans") or _plans(kernel)
    plan = plans.get((xnumel, big))
    if plan is None:
        if xnumel == 0:
            return
        plan = plans[(xnumel, big)] = _pointwise_plan(kernel, xnumel, big, args, sym)
    return _run(plan, args)


def tile_blocks(xnumel: int, ynumel: int, itemsize: int = 4) -> tuple[int, int, int]:
    """(XBLOCK, YBLOCK, warps) of a 2-D tiled pointwise kernel: 16 KB tiles, 64x64 of fp32 (the
    usual transpose tile, staged through shared memory) or 128x64 of 2-byte dtypes with 8
    warps, stretched along the other dim when one dim is short.  (bf16 [64, 1024, 1000]
    permute + add: 64x64 was 0.95x Inductor, 128x64 1.07x; fp32 the same either way;
    probes/long_rows.py.)"""
    elements = TILE_ELEMENTS * 2 if itemsize <= 2 else TILE_ELEMENTS
    yblock = min(TILE_BLOCK, _next_pow2(ynumel))
    xblock = min(_next_pow2(xnumel), max(TILE_BLOCK, elements // yblock))
    yblock = min(_next_pow2(ynumel), max(yblock, elements // xblock))
    return xblock, yblock, _tile_warps(xblock * yblock)


def row_tile_blocks(xnumel: int, ynumel: int, itemsize: int = 4) -> tuple[int, int, int]:
    """(XBLOCK, YBLOCK, warps) of a scatter's row tile (codegen.scatter_tile): a whole row of up
    to ROW_TILE_XBLOCK elements along x, so each row's index is read by one tile only, and rows
    along y up to ROW_TILE_ELEMENTS, 4 warps.  Atomics wait on memory: many small tiles in flight
    beat long loops per thread.  (H200, 1M edges into 100k nodes, probes/scatter_tiles.py: 47-wide
    rows in 64 x 64 tiles, the 16 KB tiles of tile_blocks, took 0.30 ms fp32 / 0.88 ms bf16 against
    Inductor's 0.24 / 0.55; 1024-element tiles 0.24 / 0.46.  256-wide rows, 1024 elements against
    the 16 KB tiles: 0.99-1.05x fp32, 0.92-0.99x bf16, within the probe's noise.)  `itemsize` is
    unused: the signature is tile_blocks', which _tiled_plan calls the same way."""
    xblock = min(_next_pow2(xnumel), ROW_TILE_XBLOCK)
    yblock = max(1, min(_next_pow2(ynumel), ROW_TILE_ELEMENTS // xblock))
    return xblock, yblock, ROW_TILE_WARPS


def _tile_warps(tile: int) -> int:
    return 8 if tile >= 8192 else 4 if tile >= 2048 else 2


def _tiled_plan(kernel: Any, xnumel: int, ynumel: int, numel: int, big: bool, args: tuple,
                sym: tuple = (), rows: bool = False) -> tuple:
    others = numel // (xnumel * ynumel)

    def plan(xblock: int, yblock: int, warps: int) -> tuple:
        tiles = -(-xnumel // xblock) * -(-ynumel // yblock) * others
        return (kernel, (tiles, 1, 1), (xnumel, ynumel), (xblock, yblock, big), warps, ("XBLOCK", "YBLOCK", "BIG"))

    # The widest element sets the tile (a bf16 input written as fp32 keeps 16 KB of fp32).
    # Precompile plans with dtypes in place of tensors; the plan it makes is the one kept.
    itemsize = max((a.element_size() if isinstance(a, _Tensor) else a.itemsize
                    for a in args if isinstance(a, (_Tensor, _dtype))), default=4)
    blocks = row_tile_blocks if rows else tile_blocks
    xblock, yblock, warps = blocks(_LARGE if sym and sym[0] else xnumel, _LARGE if sym and sym[1] else ynumel,
                                   itemsize)
    if _tuning(kernel) and numel >= 4096:
        key = f"{kernel.fn.__name__}:{kernel.fn.__module__}:{_next_pow2(xnumel)}:{_next_pow2(ynumel)}"
        cands = [(x, y, w) for x, y in ((32, 32), (64, 64), (128, 32), (32, 128), (64, 32), (32, 64))
                 for w in (4, 8)]
        xblock, yblock, warps = _autotune(kernel, key, cands, lambda *cand: _run(plan(*cand), args))
    return plan(xblock, yblock, warps)


def launch_tiled(kernel: Any, xnumel: int, ynumel: int, numel: int, big: bool, *args: Any, sym: tuple = (),
                 rows: bool = False) -> Any:
    """A [YBLOCK, XBLOCK] tile per program; x tiles vary fastest, then y tiles, then the other dims
    (`rows`: a scatter's row tile, row_tile_blocks)."""
    plans = kernel.__dict__.get("_tf_plans") or _plans(kernel)
    plan = plans.get((xnumel, ynumel, numel, big))
    if plan is None:
        if numel == 0:
            return
        plan = plans[(xnumel, ynumel, numel, big)] = _tiled_plan(kernel, xnumel, ynumel, numel, big, args, sym, rows)
    return _run(plan, args)


_sms: list[int] = []


def _sm_count() -> int:
    """The GPU's SM count (132 on an H100; 128 without a GPU, under the interpreter)."""
    if not _sms:
        import torch
        ok = torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1"
        _sms.append(torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count
                    if ok else 128)
    return _sms[0]


def _looped_plan(looped: Any, xnumel: int, rnumel: int, big: bool) -> tuple:
    return looped, (xnumel, 1, 1), (xnumel, rnumel), (1, LOOPED_RBLOCK, big), 16, ("XBLOCK", "RBLOCK", "BIG")


def _row_block(persistent: Any, rnumel: int) -> int:
    """A reduction over rows of symbolic length keeps the persistent row block of the first length
    it ran at (0: rows too long, looped), as Inductor picks block sizes from the size hint: longer
    rows later take the looped kernel, shorter ones are masked.  Two binaries at most, whatever
    the sizes; the graph's precompile builds both."""
    rblock = persistent.__dict__.get("_tf_row_block")
    if rblock is None:
        rblock = persistent.__dict__["_tf_row_block"] = _next_pow2(max(rnumel, 1)) if rnumel <= PERSISTENT_LIMIT else 0
    return rblock


def _reduction_plan(persistent: Any, looped: Any, xnumel: int, rnumel: int, big: bool, xfast: bool,
                    args: tuple, sym: tuple = ()) -> tuple:
    tail = (xnumel, rnumel)
    rows_sym, row_sym = (tuple(sym) + (False, False))[:2]
    xsize = _LARGE if rows_sym else xnumel     # what the block sizes see (see _pointwise_plan)
    # Column sums (rows contiguous across each other, e.g. a layer norm's weight gradient over
    # [2048, 768]): a persistent tile of one row per program would read one element per 32-byte
    # sector (49 us for 6 MB on the H100).  Tiles of several rows walk the reduced dim in a loop
    # instead: as many rows per tile as keeps a program per SM, but at least COLUMN_MIN_XBLOCK
    # (whole sectors) and at most COLUMN_XBLOCK.  Short reduced dims keep the persistent kernel,
    # whose tile then already holds 2048 // rblock >= 32 rows.
    # 64 columns (128 bytes of bf16 per row) and 8192 elements per step with 16 warps, from
    # probes/column_tile.py on the H100: 32 columns x 2048 elements with 8 warps kept too few
    # bytes in flight for tall inputs (bf16 [32768, 768], [8M, 8]); 8 warps at 8192 elements
    # lost on wide inputs ([4096, 50257]).
    if xfast and xsize >= 2 and (row_sym or rnumel > 64):
        per_sm = max(1, xsize // _sm_count())
        xblock = min(COLUMN_XBLOCK, _next_pow2(xsize), max(COLUMN_MIN_XBLOCK, 1 << (per_sm.bit_length() - 1)))
        return (looped, ((xnumel + xblock - 1) // xblock, 1, 1), tail, (xblock, COLUMN_ELEMENTS // xblock, big),
                COLUMN_WARPS, ("XBLOCK", "RBLOCK", "BIG"))
    if row_sym:
        rblock = _row_block(persistent, rnumel)
        if rnumel > rblock:
            return _looped_plan(looped, xnumel, rnumel, big)
    elif rnumel > PERSISTENT_LIMIT:
        return _looped_plan(looped, xnumel, rnumel, big)
    else:
        rblock = _next_pow2(max(rnumel, 1))

    def plan(xblock: int, warps: int) -> tuple:
        return (persistent, ((xnumel + xblock - 1) // xblock, 1, 1), tail, (xblock, rblock, big), warps,
                ("XBLOCK", "RBLOCK", "BIG"))

    # Measured with mode="max-autotune" on an H100 (BENCHMARKS.md): tiles of ~2048 elements
    # (XBLOCK 1-2 for 1000-wide rows) with ~16 elements per thread win for rows <= 1024;
    # longer rows want one row per program and 8-16 warps; rows of 32768 want 32 warps (32
    # elements per thread: fp32 cross entropy, bf16 softmax; at 16384 32 warps lost 20% on
    # bf16 layer norm, so 16 stay there).
    xblock = max(1, min(_next_pow2(xsize), 2048 // rblock, 64))
    warps = min(32 if xblock * rblock >= 32768 else 16, max(1, xblock * rblock // 512))
    if _tuning(persistent):
        key = f"{persistent.fn.__name__}:{persistent.fn.__module__}:{rblock}:{_next_pow2(xsize)}"
        cands = [(x, w) for x in (1, 2, 4, 8, 16, 32, 64) for w in (1, 2, 4, 8, 16, 32)
                 if x <= _next_pow2(xsize) and 256 <= x * rblock <= 32768 and x * rblock // (32 * w) in range(2, 65)]
        xblock, warps = _autotune(persistent, key, cands or [(xblock, warps)], lambda *cand: _run(plan(*cand), args))
    return plan(xblock, warps)


def launch_reduction(persistent: Any, looped: Any, xnumel: int, rnumel: int, big: bool, *args: Any,
                     xfast: bool = False, sym: tuple = ()) -> Any:
    """`xfast`: the input is contiguous across rows (column sums), so long rows are walked by the
    looped kernel with several rows per tile (XBLOCK x RBLOCK = 2048) instead of one row."""
    plans = persistent.__dict__.get("_tf_plans") or _plans(persistent)
    plan = plans.get((xnumel, rnumel, big, xfast))
    if plan is None:
        if xnumel == 0:
            return
        plan = plans[(xnumel, rnumel, big, xfast)] = _reduction_plan(persistent, looped, xnumel, rnumel, big, xfast,
                                                                       args, sym)
        if _hook is not None and plan[0] is persistent and len(sym) > 1 and sym[1]:
            # planning a graph's launches: its rows may later be longer than this row block
            _run(_looped_plan(looped, xnumel, rnumel, big), args)
    return _run(plan, args)


# --------------------------------------------------------------------------------------------
# call sites: the wrapper's launches after the first
# --------------------------------------------------------------------------------------------
# Each kernel call in a generated wrapper gets its own site function.  A site keeps, per shape
# class (the values of its size and symbol arguments: every int the kernel takes), the direct
# launcher bound to that class's grid, size arguments and block sizes.  A launch of a known class
# with 16-byte-aligned pointers costs one dict lookup, one data_ptr() per buffer and the bound
# launcher: no argument binding, no specialization key, no plan lookup.  That is also the whole of
# Triton's specialization check: the ints are the key itself (== 1, divisible by 16), the
# pointers' alignment is tested, and the buffers' dtypes are those the wrapper was generated for
# (Dynamo's guards hold its callers to them).  Anything else (a new class, a misaligned view,
# the first call, the interpreter) takes the launch helper above, which also compiles; a new
# class is bound on its next launch.  A call with a misaligned pointer (a view at an odd offset:
# Triton compiles another binary for it) is a class of its own, keyed by which pointers are
# aligned: before, it took the helper on every call (16 of a decode step's launches, ~2x the
# host time of a bound launch).  Dynamic shapes bring a new class per size: at most
# _SITE_CLASSES are kept per site.
_SITE_CLASSES = 64

_SITE_SOURCE = """
def make(helper, kernels, helper_kwargs, limit):
    bound = {{}}

    def slow(site_key, *call):
        launched = helper(*kernels, *call, **helper_kwargs)
        if launched is not None and launched[0]:
            fast, (_, grid, tail, _, _, _) = launched
            if len(bound) >= limit:
                bound.clear()
            bound[site_key] = fast.bind(grid, tail, {n_args})

    def site({params}):
        {pointers} = {data_ptrs}
        if not ({bits}) & 15:
            key = ({keys})
        else:
            key = (({keys}), {aligned})
        go = bound.get(key)
        if go is not None:
            go({go_args})
        else:
            slow(key, {params})
    site._tf_bound = bound
    return site
"""
_site_factories: dict[tuple[int, int, int], Callable] = {}


def make_site(helper: Callable, kernels: tuple, n_sizes: int, n_buffers: int, n_symbols: int,
              **helper_kwargs: Any) -> Callable:
    """A call site for `helper(*kernels, *sizes, *buffers, *symbols, **helper_kwargs)`
    (launch_pointwise / launch_tiled / launch_reduction), called as
    `site(*sizes, *buffers, *symbols)`; `site._tf_bound` holds its bound launchers by class."""
    shape = (n_sizes, n_buffers, n_symbols)
    factory = _site_factories.get(shape)
    if factory is None:
        if n_buffers < 1:
            raise ValueError("a Triton kernel takes at least one buffer")
        sizes = [f"z{i}" for i in range(n_sizes)]
        buffers = [f"b{i}" for i in range(n_buffers)]
        symbols = [f"y{i}" for i in range(n_symbols)]
        pointers = [f"p{i}" for i in range(n_buffers)]
        keys = sizes + symbols
        source = _SITE_SOURCE.format(
            params=", ".join(sizes + buffers + symbols), pointers="".join(p + ", " for p in pointers),
            data_ptrs="".join(f"{b}.data_ptr(), " for b in buffers), keys="".join(k + ", " for k in keys),
            bits=" | ".join(pointers), go_args=", ".join(pointers + symbols), n_args=n_buffers + n_symbols,
            aligned="".join(f"not {p} & 15, " for p in pointers))
        scope: dict[str, Any] = {}
        exec(compile(source, f"<torchfuse launch site {shape}>", "exec"), scope)
        factory = _site_factories[shape] = scope["make"]
    return factory(helper, tuple(kernels), helper_kwargs, _SITE_CLASSES)
