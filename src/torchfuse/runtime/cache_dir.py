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
        if reason is not None:
            warnings.warn(f"torchfuse: not loading compiled code from the cache directory {root}: {reason}. "
                          f"This process caches in a private folder instead. Fix: point TORCHFUSE_CACHE_DIR "
                          f"(or options={{'cache_dir': ...}}) at a folder of your own, or `chmod go-w {root}`.",
                          RuntimeWarning, stacklevel=3)
            folder = _private_folder() / name
            folder.mkdir(exist_ok=True, mode=0o700)
        _checked[key] = folder
        return folder
