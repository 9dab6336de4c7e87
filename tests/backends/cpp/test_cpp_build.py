"""Tests for torchfuse.backends.cpp.build: building, caching and recovering C++ kernel libraries."""
from __future__ import annotations

import ctypes
import errno
import hashlib
import json
import logging
import os
import shutil
import subprocess
import sys
import textwrap
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from torchfuse import Config, counters
from torchfuse.backends.cpp import build as cpp_build
from torchfuse.backends.cpp.build import CompileError, CompilerNotFound, cache_key, clear_memory_cache, load_library

KEYS = ("kernel_builds", "cache_hits_disk", "cache_hits_memory")


def _src(tag: float = 0.0) -> str:
    return f'extern "C" double add(double a, double b) {{ return a + b + {tag!r}; }}\n'


def _add(lib: ctypes.CDLL, a: float, b: float) -> float:
    fn = lib.add
    fn.restype, fn.argtypes = ctypes.c_double, [ctypes.c_double, ctypes.c_double]
    return fn(a, b)


def _snapshot() -> dict[str, int]:
    return {k: counters[k] for k in KEYS}


def _delta(before: dict[str, int]) -> dict[str, int]:
    return {k: counters[k] - before[k] for k in KEYS}


def _entry(cfg: Config, source: str) -> tuple[Path, Path]:
    key = cache_key(source, cfg)
    so = Path(cfg.cache_dir) / "cpp" / key[:2] / f"{key}.so"
    return so, so.with_suffix(".json")


def _assert_valid_entry(so: Path, meta: Path) -> None:
    info = json.loads(meta.read_text())
    data = so.read_bytes()
    assert info["size"] == len(data) and info["sha256"] == hashlib.sha256(data).hexdigest()
    assert not list(so.parent.glob(".*.tmp")), "temp files left behind"


def _replace(path: Path, data: bytes) -> None:
    # Write a new inode: this process may have the old .so mmapped, and scribbling over a loaded
    # library in place would crash the test runner rather than exercise the cache.
    tmp = path.with_name(path.name + ".new")
    tmp.write_bytes(data)
    os.replace(tmp, path)


@pytest.fixture
def cfg(tmp_path: Path):
    clear_memory_cache()
    # A damaged entry warns once per path and process: start each test with none warned.
    cpp_build._logged_invalid.clear()
    yield Config(cache_dir=tmp_path / "cache")
    clear_memory_cache()


def test_build_memory_hit_then_disk_hit(cfg: Config) -> None:
    src = _src(0.25)
    before = _snapshot()
    lib = load_library(src, cfg)
    assert _add(lib, 1.0, 2.0) == 3.25
    assert _delta(before) == {"kernel_builds": 1, "cache_hits_disk": 0, "cache_hits_memory": 0}
    assert _assert_valid_entry(*_entry(cfg, src)) is None

    before = _snapshot()
    assert load_library(src, cfg) is lib
    assert _delta(before) == {"kernel_builds": 0, "cache_hits_disk": 0, "cache_hits_memory": 1}

    clear_memory_cache()
    before = _snapshot()
    assert _add(load_library(src, cfg), 4.0, 5.0) == 9.25
    assert _delta(before) == {"kernel_builds": 0, "cache_hits_disk": 1, "cache_hits_memory": 0}


def test_cache_key_depends_on_source_and_flags(cfg: Config) -> None:
    assert cache_key(_src(), cfg) == cache_key(_src(), cfg)
    assert cache_key(_src(), cfg) != cache_key(_src(1.0), cfg)
    assert cache_key(_src(), cfg) != cache_key(_src(), cfg.replace(cxx_flags=cfg.cxx_flags + ("-g",)))
    assert len(cache_key(_src(), cfg)) == 64


def test_memory_cache_is_bounded(cfg: Config) -> None:
    cfg = cfg.replace(memory_cache_size=1)
    load_library(_src(1.0), cfg)
    load_library(_src(2.0), cfg)  # evicts the first
    before = _snapshot()
    assert _add(load_library(_src(1.0), cfg), 0.0, 0.0) == 1.0
    assert _delta(before) == {"kernel_builds": 0, "cache_hits_disk": 1, "cache_hits_memory": 0}


