"""The Triton module cache (src/torchfuse/backends/triton/launch.py): its disk bound, and its faults: a truncated or
altered module file, a killed writer's leftover, a read-only folder, a full disk and a damaged
autotuning file are detected and worked around; the kernels run the source torchfuse generated,
never what a file holds, and results equal eager's.

The kernels run on CPU tensors under Triton's interpreter, as in tests/codegen."""
from __future__ import annotations

import errno
import os
import stat
from pathlib import Path

import pytest
import torch

os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

from torchfuse.counters import counters  # noqa: E402
from torchfuse.backends.triton import launch as triton_launch  # noqa: E402


def _fn(x: torch.Tensor) -> torch.Tensor:
    return (x * 3).sigmoid() + x.cos()


def _run(cache: Path, **options) -> None:
    """Compile `_fn` afresh (no in-memory module) with its cache in `cache`; equal to eager."""
    triton_launch.forget_modules()
    torch._dynamo.reset()
    compiled = torch.compile(_fn, backend="torchfuse",
                             options={"cpu_backend": "triton", "cache_dir": str(cache), "graph_cache": False, **options})
    x = torch.randn(7, 33)
    torch.testing.assert_close(compiled(x), _fn(x))


def _modules(cache: Path) -> list[Path]:
    return sorted((cache / "triton").glob("tf_*.py"))


@pytest.fixture
def cache(tmp_path: Path) -> Path:
    _run(tmp_path)
    assert len(_modules(tmp_path)) == 1
    return tmp_path


@pytest.mark.parametrize("damage", ["truncated", "altered", "binary"])
def test_damaged_module_is_written_again_and_never_run(cache: Path, damage: str) -> None:
    path = _modules(cache)[0]
    good = path.read_text()
    marker = cache / "planted-code-ran"
    if damage == "truncated":            # a torn write
        path.write_text(good[: len(good) // 2])
    elif damage == "altered":            # valid Python that is not what torchfuse generated
        path.write_text(f"open({str(marker)!r}, 'w').close()\n" + good)
    else:
        path.write_bytes(b"\xff\xfe\x00garbage")
    builds = counters["kernel_builds"]
    _run(cache)
    assert not marker.exists()
    assert path.read_text() == good
    assert counters["kernel_builds"] == builds + 1


def test_stale_bytecode_is_never_loaded(cache: Path) -> None:
    """Modules run from the generated source: no __pycache__ is written or read."""
    folder = cache / "triton"
    assert not (folder / "__pycache__").exists()
    (folder / "__pycache__").mkdir()
    for name in _modules(cache):
        (folder / "__pycache__" / f"{name.stem}.cpython-311.pyc").write_bytes(b"\x00" * 40)
    hits = counters["cache_hits_disk"]
    _run(cache)
    assert counters["cache_hits_disk"] == hits + 1


def test_killed_writers_leftover_is_ignored(cache: Path) -> None:
    path = _modules(cache)[0]
    leftover = path.parent / "tmpkilled.py.tmp"
    leftover.write_text(path.read_text()[:50])
    path.unlink()                        # the writer died before its rename
    _run(cache)
    assert path.exists()


def test_read_only_folder_falls_back_to_a_private_one(tmp_path: Path) -> None:
    folder = tmp_path / "triton"
    folder.mkdir(parents=True, mode=0o700)
    folder.chmod(stat.S_IRUSR | stat.S_IXUSR)
    try:
        if os.access(folder, os.W_OK):
            pytest.skip("running as a user who can write a read-only folder (root)")
        _run(tmp_path)
        assert not _modules(tmp_path)
    finally:
        folder.chmod(0o700)


def test_full_disk_falls_back_to_a_private_one(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real = os.fdopen
    failed = []

    class Full:
        def __init__(self, f):
            self.f = f

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.f.close()

        def write(self, text):
            failed.append(text)
            raise OSError(errno.ENOSPC, "No space left on device")

    def fdopen(fd, *args, **kwargs):
        f = real(fd, *args, **kwargs)
        return Full(f) if not failed else f

    monkeypatch.setattr(os, "fdopen", fdopen)
    _run(tmp_path)
    assert failed
    assert not list((tmp_path / "triton").glob("*"))       # no module, and no temporary file left


def test_damaged_autotune_file_is_ignored(tmp_path: Path) -> None:
    """A torn file or a bad entry is not a winner (tuned again); an entry of another arity neither."""
    path = tmp_path / "autotune.json"
    path.write_text('{"a": [1, 2], "b": "x", "c": [true], "d": [0], "e": [64, 4]')     # torn
    assert triton_launch._read_tuned(path) == {}
    path.write_text('{"a": [1, 2], "b": "x", "c": [true], "d": [0], "e": [64, 4]}')
    assert triton_launch._read_tuned(path) == {"a": (1, 2), "e": (64, 4)}
    path.write_text('[1, 2]')
    assert triton_launch._read_tuned(path) == {}


def test_unusable_folder_falls_back_to_a_private_one(tmp_path: Path) -> None:
    """A cache whose `triton` entry cannot be a folder (here a file: the same path as a
    read-only folder for root, whom permissions do not stop)."""
    (tmp_path / "triton").write_text("not a folder")
    _run(tmp_path)
    assert (tmp_path / "triton").read_text() == "not a folder"


def test_modules_count_towards_the_disk_bound(tmp_path: Path) -> None:
    """Triton modules are cache entries like libraries and graphs: past `cache_max_bytes` the
    least recently used go, and a program whose module went still runs (it is written again)."""
    from torchfuse.runtime import cache_dir
    funcs = [lambda x, k=k: (x * (k + 2)).sigmoid() + x.cos() * k for k in range(6)]
    x = torch.randn(5, 9)
    for fn in funcs:
        triton_launch.forget_modules()
        cache_dir._last_measured.clear()           # measure after every write, not every few seconds
        torch._dynamo.reset()
        got = torch.compile(fn, backend="torchfuse", options={"cpu_backend": "triton", "cache_dir": str(tmp_path),
                                                              "graph_cache": False, "cache_max_bytes": 6000})(x)
        torch.testing.assert_close(got, fn(x))
        assert sum(p.stat().st_size for p in _modules(tmp_path)) <= 6000
    assert 0 < len(_modules(tmp_path)) < len(funcs)
