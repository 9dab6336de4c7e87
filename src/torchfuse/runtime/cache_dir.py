"""Where compiled code is cached, and whether it may be loaded from there.

torchfuse loads code from its cache directory (C++ libraries, Triton modules, compiled graphs):
whoever can write there can run code in this process.  So a cache folder is used only when it
belongs to the current user and nobody else can write to it (group-writable only with
`Config.cache_group_writable`, for a team's shared folder); anything else gets one warning naming
the folder and the fix, and this process caches in a private temporary folder instead.  Folders
torchfuse creates are 0700.
"""
from __future__ import annotations

import atexit
import contextlib
import os
import shutil
import stat
import tempfile
import threading
import warnings
from pathlib import Path

from ..config import Config

_lock = threading.Lock()
_checked: dict[tuple[str, bool], Path] = {}     # (folder, group ok) -> the folder to use
_private: Path | None = None
_warned: set[tuple[str, bool]] = set()           # cache directories refused (one warning each)


def untrusted_because(folder: Path, group_ok: bool) -> str | None:
    """Why code must not be loaded from `folder` (None: it may)."""
    if not hasattr(os, "getuid"):           # no POSIX owners (Windows): nothing to check
        return None
    st = folder.stat()
    if st.st_uid != os.getuid():
        return f"it belongs to user id {st.st_uid}, not to you ({os.getuid()})"
    if st.st_mode & stat.S_IWOTH:
        return "anyone can write to it"
    if st.st_mode & stat.S_IWGRP and not group_ok:
        return "its group can write to it (options={'cache_group_writable': True} allows that)"
    return None


def _private_folder() -> Path:
    global _private
    if _private is None:
        _private = Path(tempfile.mkdtemp(prefix="torchfuse-private-cache-"))     # 0700
        atexit.register(shutil.rmtree, _private, True)
    return _private


def atomic_write(path: Path, data: bytes) -> None:
    """Write a cache entry: readers see the old file or the whole new one, never a prefix (a
    temporary file renamed over it, removed if the write fails); a new inode also keeps any
    process that already mmapped an old library safe."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)  # mkstemp makes 0600; the cache may be shared by a group
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def cache_folder(config: Config, name: str) -> Path:
    """`<cache_dir>/<name>`, created 0700, if it and the cache directory may be trusted; else (one
    warning per folder) `<a private temporary folder>/<name>`.  An unwritable cache directory is
    returned as is: the caller's own error handling reports it."""
    root = Path(config.cache_dir)
    key = (str(root / name), config.cache_group_writable)
    with _lock:
        if key in _checked:
            return _checked[key]
        folder = root / name
        try:
            root.mkdir(parents=True, exist_ok=True, mode=0o700)
            folder.mkdir(exist_ok=True, mode=0o700)
        except OSError:
            _checked[key] = folder
            return folder
        reason = untrusted_because(root, config.cache_group_writable) or \
            untrusted_because(folder, config.cache_group_writable)
        if reason is not None and (str(root), config.cache_group_writable) not in _warned:
            # once per directory, not once per sub-folder (libraries, Triton modules, graphs)
            _warned.add((str(root), config.cache_group_writable))
            warnings.warn(f"torchfuse: not loading compiled code from the cache directory {root}: {reason}. "
                          f"This process caches in a private folder instead. Fix: point TORCHFUSE_CACHE_DIR "
                          f"(or options={{'cache_dir': ...}}) at a folder of your own, or `chmod go-w {root}`.",
                          RuntimeWarning, stacklevel=3)
        if reason is not None:
            folder = _private_folder() / name
            folder.mkdir(exist_ok=True, mode=0o700)
        _checked[key] = folder
        return folder


# --- a bounded cache on disk -----------------------------------------------------------------
# Entries: a C++ library (<key>.so with its <key>.json sidecar, under cpp/), a Triton module
# (triton/tf_<key>.py) or a compiled graph (a folder under graphs/).  Each load of a library or
# module refreshes its mtime (`touch`), so the oldest mtime is the least recently used (for a
# graph: the least recently written).  A module may go at any time: modules run from the source
# in memory, and a loader that finds none writes it again.  After this process adds an entry, the cache is
# measured (at most every few seconds) and, when over `Config.cache_max_bytes`, the least
# recently used entries go until it is under 80% of it.  A library is removed only under its
# build lock (held by a process building it) and sidecar first, so a loader sees a whole entry
# or none: a half-removed one fails its checksum and is rebuilt, never loaded.

_MEASURE_EVERY_S = 5.0
_last_measured: dict[str, float] = {}


def touch(path: Path) -> None:
    """Mark a cache entry as just used."""
    try:
        os.utime(path)
    except OSError:
        pass


# The cache's folders: built C++ libraries (each with a JSON sidecar and a build lock), Triton
# modules and binaries, compiled graphs.
LIBRARIES, TRITON_MODULES, GRAPHS = "cpp", "triton", "graphs"


def _entries(root: Path) -> list[tuple[float, int, str, Path]]:
    """(last use, bytes, kind, what to remove) for every entry under `root`."""
    out = []
    for meta in (root / LIBRARIES).glob("*/*.json"):
        so = meta.with_suffix(".so")
        try:
            out.append((meta.stat().st_mtime, meta.stat().st_size + (so.stat().st_size if so.exists() else 0),
                        LIBRARIES, meta))
        except OSError:
            continue
    for module in (root / TRITON_MODULES).glob("tf_*.py"):
        try:
            st = module.stat()
            out.append((st.st_mtime, st.st_size, TRITON_MODULES, module))
        except OSError:
            continue
    graphs = root / "graphs"
    if graphs.is_dir():
        for entry in graphs.iterdir():
            try:
                size = sum(p.stat().st_size for p in entry.rglob("*") if p.is_file()) if entry.is_dir() \
                    else entry.stat().st_size
                out.append((entry.stat().st_mtime, size, "graphs", entry))
            except OSError:
                continue
    return out


def _remove(kind: str, path: Path) -> bool:
    import filelock
    if kind == LIBRARIES:
        lock = filelock.FileLock(str(path.with_suffix(".lock")), timeout=0)
        try:
            lock.acquire()
        except (filelock.Timeout, OSError):
            return False                       # being built or read right now: keep it
        try:
            path.unlink(missing_ok=True)        # the sidecar first: no sidecar, no load
            path.with_suffix(".so").unlink(missing_ok=True)
        except OSError:
            return False
        finally:
            lock.release()
        return True
    shutil.rmtree(path, ignore_errors=True) if path.is_dir() else path.unlink(missing_ok=True)
    return True


def enforce_limit(config: Config, force: bool = False) -> int:
    """Evict least recently used entries while the cache is over `cache_max_bytes`; returns the
    bytes it holds after.  Measures at most every few seconds per process unless `force`."""
    import time
    limit = config.cache_max_bytes
    root = Path(config.cache_dir)
    now = time.monotonic()
    if limit <= 0 or (not force and now - _last_measured.get(str(root), -1e9) < _MEASURE_EVERY_S):
        return -1
    _last_measured[str(root)] = now
    entries = sorted(_entries(root))
    total = sum(size for _, size, _, _ in entries)
    if total <= limit:
        return total
    for _, size, kind, path in entries:
        if total <= 0.8 * limit:
            break
        if _remove(kind, path):
            total -= size
    return total