def _flip(so: Path, meta: Path) -> None:
    data = bytearray(so.read_bytes())
    for i in range(len(data) // 2, len(data) // 2 + 64):
        data[i] ^= 0xFF
    _replace(so, bytes(data))


def _truncate(so: Path, meta: Path) -> None:
    _replace(so, so.read_bytes()[:100])


def _drop_sidecar(so: Path, meta: Path) -> None:
    meta.unlink()


def _garbage_sidecar(so: Path, meta: Path) -> None:
    meta.write_text("{ not json")


def _unloadable(so: Path, meta: Path) -> None:
    # Checksums match, but the bytes are not a shared library: dlopen itself must fail.
    data = b"this is not an ELF file"
    _replace(so, data)
    meta.write_text(json.dumps({"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}))


@pytest.mark.parametrize("damage", [_flip, _truncate, _drop_sidecar, _garbage_sidecar, _unloadable])
def test_damaged_entry_is_detected_and_rebuilt(cfg: Config, damage, caplog) -> None:
    src = _src(0.5)
    so, meta = _entry(cfg, src)
    if damage is _unloadable:
        # Don't load the good library first: glibc would hand back the already-loaded handle
        # for the same path and dlopen of the bad file would never be attempted.
        so.parent.mkdir(parents=True)
        so.write_bytes(b"")
    else:
        load_library(src, cfg)
        clear_memory_cache()
    damage(so, meta)

    before = _snapshot()
    with caplog.at_level(logging.WARNING, logger="torchfuse.runtime"):
        lib = load_library(src, cfg)
    assert _add(lib, 1.0, 1.0) == 2.5
    assert _delta(before)["kernel_builds"] == 1
    assert any("invalid kernel cache entry" in r.getMessage() and r.levelno == logging.WARNING
               for r in caplog.records)
    _assert_valid_entry(so, meta)


def test_killed_writer_leftovers_are_rebuilt(cfg: Config) -> None:
    src = _src(0.75)
    so, meta = _entry(cfg, src)
    so.parent.mkdir(parents=True)
    stray = so.parent / f".{so.name}.abc123.tmp"  # a writer died before os.replace
    stray.write_bytes(b"\x7fELF partial")
    so.write_bytes(b"\x7fELF half a library")     # ... or after the .so but before the sidecar

    before = _snapshot()
    assert _add(load_library(src, cfg), 2.0, 2.0) == 4.75
    assert _delta(before)["kernel_builds"] == 1
    assert not stray.exists()
    _assert_valid_entry(so, meta)


_WORKER = textwrap.dedent(r"""
    import ctypes, pathlib, sys, time
    from torchfuse import Config, counters
    from torchfuse.backends.cpp.build import load_library
    cache, ready, go, src = sys.argv[1:5]
    pathlib.Path(ready).touch()
    deadline = time.time() + 60
    while not pathlib.Path(go).exists() and time.time() < deadline:
        time.sleep(0.002)
    lib = load_library(src, Config(cache_dir=pathlib.Path(cache)))
    lib.add.restype = ctypes.c_double
    lib.add.argtypes = [ctypes.c_double, ctypes.c_double]
    print(lib.add(1.0, 2.0), counters["kernel_builds"])
""")


def test_two_processes_build_same_key_once(cfg: Config, tmp_path: Path) -> None:
    # Headers make the compile slow enough (~0.5 s) that both workers really overlap.
    src = "#include <vector>\n#include <map>\n#include <algorithm>\n#include <string>\n" + _src(0.125)
    go = tmp_path / "go"
    readies = [tmp_path / f"ready{i}" for i in range(2)]
    procs = [subprocess.Popen([sys.executable, "-c", _WORKER, str(cfg.cache_dir), str(r), str(go), src],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in readies]
    try:
        deadline = time.time() + 60
        while not all(r.exists() for r in readies) and time.time() < deadline:
            time.sleep(0.01)
        go.touch()  # release both at once
        outs = [p.communicate(timeout=120) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, err
    results = [out.split() for out, _ in outs]
    assert [float(r[0]) for r in results] == [3.125, 3.125]
    builds = sum(int(r[1]) for r in results)
    assert 1 <= builds <= 2
    assert builds == 1, "the file lock should make the second process wait and reuse the entry"
    _assert_valid_entry(*_entry(cfg, src))


def test_threads_build_same_key_once(cfg: Config) -> None:
    src = _src(0.0625)
    before = _snapshot()
    with ThreadPoolExecutor(4) as pool:
        libs = list(pool.map(lambda _: load_library(src, cfg), range(4)))
    assert all(_add(lib, 1.0, 0.0) == 1.0625 for lib in libs)
    assert _delta(before)["kernel_builds"] == 1


def test_unusable_cache_dir_still_works(tmp_path: Path) -> None:
    # We may run as root, where chmod cannot make a directory unwritable; a path under a regular
    # file fails mkdir for everyone.
    clear_memory_cache()
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("")
    cfg = Config(cache_dir=blocker / "cache")
    before = _snapshot()
    with pytest.warns(RuntimeWarning, match="not usable"):
        lib = load_library(_src(1.5), cfg)
    assert _add(lib, 1.0, 1.0) == 3.5
    assert _delta(before)["kernel_builds"] == 1
    assert load_library(_src(1.5), cfg) is lib  # memory cache still works
    clear_memory_cache()


@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() == 0, reason="root ignores permissions")
def test_read_only_cache_dir_still_works(tmp_path: Path) -> None:
    clear_memory_cache()
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    try:
        with pytest.warns(RuntimeWarning, match="not usable"):
            lib = load_library(_src(2.5), Config(cache_dir=ro))
        assert _add(lib, 0.0, 0.0) == 2.5
    finally:
        ro.chmod(0o700)
        clear_memory_cache()


def test_publish_failure_falls_back_to_private_dir(cfg: Config, monkeypatch) -> None:
    def disk_full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(cpp_build, "_publish", disk_full)
    with pytest.warns(RuntimeWarning, match="No space left"):
        lib = load_library(_src(3.5), cfg)
    assert _add(lib, 0.5, 0.0) == 4.0


def test_missing_compiler_raises_compiler_not_found(cfg: Config) -> None:
    with pytest.raises(CompilerNotFound) as info:
        load_library(_src(), cfg.replace(cxx="definitely-not-a-compiler"))
    msg = str(info.value)
    assert "definitely-not-a-compiler" in msg and "install g++" in msg and "'cxx'" in msg
    assert isinstance(info.value, CompileError)


def test_syntax_error_raises_compile_error_with_stderr(cfg: Config) -> None:
    src = 'extern "C" double broken(double a) { return a +; }\n'
    before = _snapshot()
    with pytest.raises(CompileError) as info:
        load_library(src, cfg)
    assert not isinstance(info.value, CompilerNotFound)
    msg = str(info.value)
    assert "error" in msg and "expected" in msg  # g++'s own diagnostic
    assert cfg.cxx in msg and "-shared" in msg  # the command line
    kept = Path(msg.split("source kept at: ")[1].splitlines()[0])
    try:
        assert kept.read_text() == src
    finally:
        shutil.rmtree(kept.parent, ignore_errors=True)
    assert _delta(before)["kernel_builds"] == 1
    so, meta = _entry(cfg, src)
    assert not so.exists() and not meta.exists()


def test_library_is_closed_once_nothing_uses_it(tmp_path):
    """ctypes never dlcloses: a library nothing refers to any more (no compiled graph, not the
    in-memory LRU) is closed by torchfuse, so a long-running process does not keep every library
    it ever built mapped; while a compiled graph lives its library stays."""
    import gc

    import torch

    import torchfuse
    from torchfuse.backends.cpp import build as cpp_build

    def mapped() -> set[str]:
        with open("/proc/self/maps") as f:
            return {line.split()[-1] for line in f if str(tmp_path) in line}

    fn = lambda x: torch.cos(x) * 7 - 1  # noqa: E731
    x = torch.randn(13, 3)
    compiled = torchfuse.compile(fn, options={"cache_dir": tmp_path, "graph_cache": False})
    torch.testing.assert_close(compiled(x), fn(x))
    cpp_build.clear_memory_cache()
    gc.collect()
    assert mapped(), "the library of a live compiled function must stay loaded"
    torch.testing.assert_close(compiled(x), fn(x))
    del compiled
    torch._dynamo.reset()
    gc.collect()
    assert not mapped(), mapped()
