"""Compile C++ translation units into shared libraries, cached in memory and on disk.

load_library: memory LRU (key -> CDLL) -> disk <cache_dir>/cpp/<key[:2]>/<key>.so + .json -> g++.
The disk cache is shared between processes, so every write is atomic (temp file + fsync +
os.replace) and the JSON sidecar, written after the .so, records the .so's sha256: an entry
without a matching sidecar is treated as absent (a writer died, the disk was full, someone
truncated it) and rebuilt.  Builds of one key are serialised across processes by a file lock.
"""
from __future__ import annotations

import _ctypes
import atexit
import ctypes
import hashlib
import json
import logging
import platform
import shutil
import subprocess
import tempfile
import threading
import warnings
import weakref
from collections import OrderedDict
from contextlib import suppress
from pathlib import Path

import filelock

from ...config import Config
from ...counters import counters
from ...runtime.cache_dir import atomic_write, cache_folder, enforce_limit, touch

__all__ = ["CompileError", "CompilerNotFound", "load_library", "is_built", "cache_key", "clear_memory_cache"]

log = logging.getLogger("torchfuse.runtime")

# Bump when the on-disk layout or sidecar format changes so old entries are simply ignored.
CACHE_FORMAT_VERSION = 1
# A single lock wait longer than this means something is wedged; we then build privately.
_LOCK_TIMEOUT_S = 600.0
_STDERR_LINES = 40


class CompileError(RuntimeError):
    """The C++ compiler ran and rejected the source (or could not be run)."""


class CompilerNotFound(CompileError):
    """`config.cxx` does not exist or cannot be executed."""


_state_lock = threading.Lock()
_compiler_ids: dict[str, str] = {}
_machine: str | None = None


def _compiler_not_found(cxx: str, err: BaseException) -> CompilerNotFound:
    return CompilerNotFound(
        f"torchfuse: C++ compiler {cxx!r} not found or not runnable ({err}). torchfuse's CPU backend "
        f"needs a C++17 compiler with OpenMP: install g++ (e.g. `apt-get install g++`) or point "
        f"torchfuse at one with options={{'cxx': '/path/to/g++'}}.")


def _compiler_id(cxx: str) -> str:
    # `g++ --version` costs a process spawn; the answer cannot change within a process.
    if cxx in _compiler_ids:  # plain dict reads/writes are atomic under the GIL
        return _compiler_ids[cxx]
    try:
        proc = subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as err:
        raise _compiler_not_found(cxx, err) from err
    ident = ((proc.stdout or proc.stderr).strip().splitlines() or [f"{cxx} (unknown version)"])[0]
    _compiler_ids[cxx] = ident
    return ident


def _machine_id() -> str:
    # We compile with -march=native, so a cache dir shared between different CPUs (NFS home,
    # copied container image) must not hand one CPU's binary to another.
    global _machine
    if _machine is None:
        parts = [platform.machine()]
        text = ""
        with suppress(OSError):
            text = Path("/proc/cpuinfo").read_text(errors="replace")
        fields: dict[str, str] = {}
        for line in text.splitlines():
            name, _, value = line.partition(":")
            fields.setdefault(name.strip(), value.strip())
        parts += [f"{k}={fields[k]}" for k in ("model name", "flags", "Features", "CPU part") if k in fields]
        _machine = "\n".join(parts)
    return _machine


def _flags(config: Config) -> list[str]:
    return [*config.cxx_flags, *config.extra_cxx_flags]


def cache_key(source: str, config: Config) -> str:
    """sha256 of everything that determines the built library's bytes."""
    h = hashlib.sha256()
    for part in (f"torchfuse-cpp-v{CACHE_FORMAT_VERSION}", _compiler_id(config.cxx),
                 "\0".join(_flags(config)), _machine_id(), source):
        data = part.encode()
        # Length-prefix every part so no two different inputs concatenate to the same bytes.
        h.update(len(data).to_bytes(8, "little"))
        h.update(data)
    return h.hexdigest()


_memory: OrderedDict[str, ctypes.CDLL] = OrderedDict()


def _open(path: Path) -> ctypes.CDLL:
    """dlopen `path`; the library is dlclosed once nothing refers to it any more (no compiled
    graph's kernel functions, which hold their CDLL, and not the in-memory LRU), so a process
    compiling thousands of graphs does not keep every library mapped (ctypes never closes)."""
    lib = ctypes.CDLL(str(path))
    close = getattr(_ctypes, "dlclose", None)
    if close is not None:
        weakref.finalize(lib, close, lib._handle)
    return lib


