"""`python -m torchfuse` (torchfuse/cli.py): env, cache show / clear, explain module:factory, bench."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from torchfuse import cli


def _run(*args: str, cache=None, cwd=None) -> subprocess.CompletedProcess:
    env = dict(os.environ, **({"TORCHFUSE_CACHE_DIR": str(cache)} if cache else {}))
    return subprocess.run([sys.executable, "-m", "torchfuse", *args], capture_output=True, text=True, env=env,
                          cwd=cwd, timeout=300)


def test_env_names_versions_and_the_cache(tmp_path):
    out = _run("env", cache=tmp_path)
    assert out.returncode == 0, out.stderr
    assert f"torch       {torch.__version__}" in out.stdout and str(tmp_path) in out.stdout, out.stdout


def test_cache_show_and_clear(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("TORCHFUSE_CACHE_DIR", str(tmp_path))
    (tmp_path / "cpp" / "ab").mkdir(parents=True)
    (tmp_path / "cpp" / "ab" / "k.so").write_bytes(b"x" * 2048)
    (tmp_path / "graphs").mkdir()
    (tmp_path / "graphs" / "entry").write_bytes(b"y" * 10)
    (tmp_path / "mine.txt").write_text("not torchfuse's")
    assert cli.main(["cache", "show"]) == 0
    shown = capsys.readouterr().out
    assert "cpp          1 files    2.0 KiB" in shown and "graphs       1 files" in shown, shown
    assert cli.main(["cache", "clear", "--yes"]) == 0
    assert not (tmp_path / "cpp").exists() and not (tmp_path / "graphs").exists()
    assert (tmp_path / "mine.txt").exists()        # only torchfuse's own folders go


def test_explain_a_factory(tmp_path):
    (tmp_path / "my_model.py").write_text(
        "import torch\n"
        "def make():\n"
        "    m = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.LayerNorm(16))\n"
        "    return m, (torch.randn(4, 8),)\n")
    out = _run("explain", "my_model:make", cache=tmp_path / "cache", cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "kernel" in out.stdout and "graph" in out.stdout, out.stdout
    bad = _run("explain", "my_model", cwd=tmp_path)
    assert bad.returncode != 0 and "module:function" in bad.stderr


def test_bench_lists_and_runs_the_checkouts_benchmarks(capsys):
    if cli.benchmarks_dir() is None:
        pytest.skip("not a source checkout")
    assert cli.main(["bench"]) == 0
    listed = capsys.readouterr().out.split()
    assert {"zoo", "cpu_bench", "lazy_bench", "compile_bench"} <= set(listed), listed
    out = _run("bench", "lazy_bench", "--help")
    assert out.returncode == 0 and "--quick" in out.stdout, out.stderr[-2000:]
    bad = _run("bench", "no_such_bench")
    assert bad.returncode != 0 and "no benchmark 'no_such_bench'" in bad.stderr


def test_cache_clear_without_a_terminal(tmp_path):
    """No one to confirm on (a script, CI): a clear message and nothing removed, no EOFError
    traceback; -y clears without asking."""
    (tmp_path / "cpp").mkdir()
    (tmp_path / "cpp" / "k.so").write_bytes(b"x" * 64)
    env = dict(os.environ, TORCHFUSE_CACHE_DIR=str(tmp_path))
    out = subprocess.run([sys.executable, "-m", "torchfuse", "cache", "clear"], capture_output=True, text=True,
                         env=env, stdin=subprocess.DEVNULL, timeout=300)
    assert out.returncode == 1 and "Traceback" not in out.stderr and "--yes" in out.stderr, out.stderr
    assert (tmp_path / "cpp" / "k.so").exists()
    out = subprocess.run([sys.executable, "-m", "torchfuse", "cache", "clear", "-y"], capture_output=True,
                         text=True, env=env, stdin=subprocess.DEVNULL, timeout=300)
    assert out.returncode == 0 and not (tmp_path / "cpp").exists(), out.stderr


def test_explain_inference(tmp_path):
    (tmp_path / "my_model.py").write_text(
        "import torch\n"
        "def make():\n"
        "    m = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.LayerNorm(16))\n"
        "    return m, (torch.randn(4, 8),)\n")
    out = _run("explain", "my_model:make", "--inference", cache=tmp_path / "cache", cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "inference" in out.stdout and "backward" not in out.stdout, out.stdout
    train = _run("explain", "my_model:make", cache=tmp_path / "cache", cwd=tmp_path)
    assert "backward" in train.stdout, train.stdout
