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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int32])
@pytest.mark.parametrize("threads", ["one", "parallel"])
def test_amax_amin_updates_keep_eager_semantics(tf, dtype, threads):
    """The branch-free read-modify-write of amax and amin (tf_max_sel / tf_min_sel): NaN wins
    wherever it comes, in the values or in `self`; +-inf and colliding indices; one thread (the
    staged blocks) and the compare-and-swap of the parallel loop (parallel_threshold 1)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1 if threads == "one" else max(before, 2))
    try:
        x, v = tf.rand((17,), dtype), tf.rand((150,), dtype)
        if dtype.is_floating_point:
            v[::7], v[3::11], v[5::13] = float("nan"), float("inf"), float("-inf")
            x[2] = float("nan")
        idx = torch.randint(0, 17, (150,))

        def fn(x, v, i):
            return x.scatter_reduce(0, i, v * 2, "amax"), x.scatter_reduce(0, i, v - 1, "amin", include_self=False)
        opts = {"parallel_threshold": 1} if threads == "parallel" else {}
        tol = (2e-2, 2e-2) if dtype == torch.bfloat16 else (None, None)
        tf.check(fn, x, v, idx, options=opts, atol=tol[0], rtol=tol[1])
    finally:
        torch.set_num_threads(before)


def _messages_max_and_sum(x, y, src, dst):
    """Per edge and feature a message read by two scatters over [edges, features]: stored by the
    first one's loop (its prologue, computed per element in its row loop)."""
    msg = (x[src] * y).sin()
    out = torch.zeros_like(x).index_add(0, dst, msg)
    idx = dst[:, None].expand(-1, x.shape[1])
    return out, torch.full_like(x, float("-inf")).scatter_reduce(0, idx, msg, "amax")


@pytest.mark.parametrize("threads", ["one", "parallel"])
@pytest.mark.parametrize("features", [8, 1])
def test_scatter_prologues_in_every_loop_variant(tf, threads, features):
    """A prologue in the row loops (8 features), the blocked flat loop (1 feature: its dim goes),
    and the parallel loops: per-thread copies (the sum), compare-and-swap (the amax).  GAT's
    chain with parallel loops too."""
    from tests.lowering.test_scatter import gat_layer
    before = torch.get_num_threads()
    torch.set_num_threads(1 if threads == "one" else max(before, 2))
    try:
        opts = {"parallel_threshold": 1} if threads == "parallel" else {}
        x, y = tf.rand((19, features)), tf.rand((230, features))
        src, dst = torch.randint(-19, 19, (230,)), torch.randint(0, 19, (230,))
        e = tf.check(_messages_max_and_sum, x, y, src, dst, options=opts, atol=1e-5, rtol=1e-5)
        assert [k.name for k in e.kernels if "sin" in k.nodes] == [next(k.name for k in e.kernels if "index_add" in k.nodes
                                                                        and "sin" in k.nodes)], [k.nodes for k in e.kernels]
        h = tf.rand((19, 12))
        tf.check(gat_layer, h, src, dst, tf.rand((12, 12)) / 4, tf.rand((12,)), tf.rand((12,)), options=opts,
                 kernels=5, allow_fallbacks={"aten.mm.default"}, atol=1e-4, rtol=1e-4)
    finally:
        torch.set_num_threads(before)