def _memory_get(key: str) -> ctypes.CDLL | None:
    with _state_lock:
        if key in _memory:
            _memory.move_to_end(key)
        return _memory.get(key)


def _memory_put(key: str, lib: ctypes.CDLL, capacity: int) -> None:
    # Evicting only drops our reference; kernels holding the CDLL keep it loaded.
    with _state_lock:
        _memory[key] = lib
        _memory.move_to_end(key)
        while len(_memory) > max(capacity, 0):
            _memory.popitem(last=False)


def clear_memory_cache() -> None:
    """Forget loaded libraries (the next load_library goes to disk); mainly for tests."""
    with _state_lock:
        _memory.clear()


_logged_invalid: set[str] = set()
_warned_dirs: set[str] = set()
_private: Path | None = None


def _invalid(so: Path, reason: str, quiet: bool) -> None:
    if quiet:  # unlocked probe: a concurrent writer may be mid-publish, so don't cry wolf
        return
    with _state_lock:
        first = str(so) not in _logged_invalid
        _logged_invalid.add(str(so))
    log.log(logging.WARNING if first else logging.DEBUG,
            "torchfuse: discarding invalid kernel cache entry %s (%s); rebuilding", so, reason)


def _try_load(so: Path, meta: Path, quiet: bool) -> ctypes.CDLL | None:
    """Load a disk entry if it exists and its bytes match its sidecar, else None."""
    if not meta.exists():
        if so.exists():  # a writer died between the .so and the sidecar
            _invalid(so, "missing metadata sidecar", quiet)
        return None
    try:
        sidecar = meta.read_bytes()
        info = json.loads(sidecar)
        data = so.read_bytes()
        ok = (isinstance(info, dict) and info.get("size") == len(data)
              and info.get("sha256") == hashlib.sha256(data).hexdigest())
    except (OSError, ValueError) as err:
        _invalid(so, f"unreadable: {err}", quiet)
        return None
    if not ok:
        _invalid(so, "checksum mismatch (corrupted or truncated)", quiet)
        return None
    try:
        lib = _open(so)
    except OSError as err:
        _invalid(so, f"dlopen failed: {err}", quiet)
        return None
    touch(meta)          # (least recently used entries are the first evicted)
    _record(so, data, meta, sidecar)
    return lib


def _record(so: Path, data: bytes, meta: Path, sidecar: bytes) -> None:
    """Carry the library in torch's portable cache (cache_artifacts.py): the .so, then its
    sidecar, from the bytes already read or written."""
    from ...runtime.cache_artifacts import record
    folder = so.parent.name
    record("cpp", f"{folder}/{so.name}", data)
    record("cpp", f"{folder}/{meta.name}", sidecar)


def _publish(so: Path, meta: Path, data: bytes, key: str, config: Config) -> None:
    # Drop a stale sidecar first so "sidecar present" always implies "the .so it describes".
    with suppress(FileNotFoundError):
        meta.unlink()
    atomic_write(so, data)
    info = {"format": CACHE_FORMAT_VERSION, "key": key, "sha256": hashlib.sha256(data).hexdigest(),
            "size": len(data), "compiler": _compiler_id(config.cxx), "flags": _flags(config)}
    sidecar = json.dumps(info, indent=1).encode()
    atomic_write(meta, sidecar)
    _record(so, data, meta, sidecar)


def _warn_unusable(config: Config, err: BaseException) -> None:
    with _state_lock:
        first = str(config.cache_dir) not in _warned_dirs
        _warned_dirs.add(str(config.cache_dir))
    if first:
        warnings.warn(
            f"torchfuse: kernel cache directory {config.cache_dir} is not usable ({err}); kernels are "
            f"built in a private temporary directory and will be rebuilt in every process. Point "
            f"options={{'cache_dir': ...}} or TORCHFUSE_CACHE_DIR at a writable directory.",
            RuntimeWarning, stacklevel=3)


def _load_private(key: str, data: bytes) -> ctypes.CDLL:
    """Load built bytes from a per-process temp dir (the shared cache is unusable)."""
    global _private
    with _state_lock:
        if _private is None:
            _private = Path(tempfile.mkdtemp(prefix="torchfuse-cpp-private-"))
            atexit.register(shutil.rmtree, _private, True)
        path = _private / f"{key}.so"
    atomic_write(path, data)
    return _open(path)


