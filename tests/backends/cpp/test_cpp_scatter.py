"""The C++ scatter kernels on one thread (backends/cpp/scatter.py): what is fused into a scatter
(a GAT edge's score, its exp, its softmax weight) is computed in vector loops, a block of
elements or rows at a time, before the scalar updates.  Values must stay those of eager for
colliding indices, block remainders and out-of-range rows."""
import re
import shutil
import subprocess

import pytest
import torch

import torchfuse
from torchfuse.backends.cpp.codegen import translation_unit
from torchfuse.config import Config

from tests.lowering.test_scatter import gat_layer

pytestmark = pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++")


@pytest.fixture
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _serial_vectorized_lines(source: str, name: str, tmp_path) -> tuple[int, set[int]]:
    """(loops g++ vectorized inside the kernel's one-thread branch, their lines)."""
    unit = translation_unit([source])
    path = tmp_path / "k.cpp"
    path.write_text(unit)
    cfg = Config()
    out = subprocess.run([cfg.cxx, *cfg.cxx_flags, "-fopt-info-vec-optimized", str(path), "-o", str(tmp_path / "k.so")],
                         capture_output=True, text=True, check=True)
    lines = unit.splitlines()
    first = next(k for k, line in enumerate(lines, 1) if "omp_get_max_threads() == 1" in line
                 and k > unit[:unit.index(f" {name}(")].count("\n"))
    last = next(k for k, line in enumerate(lines, 1) if k > first and line.lstrip().startswith("} else"))
    hits = {int(m.group(1)) for m in re.finditer(r"k\.cpp:(\d+):\d+: optimized: loop vectorized", out.stderr)}
    return len({k for k in hits if first < k < last}), hits


@pytest.mark.parametrize("nodes,edges", [(37, 211), (5, 64), (300, 1000)])
def test_gat_layer_one_thread(tf, one_thread, nodes, edges, tmp_path):
    x = tf.rand((nodes, 24))
    src, dst = torch.randint(0, nodes, (edges,)), torch.randint(0, nodes, (edges,))   # colliding
    args = (x, src, dst, tf.rand((24, 17)) / 4, tf.rand((17,)), tf.rand((17,)))
    e = tf.check(gat_layer, *args, kernels=5, allow_fallbacks={"aten.mm.default"}, atol=1e-4, rtol=1e-4)
    scatters = [k for k in e.kernels if "omp_get_max_threads() == 1" in k.source]
    assert len(scatters) == 3, [k.name for k in e.kernels]
    for k in scatters:
        # the amax, the softmax sum and the messages: each stages its values in a vector loop
        count, _ = _serial_vectorized_lines(k.source, k.name, tmp_path)
        assert count >= 1, f"{k.name}: nothing vectorized on one thread\n{k.source}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_flat_scatters_with_out_of_range_rows_skipped(tf, one_thread, dtype):
    """index_put with a mask (`skip`): rows not written stage nothing and update nothing; amax
    and sum of a fused exp over 130 elements (two blocks and a remainder)."""
    x, v = tf.rand((11,), dtype), tf.rand((130,), dtype)
    idx = torch.randint(-11, 11, (130,))

    def fn(x, v, idx):
        return (x.scatter_reduce(0, idx % 11, v.exp(), "amax"),
                torch.index_put(x, (idx,), (v * 0.5).sin(), accumulate=True))
    tol = (2e-2, 2e-2) if dtype == torch.bfloat16 else (1e-5, 1e-5)
    tf.check(fn, x, v, idx, atol=tol[0], rtol=tol[1])
