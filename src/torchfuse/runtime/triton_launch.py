"""Loading generated Triton modules and launching their kernels with shape-based block sizes."""
from __future__ import annotations

import hashlib
import importlib.util
import os
import sys
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


def ensure_interpreter_if_cpu(device_type: str) -> None:
    """Triton runs CPU tensors only under its interpreter, which must be chosen before import."""
    if device_type == "cpu" and "triton" not in sys.modules:
        os.environ.setdefault("TRITON_INTERPRET", "1")


def load_module(source: str, config: Config) -> ModuleType:
    """Import generated Triton source (Triton's JIT needs a real file to read the source from)."""
    key = hashlib.sha256(source.encode()).hexdigest()[:32]
    if key in _modules:
        counters.bump("cache_hits_memory")
        return _modules[key]
    try:
        folder = Path(config.cache_dir) / "triton"
        folder.mkdir(parents=True, exist_ok=True)
    except OSError:
        folder = Path(tempfile.mkdtemp(prefix="torchfuse-triton-"))
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
    _modules[key] = module
    return module


def _next_pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


_INT32_LIMIT = 2 ** 31 - 2 ** 20


def _needs_int64(args: tuple, total: int) -> bool:
    """64-bit index math only when some offset can pass 2**31 (it costs instructions)."""
    if total >= _INT32_LIMIT:
        return True
    for a in args:
        if hasattr(a, "untyped_storage") and a.untyped_storage().nbytes() // max(a.element_size(), 1) >= _INT32_LIMIT:
            return True
    return False


def launch_pointwise(kernel: Any, xnumel: int, *args: Any) -> None:
    if xnumel == 0:
        return
    xblock = min(POINTWISE_XBLOCK, _next_pow2(xnumel))
    grid = ((xnumel + xblock - 1) // xblock,)
    kernel[grid](*args, xnumel, 1, XBLOCK=xblock, RBLOCK=1, BIG=_needs_int64(args, xnumel),
                 num_warps=4 if xblock >= 512 else 2)


def launch_reduction(persistent: Any, looped: Any, xnumel: int, rnumel: int, *args: Any) -> None:
    if xnumel == 0:
        return
    if rnumel <= PERSISTENT_LIMIT:
        rblock = _next_pow2(max(rnumel, 1))
        xblock = max(1, min(_next_pow2(xnumel), 4096 // rblock, 64))
        warps = min(16, max(1, xblock * rblock // 512))   # ~16 fp32 elements of the tile per thread
        grid = ((xnumel + xblock - 1) // xblock,)
        persistent[grid](*args, xnumel, rnumel, XBLOCK=xblock, RBLOCK=rblock, BIG=_needs_int64(args, xnumel * rnumel),
                         num_warps=warps)
    else:
        xblock = 1
        grid = (xnumel,)
        looped[grid](*args, xnumel, rnumel, XBLOCK=xblock, RBLOCK=LOOPED_RBLOCK, BIG=_needs_int64(args, xnumel * rnumel),
                     num_warps=16)