def _compile(source: str, key: str, config: Config) -> bytes:
    build_dir = Path(tempfile.mkdtemp(prefix="torchfuse-build-"))
    src, out = build_dir / f"{key[:16]}.cpp", build_dir / f"{key[:16]}.so"
    src.write_text(source)
    cmd = [config.cxx, *_flags(config), str(src), "-o", str(out)]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True)
    except OSError as err:
        shutil.rmtree(build_dir, ignore_errors=True)
        raise _compiler_not_found(config.cxx, err) from err
    counters.bump("kernel_builds")
    if proc.returncode != 0 or not out.exists():
        # Keep the build dir (it holds the source) so the failure can be reproduced by hand.
        lines = (proc.stderr or proc.stdout or "").splitlines()
        shown = "\n".join(lines[:_STDERR_LINES] + ([f"... ({len(lines) - _STDERR_LINES} more lines)"]
                                                    if len(lines) > _STDERR_LINES else []))
        raise CompileError(
            f"torchfuse: C++ compilation failed (exit code {proc.returncode}).\n"
            f"command: {subprocess.list2cmdline(cmd)}\n"
            f"compiler output:\n{shown}\n"
            f"source kept at: {src}\n"
            f"If the source was generated by torchfuse this is a torchfuse bug: please report it with "
            f"that file. If your compiler rejects a flag, adjust options={{'extra_cxx_flags': ...}} (or 'cxx_flags') or "
            f"options={{'cxx': ...}}; with strict=False the graph falls back to eager PyTorch.")
    data = out.read_bytes()
    shutil.rmtree(build_dir, ignore_errors=True)
    return data


def _load_or_build(source: str, key: str, config: Config) -> ctypes.CDLL:
    so = cache_folder(config, "cpp") / key[:2] / f"{key}.so"
    meta = so.with_suffix(".json")
    # Fast path without the lock: published entries are immutable and self-checking.
    lib = _try_load(so, meta, quiet=True)
    if lib is not None:
        counters.bump("cache_hits_disk")
        log.debug("torchfuse: C++ library loaded from the disk cache: %s", so)
        return lib
    try:
        so.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        lock = filelock.FileLock(str(so.with_suffix(".lock")), timeout=_LOCK_TIMEOUT_S)
        lock.acquire()
    except OSError as err:  # read-only / missing permissions / not a directory / lock timeout
        _warn_unusable(config, err)
        return _load_private(key, _compile(source, key, config))
    try:
        # Someone else may have built it while we waited for the lock.
        lib = _try_load(so, meta, quiet=False)
        if lib is not None:
            counters.bump("cache_hits_disk")
            log.debug("torchfuse: C++ library loaded from the disk cache (built by another process): %s", so)
            return lib
        # We hold the lock, so any temp file of this key is a leftover of a killed writer.
        for stray in so.parent.glob(f".{key}.*.tmp"):
            with suppress(OSError):
                stray.unlink()
        data = _compile(source, key, config)
        log.debug("torchfuse: C++ library built and stored: %s", so)
        try:
            _publish(so, meta, data, key, config)
        except OSError as err:  # disk full, quota, filesystem went read-only...
            _warn_unusable(config, err)
            return _load_private(key, data)
        lib = _open(so)
    finally:
        lock.release()
    enforce_limit(config)      # a new entry: keep the cache under its bound
    return lib


def is_built(source: str, config: Config) -> bool:
    """Whether `load_library(source, config)` would find the library loaded or on disk (its
    .so and sidecar are there; `load_library` still checks them) rather than run the compiler."""
    key = cache_key(source, config)
    if _memory_get(key) is not None:
        return True
    so = cache_folder(config, "cpp") / key[:2] / f"{key}.so"
    return so.exists() and so.with_suffix(".json").exists()


def load_library(source: str, config: Config) -> ctypes.CDLL:
    """Build (or fetch from cache) the C++ translation unit `source` and load it.

    Raises CompilerNotFound if `config.cxx` cannot be run, CompileError if it rejects `source`.
    """
    key = cache_key(source, config)
    lib = _memory_get(key)
    if lib is not None:
        counters.bump("cache_hits_memory")
        log.debug("torchfuse: C++ library %s found in memory", key)
        return lib
    lib = _load_or_build(source, key, config)
    _memory_put(key, lib, config.memory_cache_size)
    return lib
