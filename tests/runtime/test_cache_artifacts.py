"""torchfuse's artifact type in torch's portable cache (runtime/cache_artifacts.py): a compiled
Triton kernel's files travel with their group file's paths made relative, and land in the loading
process's Triton cache; names that could escape the cache directory are refused.  (Graphs and
C++ libraries end to end: tests/frontend/test_graph_cache.py.)"""
from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
from torch.compiler._cache import CacheArtifactManager

from torchfuse.runtime import cache_artifacts


def _saved(record) -> bytes:
    with CacheArtifactManager.with_fresh_cache():
        record()
        return CacheArtifactManager.serialize()[0]


def _load(blob: bytes) -> None:
    CacheArtifactManager.populate_caches(CacheArtifactManager.deserialize(blob))


def test_a_triton_binary_lands_in_the_loading_processes_cache(tmp_path, monkeypatch):
    here, there = tmp_path / "here", tmp_path / "there"
    folder = here / "HASH123"
    folder.mkdir(parents=True)
    (folder / "poi_0.cubin").write_bytes(b"\x7fELF binary")
    (folder / "poi_0.json").write_text(json.dumps({"name": "poi_0"}))
    (folder / "__grp__poi_0.json").write_text(json.dumps({"child_paths": {
        "poi_0.cubin": str(folder / "poi_0.cubin"), "poi_0.json": str(folder / "poi_0.json")}}))
    monkeypatch.setattr(cache_artifacts, "triton_cache_dir", lambda: here)
    monkeypatch.setattr(cache_artifacts, "_recorded_binaries", set())
    blob = _saved(lambda: cache_artifacts.record_triton_binary(SimpleNamespace(hash="HASH123")))
    assert str(here).encode() not in blob            # no path of this machine travels
    monkeypatch.setattr(cache_artifacts, "triton_cache_dir", lambda: there)
    _load(blob)
    moved = there / "HASH123"
    assert (moved / "poi_0.cubin").read_bytes() == b"\x7fELF binary"
    group = json.loads((moved / "__grp__poi_0.json").read_text())
    assert group["child_paths"] == {"poi_0.cubin": str(moved / "poi_0.cubin"), "poi_0.json": str(moved / "poi_0.json")}


def test_a_binary_is_recorded_once(tmp_path, monkeypatch):
    (tmp_path / "H").mkdir()
    (tmp_path / "H" / "k.cubin").write_bytes(b"x")
    monkeypatch.setattr(cache_artifacts, "triton_cache_dir", lambda: tmp_path)
    monkeypatch.setattr(cache_artifacts, "_recorded_binaries", set())
    seen = []
    monkeypatch.setattr(cache_artifacts, "record", lambda kind, path, content: seen.append(path))
    for _ in range(3):
        cache_artifacts.record_triton_binary(SimpleNamespace(hash="H"))
    cache_artifacts.record_triton_binary(object())       # not a compiled kernel (the interpreter's)
    assert seen == ["H/k.cubin"]


@pytest.mark.parametrize("key", ["cpp/../escape.so", "cpp//abs.so", "graphs/a/../../x", "cpp/", "other/x",
                                 "triton/h/sub dir/x"])
def test_names_that_leave_the_cache_are_refused(tmp_path, monkeypatch, key):
    monkeypatch.setenv("TORCHFUSE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(cache_artifacts, "triton_cache_dir", lambda: tmp_path / "triton")
    cache_artifacts.populate(key, b"data")
    assert not (tmp_path / "escape.so").exists() and not (tmp_path / "x").exists()
    written = [p for p in tmp_path.rglob("*") if p.is_file()]
    assert written == [], written
