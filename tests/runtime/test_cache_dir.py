"""Trust before load (runtime/cache_dir.py): compiled code is loaded only from a cache directory
of the current user that nobody else can write to; any other gets one warning and a private
folder, and a library planted there is never opened."""
from __future__ import annotations

import ctypes
import os
import stat
import warnings

import pytest
import torch

import torchfuse
from torchfuse.runtime import cache_dir
from torchfuse.backends.cpp import build as cpp_build

pytestmark = pytest.mark.skipif(not hasattr(os, "getuid"), reason="POSIX owners and modes")


@pytest.fixture(autouse=True)
def _fresh_checks(monkeypatch):
    monkeypatch.setattr(cache_dir, "_checked", {})
    monkeypatch.setattr(cpp_build, "_memory", type(cpp_build._memory)())   # no library loaded in memory


def _opened_libraries(monkeypatch) -> list[str]:
    opened: list[str] = []
    real = ctypes.CDLL

    def recording(name, *args, **kwargs):
        opened.append(str(name))
        return real(name, *args, **kwargs)
    monkeypatch.setattr(ctypes, "CDLL", recording)
    return opened


def _compile_and_check(root, **options):
    fn = lambda x: torch.sigmoid(x) * 3 - x  # noqa: E731
    x = torch.randn(41, 3)
    e = torchfuse.explain(fn, x, options={"cache_dir": root, "graph_cache": False, **options})
    torch.testing.assert_close(e.output, fn(x))


@pytest.mark.parametrize("mode, group_ok", [(0o777, False), (0o775, False), (0o1777, False)])
def test_writable_by_others_is_refused(tmp_path, monkeypatch, mode, group_ok):
    root = tmp_path / "shared"
    (root / "cpp").mkdir(parents=True)
    planted = root / "cpp" / "planted.so"
    planted.write_bytes(b"not a library")
    root.chmod(mode)
    opened = _opened_libraries(monkeypatch)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _compile_and_check(root, cache_group_writable=group_ok)
        _compile_and_check(root, cache_group_writable=group_ok)
    said = [str(w.message) for w in caught if "not loading compiled code" in str(w.message)]
    assert len(said) == 1 and str(root) in said[0] and "chmod go-w" in said[0], said
    assert opened and not any(p.startswith(str(root)) for p in opened), opened
    assert not any(p.is_file() and p.suffix == ".so" for p in (root / "cpp").rglob("*") if p != planted)


def test_group_writable_with_opt_in_is_used(tmp_path, monkeypatch):
    root = tmp_path / "team"
    root.mkdir()
    root.chmod(0o770)
    opened = _opened_libraries(monkeypatch)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        _compile_and_check(root, cache_group_writable=True)
    assert any(p.startswith(str(root / "cpp")) for p in opened), opened


def test_someone_elses_folder_is_refused(tmp_path, monkeypatch):
    monkeypatch.setattr(os, "getuid", lambda: os.stat(tmp_path).st_uid + 1)   # as if another user ran
    assert "belongs to user id" in cache_dir.untrusted_because(tmp_path, False)


def test_own_private_folder_is_used_and_new_folders_are_0700(tmp_path, monkeypatch):
    root = tmp_path / "mine"
    opened = _opened_libraries(monkeypatch)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        _compile_and_check(root)
    assert any(p.startswith(str(root / "cpp")) for p in opened), opened
    for folder in (root, root / "cpp"):
        assert stat.S_IMODE(folder.stat().st_mode) & 0o077 == 0, oct(folder.stat().st_mode)


def _cpp_bytes(root) -> int:
    return sum(p.stat().st_size for p in (root / "cpp").rglob("*") if p.suffix in (".so", ".json"))


def _distinct_functions(n: int):
    return [(lambda k: (lambda x: torch.tanh(x * (k + 1.5)) + k))(k) for k in range(n)]


def test_cache_stays_under_its_limit(tmp_path, monkeypatch):
    """Eight distinct kernels into a cache bounded at about three of them: it ends under the
    bound, the newest entry is kept, and every result is eager's."""
    monkeypatch.setattr(cache_dir, "_MEASURE_EVERY_S", 0.0)
    root = tmp_path / "bounded"
    x = torch.randn(33, 4)
    fns = _distinct_functions(8)
    torchfuse.explain(fns[0], x, options={"cache_dir": root, "graph_cache": False})
    one = _cpp_bytes(root)
    limit = 3 * one + one // 2
    for fn in fns:
        e = torchfuse.explain(fn, x, options={"cache_dir": root, "graph_cache": False, "cache_max_bytes": limit})
        torch.testing.assert_close(e.output, fn(x))
    assert 0 < _cpp_bytes(root) <= limit, (_cpp_bytes(root), limit)
    newest = max((root / "cpp").rglob("*.json"), key=lambda p: p.stat().st_mtime)
    assert newest.with_suffix(".so").exists()


def test_entry_being_built_is_never_evicted(tmp_path):
    import filelock
    root = tmp_path / "c"
    x = torch.randn(9, 4)
    for fn in _distinct_functions(2):
        torchfuse.explain(fn, x, options={"cache_dir": root, "graph_cache": False})
    metas = sorted((root / "cpp").rglob("*.json"))
    held = filelock.FileLock(str(metas[0].with_suffix(".lock")))
    with held:
        config = torchfuse.Config.from_options({"cache_dir": root, "cache_max_bytes": 1})
        cache_dir.enforce_limit(config, force=True)
    assert metas[0].exists() and metas[0].with_suffix(".so").exists()
    assert not metas[1].exists() and not metas[1].with_suffix(".so").exists()


def test_two_processes_evicting_one_cache(tmp_path):
    """Two processes compile different kernels into one small cache at once: both give eager's
    results (a library evicted under a loader is rebuilt, never loaded torn)."""
    import subprocess
    import sys
    child = (
        "import sys, torch, torchfuse\n"
        "from torchfuse.runtime import cache_dir\n"
        "cache_dir._MEASURE_EVERY_S = 0.0\n"
        "off = int(sys.argv[1])\n"
        "x = torch.randn(17, 3)\n"
        "for k in range(6):\n"
        "    fn = lambda x, k=k: torch.sigmoid(x * (k + off + 0.25)) - k\n"
        "    e = torchfuse.explain(fn, x, options={'graph_cache': False, 'cache_max_bytes': 60000})\n"
        "    torch.testing.assert_close(e.output, fn(x))\n"
        "print('ok')\n")
    env = dict(os.environ, TORCHFUSE_CACHE_DIR=str(tmp_path / "shared"))
    procs = [subprocess.Popen([sys.executable, "-c", child, str(off)], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for off in (0, 100)]
    for p in procs:
        out, err = p.communicate(timeout=300)
        assert p.returncode == 0 and "ok" in out, err[-3000:]


def test_world_writable_cache_warns_once_for_all_its_folders(tmp_path):
    """Libraries, Triton modules and graphs each have a sub-folder: one warning names the
    directory, not one per sub-folder (the graph cache on made two)."""
    root = tmp_path / "shared"
    root.mkdir()
    root.chmod(0o777)
    x = torch.randn(7, 5)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch._dynamo.reset()
        f = torch.compile(lambda a: torch.softmax(a * 3, -1), backend="torchfuse", options={"cache_dir": root})
        torch.testing.assert_close(f(x), torch.softmax(x * 3, -1))
    said = [str(w.message) for w in caught if "not loading compiled code" in str(w.message)]
    assert len(said) == 1 and str(root) in said[0], said
