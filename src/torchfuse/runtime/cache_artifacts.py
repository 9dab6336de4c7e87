"""torchfuse's entries in torch's portable compile cache ("mega-cache").

    artifacts, info = torch.compiler.save_cache_artifacts()       # after compiling, any process
    torch.compiler.load_cache_artifacts(artifacts)                # a fresh machine or container

`load_cache_artifacts` writes every entry back into its cache, so the next compile there is a warm
start.  torchfuse's entries live in its own cache directory, which torch's artifact types do not
know, so they travel as one artifact type of torchfuse's own, keyed "<kind>/<path>":

- graphs/<key>/<file>: a graph-cache entry (frontend/graph_cache.py).  AOTAutograd records it as
  its own type, whose loader would write it into Inductor's directory, where torchfuse never
  looks; while AOTAutograd runs for torchfuse, that record is redirected here.
- cpp/<xx>/<key>.so and .json: a built C++ kernel library and its checksum sidecar (the loader
  checks one against the other, as for any cache entry).  The key includes the CPU's model and
  flags (-march=native), so a library built elsewhere is carried but only loads on a like CPU.
- triton/<hash>/<file>: the files of a compiled Triton kernel in Triton's cache.  Its group file
  names the others by absolute path; the paths are carried relative and made absolute again in
  the loading process's Triton cache directory.

Registered when torchfuse is imported: import torchfuse before calling `load_cache_artifacts`
(torch's loader knows only the types registered by then, and drops the whole blob otherwise).
Entries go to the default cache directory ($TORCHFUSE_CACHE_DIR, else the default), not to a
`cache_dir` a compile passes in options.  A torch without these interfaces records nothing.
"""
from __future__ import annotations

import hashlib
import logging
import os
import re
from pathlib import Path
from typing import Any

log = logging.getLogger("torchfuse")

TYPE = "torchfuse"
_TRITON_DIR = b"[TORCHFUSE_TRITON_DIR]"     # stands for a kernel's folder in Triton's cache
_PART = re.compile(r"^[A-Za-z0-9_.=-]+$")    # a path component we write (no "..", no separators)
_recorded_binaries: set[str] = set()


def _manager() -> Any:
    try:
        from torch.compiler._cache import CacheArtifactManager
        return CacheArtifactManager
    except ImportError:
        return None


def register() -> bool:
    """Register torchfuse's artifact type with torch's cache (once); False if this torch cannot."""
    try:
        from torch.compiler._cache import CacheArtifact, CacheArtifactFactory
    except ImportError as e:
        log.debug("torchfuse: no portable cache artifacts: %s", e)
        return False
    if TYPE in getattr(CacheArtifactFactory, "_artifact_types", {}):
        return True

    class TorchfuseArtifact(CacheArtifact):
        def populate_cache(self) -> None:
            populate(self.key, self.content)

        @staticmethod
        def type() -> str:
            return TYPE

    CacheArtifactFactory.register(TorchfuseArtifact)
    _serialize_after_builds()
    return True


def _serialize_after_builds() -> None:
    """`save_cache_artifacts()` (torch's CacheArtifactManager.serialize) first waits for the
    kernels torchfuse still builds in the background (Config.first_calls="eager", runtime/tiered.py):
    a library is recorded once built, and one saved right after a compile belongs in the blob."""
    manager = _manager()
    serialize = getattr(manager, "serialize", None)
    if serialize is None or getattr(getattr(serialize, "__func__", None), "_torchfuse_waits", False):
        return

    def after_builds(cls: Any) -> Any:
        from .tiered import wait_compiled
        wait_compiled()
        return serialize()
    after_builds._torchfuse_waits = True  # type: ignore[attr-defined]
    manager.serialize = classmethod(after_builds)


def record(kind: str, path: str, content: bytes) -> None:
    """Add one entry to what `torch.compiler.save_cache_artifacts()` returns (the type is
    registered when torchfuse is imported)."""
    manager = _manager()
    if manager is None:
        return
    try:
        manager.record_artifact(TYPE, f"{kind}/{path}", content)
    except Exception as e:      # torch internals: never let the portable cache fail a compile
        log.debug("torchfuse: cache artifact %s/%s not recorded: %s", kind, path, e)


def record_aot_entry(key: str, content: bytes) -> None:
    """A graph-cache entry, as AOTAutograd writes it (`<dir>/<key>/<file>`)."""
    record("graphs", f"{key}/{hashlib.sha256(content).hexdigest()[:40]}", content)


def record_triton_binary(binary: Any) -> None:
    """The files of a compiled Triton kernel (`CompiledKernel`), once per kernel hash."""
    kernel_hash = getattr(binary, "hash", None)
    if not isinstance(kernel_hash, str) or kernel_hash in _recorded_binaries or _manager() is None:
        return
    _recorded_binaries.add(kernel_hash)
    folder = triton_cache_dir() / kernel_hash
    try:
        files = sorted(p for p in folder.iterdir() if p.is_file() and not p.name.startswith("."))
    except OSError:
        return
    # the group file (read by Triton first) goes last, after the files it names
    for file in sorted(files, key=lambda p: p.name.startswith("__grp__")):
        try:
            data = file.read_bytes()
        except OSError:
            continue
        if file.name.startswith("__grp__"):
            data = data.replace(str(folder).encode(), _TRITON_DIR)
        record("triton", f"{kernel_hash}/{file.name}", data)


def triton_cache_dir() -> Path:
    try:
        from triton import knobs
        return Path(knobs.cache.dir)
    except (ImportError, AttributeError):
        return Path(os.environ.get("TRITON_CACHE_DIR") or Path.home() / ".triton" / "cache")


def populate(key: str, content: bytes) -> None:
    """Write one loaded entry into its cache (torch calls this from `load_cache_artifacts`)."""
    from ..config import Config
    from .cache_dir import GRAPHS, LIBRARIES, TRITON_MODULES, atomic_write, cache_folder
    kind, _, path = key.partition("/")
    parts = path.split("/")
    if not path or not all(_PART.match(p) and p not in (".", "..") for p in parts):
        log.warning("torchfuse: ignoring a cache artifact with an unexpected name: %r", key)
        return
    if kind not in (TRITON_MODULES, GRAPHS, LIBRARIES):
        log.warning("torchfuse: ignoring a cache artifact of unknown kind %r", kind)
        return
    target = None
    try:
        if kind == TRITON_MODULES:
            folder = triton_cache_dir() / parts[0]
            target = folder.joinpath(*parts[1:])
            content = content.replace(_TRITON_DIR, str(folder).encode())
        else:
            target = cache_folder(Config(), kind).joinpath(*parts)
        target.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        atomic_write(target, content)
    except OSError as e:
        log.warning("torchfuse: cannot write the cache artifact %s (%s)", target or key, e)
