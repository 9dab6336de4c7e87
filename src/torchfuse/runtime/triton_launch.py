"""Loading generated Triton modules and launching their kernels with shape-based block sizes.

Block sizes are chosen per launch from the actual sizes (kernels are shape-generic; Triton
specializes on the constexpr block sizes).  With `autotune` (mode="max-autotune") a few
configurations are timed on first use of each (kernel, size class) and the winner is kept in
memory and in `<cache_dir>/triton/autotune.json`.
"""
from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import tempfile
from pathlib import Path
from types import ModuleType
from typing import Any

from ..config import Config
from ..counters import counters

# Rows up to this many elements are reduced by the persistent kernel (whole row in registers).
PERSISTENT_LIMIT = 32768
LOOPED_RBLOCK = 2048
POINTWISE_XBLOCK = 1024

_modules: dict[str, ModuleType] = {}
_autotune_modules: dict[str, bool] = {}
_tuned: dict[str, tuple[int, int]] = {}
_tuned_path: Path | None = None


def ensure_interpreter_if_cpu(device_type: str) -> None:
    """Triton runs CPU tensors only under its interpreter, which must be chosen before import."""
    import sys
    if device_type == "cpu" and "triton" not in sys.modules:
        os.environ.setdefault("TRITON_INTERPRET", "1")


def load_module(source: str, config: Config) -> ModuleType:
    """Import generated Triton source (Triton's JIT needs a real file to read the source from)."""
    global _tuned_path
    key = hashlib.sha256(source.encode()).hexdigest()[:32]
    if key in _modules:
        counters.bump("cache_hits_memory")
        return _modules[key]
    try:
        folder = Path(config.cache_dir) / "triton"
        folder.mkdir(parents=True, exist_ok=True)
    except OSError:
        folder = Path(tempfile.mkdtemp(prefix="torchfuse-triton-"))
    if config.autotune and _tuned_path is None:
        _tuned_path = folder / "autotune.json"
        try:
            _tuned.update({k: tuple(v) for k, v in json.loads(_tuned_path.read_text()).items()})
        except (OSError, ValueError):
            pass
    path = folder / f"tf_{key}.py"
    if not path.exists() or path.read_text() != source:
        fd, tmp = tempfile.mkstemp(dir=folder, suffix=".py.tmp")
        with os.fdopen(fd, "w") as f:
            f.write(source)
        os.replace(tmp, path)           # atomic: a concurrent reader never sees half a file
        counters.bump("kernel_builds")
    else:
        counters.bump("cache_hits_disk")
    spec = importlib.util.spec_from_file_location(f"torchfuse_triton_{key}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)     # type: ignore[union-attr]
    module._tf_autotune = config.autotune
    _modules[key] = module
    _autotune_modules[module.__name__] = config.autotune
    return module


def _next_pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


def _autotune(kernel: Any, key: str, candidates: list[tuple[int, int]], launch) -> tuple[int, int]:
    """Time each (block, warps) candidate once per key; remember the fastest."""
    if key in _tuned:
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
    if _tuned_path is not None:
        try:
            tmp = _tuned_path.with_suffix(".tmp")
            tmp.write_text(json.dumps(_tuned))
            os.replace(tmp, _tuned_path)
        except OSError:
            pass
    return best


def _tuning(kernel: Any) -> bool:
    return _autotune_modules.get(kernel.fn.__module__, False)


def launch_pointwise(kernel: Any, xnumel: int, big: bool, *args: Any) -> None:
    if xnumel == 0:
        return

    def go(xblock: int, warps: int) -> None:
        kernel[((xnumel + xblock - 1) // xblock,)](*args, xnumel, 1, XBLOCK=xblock, RBLOCK=1, BIG=big,
                                                    num_warps=warps)

    xblock = min(POINTWISE_XBLOCK, _next_pow2(xnumel))
    warps = 4 if xblock >= 512 else 2
    if _tuning(kernel) and xnumel >= 4096:
        key = f"{kernel.fn.__name__}:{kernel.fn.__module__}:{_next_pow2(xnumel)}"
        xblock, warps = _autotune(kernel, key, [(b, w) for b in (512, 1024, 2048, 4096) for w in (4, 8)], go)
    go(xblock, warps)


def launch_reduction(persistent: Any, looped: Any, xnumel: int, rnumel: int, big: bool, *args: Any) -> None:
    if xnumel == 0:
        return
    if rnumel <= PERSISTENT_LIMIT:
        rblock = _next_pow2(max(rnumel, 1))

        def go(xblock: int, warps: int) -> None:
            persistent[((xnumel + xblock - 1) // xblock,)](*args, xnumel, rnumel, XBLOCK=xblock, RBLOCK=rblock,
                                                            BIG=big, num_warps=warps)

        xblock = max(1, min(_next_pow2(xnumel), 4096 // rblock, 64))
        warps = min(16, max(1, xblock * rblock // 512))   # ~16 fp32 elements of the tile per thread
        if _tuning(persistent):
            key = f"{persistent.fn.__name__}:{persistent.fn.__module__}:{rblock}:{min(_next_pow2(xnumel), 4096)}"
            cands = [(x, w) for x in (1, 2, 4, 8, 16, 32, 64) for w in (1, 2, 4, 8, 16)
                     if x <= _next_pow2(xnumel) and 256 <= x * rblock <= 32768 and x * rblock // (32 * w) in range(2, 65)]
            xblock, warps = _autotune(persistent, key, cands or [(xblock, warps)], go)
        go(xblock, warps)
    else:
        looped[(xnumel,)](*args, xnumel, rnumel, XBLOCK=1, RBLOCK=LOOPED_RBLOCK, BIG=big, num_warps=16)
