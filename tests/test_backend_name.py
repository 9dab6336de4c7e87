"""`import torchfuse` makes backend="torchfuse" usable even where no installed entry point names it
(a source checkout on PYTHONPATH, as in a benchmark's fresh child process)."""
from __future__ import annotations

import os
import subprocess
import sys

SRC = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src")

CHILD = r"""
import importlib.metadata as md
real = md.entry_points
def no_torchfuse(**kw):         # as if torchfuse were not pip-installed
    eps = real(**kw)
    return md.EntryPoints([ep for ep in eps if ep.name != "torchfuse"]) if kw.get("group") == "torch_dynamo_backends" else eps
md.entry_points = no_torchfuse
import torch, torchfuse
x = torch.randn(5, 7)[:, ::2]
f = torch.compile(lambda t: (t * 2).sin().sum(-1), backend="torchfuse", options={"strict": True})
torch.testing.assert_close(f(x), (x * 2).sin().sum(-1))
assert torchfuse.counters["graphs_compiled"] + torchfuse.counters.get("graph_cache_hits", 0) >= 1, dict(torchfuse.counters)
print("ok")
"""


def test_backend_name_without_entry_point(tmp_path):
    env = dict(os.environ, PYTHONPATH=SRC + os.pathsep + os.environ.get("PYTHONPATH", ""),
               TORCHFUSE_CACHE_DIR=str(tmp_path))
    out = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-3000:]
