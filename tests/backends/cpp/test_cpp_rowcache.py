"""A costly per-element value that two loops over a row compute (a softmax's exp, summed by one
loop and divided by the sum in the next) is computed once per row and read back from a per-row
array (backends/cpp/rowcache.py); the results match eager."""
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

import torchfuse
from torchfuse.backends.cpp.rowcache import ROW_CACHE_BYTES


def _exp_norm(x):
    e = (x * 0.5).exp()
    return e / e.sum(-1, keepdim=True) + e.amax(-1, keepdim=True)      # exp read by three loops


def _softmax_then_tanh_mean(x):
    t = torch.tanh(x)
    return torch.softmax(t, -1) * (t - t.mean(-1, keepdim=True))


CASES = {
    "softmax": (lambda x: torch.softmax(x, -1), "tf_expf("),
    "safe_softmax": (lambda x: torch.ops.aten._safe_softmax(x, -1), "tf_expf("),
    "exp_norm": (_exp_norm, "tf_expf("),
    "softmax_of_tanh": (_softmax_then_tanh_mean, "tf_tanhf("),
}


def _explain(fn, x):
    e = torchfuse.explain(fn, x)
    assert len(e.kernels) == 1, str(e)
    return e, e.kernels[0].source


@pytest.mark.parametrize("shape", [(7, 1023), (3, 1), (5, 2, 33)])
@pytest.mark.parametrize("name", sorted(CASES))
def test_costly_value_computed_once_per_row(name, shape):
    fn, call = CASES[name]
    x = torch.randn(*shape) * 3
    e, src = _explain(fn, x)
    torch.testing.assert_close(e.output, fn(x))
    if shape[-1] == 1:
        return          # (rows of one element have no loop over the row: nothing to cache)
    assert "tf_row0[" in src, src
    assert src.count(call) == 1, src          # one loop computes it; the later ones read it back


@pytest.mark.parametrize("layout", ["strided", "transposed"])
def test_non_contiguous_rows(layout):
    # strided: rows of 1023 with an element stride of 2; transposed: rows that are columns in
    # memory, which the column kernel runs (a tile of columns per loop: no row array)
    x = torch.randn(14, 2046)[::2, ::2] if layout == "strided" else torch.randn(1023, 9).t()
    fn = CASES["softmax"][0]
    e, src = _explain(fn, x)
    torch.testing.assert_close(e.output, fn(x))
    if layout == "strided":
        assert src.count("tf_expf(") == 1, src


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_16_bit_rows(dtype):
    x = torch.randn(6, 515).to(dtype)
    fn = CASES["exp_norm"][0]
    e, src = _explain(fn, x)
    torch.testing.assert_close(e.output, fn(x))
    assert "tf_row0[" in src and src.count("tf_expf(") == 1, src


def test_rows_over_the_budget_recompute():
    n = ROW_CACHE_BYTES // 4 + 1                 # one float more than the arrays may hold
    x = torch.randn(2, n)
    fn = CASES["softmax"][0]
    e, src = _explain(fn, x)
    torch.testing.assert_close(e.output, fn(x))
    assert "tf_row" not in src and src.count("tf_expf(") == 2, src


def test_cheap_values_are_recomputed():
    # layer norm's loops share only x - mean: a load and a subtraction, not worth an array
    x = torch.randn(7, 1023)
    fn = lambda x: F.layer_norm(x, (1023,))      # noqa: E731
    e, src = _explain(fn, x)
    torch.testing.assert_close(e.output, fn(x))
    assert "tf_row" not in src, src


def test_single_row_split_across_threads():
    # one row: its loops themselves run in parallel (the array is shared, each element written
    # by one thread and read after the loop's barrier)
    x = torch.randn(1, 4099) * 3
    fn = CASES["exp_norm"][0]
    e = torchfuse.explain(fn, x, options={"parallel_threshold": 1})
    assert len(e.kernels) == 1, str(e)
    torch.testing.assert_close(e.output, fn(x))
    src = e.kernels[0].source
    assert "tf_row0[" in src and src.count("tf_expf(") == 1 and "omp parallel for" in src, src


_SOURCE_OF_SEVERAL_ROW_ARRAYS = """
import sys, torch, torchfuse
def f(x):
    t = torch.tanh(x)
    e = (x * 0.5).exp()
    return torch.softmax(t, -1) * e / e.sum(-1, keepdim=True) + t.sigmoid().amax(-1, keepdim=True) + t.sigmoid()
e = torchfuse.explain(f, torch.randn(7, 1023))
sys.stdout.write(e.kernels[0].source)
"""


def test_source_is_the_same_in_every_process(tmp_path):
    # the arrays are numbered in the order the values appear, not in a set's (hash-seeded) order:
    # a source that differs between processes would miss the on-disk kernel cache
    sources = []
    for seed in ("1", "2"):
        env = {**os.environ, "PYTHONHASHSEED": seed, "TORCHFUSE_CACHE_DIR": str(tmp_path / seed)}
        out = subprocess.run([sys.executable, "-c", _SOURCE_OF_SEVERAL_ROW_ARRAYS], env=env, capture_output=True,
                             text=True, check=True)
        sources.append(out.stdout)
    assert sources[0].count("tf_row") > 4 and sources[0] == sources[1]
