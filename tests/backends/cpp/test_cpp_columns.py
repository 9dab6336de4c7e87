"""The C++ backend's column plan: reductions whose input is contiguous across rows (x.sum(0), a
channels-last batch norm's statistics, a bias gradient) loop over rows outside and a tile of
columns inside, so that every load of the vector loop is contiguous.

Each case is compared with eager on awkward sizes (columns below, at and across the tile width,
rows not a multiple of anything, outer dims besides the columns), every reduction op, NaNs,
low-precision and integer dtypes; the kernel source is checked for the plan itself, since a
row-per-iteration kernel computes the same values 10-25x slower.
"""
import shutil

import pytest
import torch
import torch.nn.functional as F

from torchfuse.backends.cpp.codegen import COLUMN_TILE

pytestmark = pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++")

CPP = {"cpu_backend": "cpp"}


def _column_kernels(e) -> list:
    return [k for k in e.kernels if "xb += " in k.source]


@pytest.mark.parametrize("cols", [1, 3, 63, COLUMN_TILE, 100, 130])
@pytest.mark.parametrize("rows", [1, 37, 300])
def test_column_sum_matches_eager(tf, rows, cols):
    e = tf.check(lambda x: x.sum(0), tf.rand((rows, cols)), options=CPP, atol=1e-4, rtol=1e-4)
    if rows > 1 and cols > 1:       # (a size-1 dim is dropped: a plain row sum or a copy)
        assert len(_column_kernels(e)) == len(e.kernels), e.kernels[0].source


@pytest.mark.parametrize("op", ["sum", "prod", "amax", "amin", "mean"])
def test_every_reduction_op(tf, op):
    x = tf.rand((50, 70), low=0.5, high=1.5)
    e = tf.check(lambda x: getattr(x, op)(0), x, options=CPP, kernels=1, atol=1e-4, rtol=1e-4)
    assert _column_kernels(e)


def test_max_min_propagate_nan_per_column(tf):
    x = tf.rand((40, 90))
    x[7, 3] = float("nan")
    x[39, 80] = float("nan")
    e = tf.check(lambda x: (x.amax(0), x.amin(0)), x, options=CPP, kernels=1)
    assert _column_kernels(e)
    out = e.output[0]
    assert out[3].isnan() and out[80].isnan() and not out[4].isnan()


def test_any_all_on_bools(tf):
    x = tf.rand((33, 70)) > 2.0
    e = tf.check(lambda x: (x.any(0), x.all(0)), x, options=CPP, kernels=1)
    assert _column_kernels(e)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.int32, torch.int64])
def test_dtypes(tf, dtype):
    x = tf.rand((45, 77), dtype)
    e = tf.check(lambda x: x.sum(0), x, options=CPP, kernels=1, atol=1e-2, rtol=1e-2)
    assert _column_kernels(e)


def test_outer_dims_besides_the_columns(tf):
    """[A, R, B].sum(1): B is contiguous, A stays an outer loop (collapsed with the tiles)."""
    x = tf.rand((3, 41, 150))
    e = tf.check(lambda x: x.sum(1), x, options=CPP, kernels=1, atol=1e-4, rtol=1e-4)
    assert _column_kernels(e)


def test_empty_rows_and_columns(tf):
    tf.assert_same(torch.compile(lambda x: x.sum(0), backend="torchfuse", options=CPP)(torch.randn(0, 70)),
                   torch.zeros(70))
    tf.assert_same(torch.compile(lambda x: x.amax(0), backend="torchfuse", options=CPP)(torch.randn(5, 0)),
                   torch.randn(5, 0).amax(0))


def test_non_contiguous_input(tf):
    """A transposed input reads rows contiguously: not a column plan; a sliced one still is."""
    x = tf.rand((90, 60))
    e = tf.check(lambda x: x.t().sum(1), x, options=CPP, kernels=1, atol=1e-4, rtol=1e-4)
    assert _column_kernels(e)
    e = tf.check(lambda x: x[::2, 5:].sum(0), x, options=CPP, kernels=1, atol=1e-4, rtol=1e-4)
    assert _column_kernels(e)


@pytest.mark.parametrize("shape", [(8, 64, 9, 9), (3, 100, 7, 5), (2, 5, 3, 2)])
def test_batch_norm_training_channels_last(tf, shape):
    """Statistics, normalization and the running-stat update in one column kernel (or a split
    pair), forward and backward, on channels-last activations."""
    x = (tf.rand(shape) * 2 + 3).to(memory_format=torch.channels_last).requires_grad_()
    w, b = torch.rand(shape[1]) + 0.5, torch.randn(shape[1])
    w.requires_grad_()
    b.requires_grad_()

    def fn(x, w, b):
        rm, rv = torch.zeros(shape[1]), torch.ones(shape[1])
        y = F.batch_norm(x, rm, rv, w, b, training=True)
        return torch.relu(y), rm, rv

    compiled = torch.compile(fn, backend="torchfuse", options=CPP)
    out = compiled(x, w, b)
    ref = fn(x, w, b)
    tf.assert_same(out, ref, atol=1e-4, rtol=1e-4)
    g = torch.randn(shape).to(memory_format=torch.channels_last)
    grads = torch.autograd.grad(out[0], (x, w, b), g)
    ref_grads = torch.autograd.grad(ref[0], (x, w, b), g)
    tf.assert_same(grads, ref_grads, atol=1e-3, rtol=1e-3)


def test_batch_norm_statistics_kernel_is_a_column_plan(tf):
    x = tf.rand((8, 64, 9, 9)).to(memory_format=torch.channels_last)
    e = tf.check(lambda x: torch.var_mean(x, (0, 2, 3), correction=0), x, options=CPP, atol=1e-4, rtol=1e-4)
    assert len(_column_kernels(e)) == len(e.kernels)


def test_one_tile_of_long_columns_splits_for_threads(tf):
    """64 channels are one tile: with 2 threads the rows split in partials, and the partial
    kernel is itself a column plan whose index has no division left (a chunk of N*H*W rows
    of a channels-last tensor is one linear range)."""
    x = tf.rand((16, 64, 16, 16)).to(memory_format=torch.channels_last)
    e = tf.check(lambda x: x.sum((0, 2, 3)), x, options={**CPP, "num_threads": 2, "split_min_chunk": 4096},
                 kernels=2, atol=1e-3, rtol=1e-4)
    part = next(k for k in e.kernels if k.name.endswith("_part"))
    assert "xb += " in part.source
    assert " / " not in part.source.split("omp parallel", 1)[1], part.source


def test_cpu_split_params_count_column_tiles():
    from torchfuse import backends
    cpp = backends.by_name("cpp", "cpu").split_params(2)
    assert cpp.column_tile == COLUMN_TILE and cpp.column_chunk == cpp.min_chunk // COLUMN_TILE
    assert backends.by_name("triton", "cpu").split_params(2).column_tile == 1   # the interpreter: untiled


@pytest.mark.parametrize("rows", [4099, 64 * 3])
def test_long_column_sum_is_as_accurate_as_eager(tf, rows):
    """A norm-weight gradient over 8x512 tokens: the sum over 4096 rows of a product.  One
    accumulator per column over every row erred 8x ATen's cascade sum against the fp64 sum;
    summed in blocks of rows it stays within the accuracy judge's 1.5x (tools/accuracy.py)."""
    from torchfuse.tools.accuracy import judge
    g = torch.Generator().manual_seed(5)
    a, b = torch.randn(rows, 70, generator=g) + 0.3, torch.randn(rows, 70, generator=g)
    e = tf.check(lambda a, b: (a * b).sum(0), a, b, options={**CPP, "split_min_chunk": 1 << 40}, kernels=1,
                 atol=1e-3, rtol=1e-4)
    assert _column_kernels(e)
    v = judge(e.output, (a * b).sum(0), (a.double() * b.double()).sum(0))
    assert v.ok, str(v)
