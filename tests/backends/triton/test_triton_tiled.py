"""2-D tiled Triton pointwise kernels (`<kernel>_tiled`, backends/triton/codegen.py `tile_dims`): when an
input is contiguous along another dim than the output (a transpose), the kernel is a
[YBLOCK, XBLOCK] tile so loads and stores are both coalesced on a GPU.  Here: which kernels are
tiled, and that they compute what eager computes under Triton's interpreter (odd sizes so every
tile edge is masked, 3-d with an untiled batch dim, low precision, ints, 64-bit offsets)."""
from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

TRITON = {"cpu_backend": "triton"}


def _check(tf, fn, *args, tiled: bool, kernels: int = 1):
    e = tf.check(fn, *args, options=TRITON, kernels=kernels, check_stride=True)
    sources = [k.source for k in e.kernels]
    assert any("_tiled(" in s for s in sources) == tiled, sources
    return e


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.int32])
@pytest.mark.parametrize("shape", [(37, 53), (64, 96), (130, 17)])
def test_transpose_add_is_tiled(tf, dtype, shape):
    x = tf.rand(shape, dtype)
    _check(tf, lambda x: x.t().contiguous() + 1, x, tiled=True)
    _check(tf, lambda x: (x.t() * 2).contiguous(), x, tiled=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_permute_plus_contiguous(tf, dtype):
    x, y = tf.rand((3, 40, 33), dtype), tf.rand((3, 33, 40), dtype)
    _check(tf, lambda x, y: x.permute(0, 2, 1) + y, x, y, tiled=True)
    _check(tf, lambda x, y: y + x.permute(0, 2, 1), x, y, tiled=True)
    # the batch dim is the tiled one's neighbour: 4-d with two untiled dims
    z = tf.rand((2, 3, 20, 17), dtype)
    _check(tf, lambda z: z.transpose(-1, -2).contiguous().sigmoid(), z, tiled=True)


def test_noncontiguous_and_sliced_inputs(tf):
    x = tf.rand((50, 70))[::2, 1::3]          # strided in both dims: no dim with stride 1
    _check(tf, lambda x: x.t().contiguous() + 1, x, tiled=False)
    y = tf.rand((70, 48))[:, :33]             # stride 1 along the last dim, rows of 48
    _check(tf, lambda y: y.t().contiguous() * 3, y, tiled=True)


def test_fused_chain_with_transpose_and_broadcast(tf):
    x, b, c = tf.rand((33, 45)), tf.rand((33,)), tf.rand((45,))
    e = _check(tf, lambda x, b, c: torch.relu(x.t() + b) * c[:, None] - x.t().exp(), x, b, c, tiled=False)
    # the output follows x.t()'s layout (eager keeps it), so nothing conflicts
    assert e.output.stride() == (1, 45)
    _check(tf, lambda x, b, c: (torch.relu(x.t() + b) * c[:, None]).contiguous(), x, b, c, tiled=True)


def test_common_cases_stay_flat(tf):
    x, b = tf.rand((37, 53)), tf.rand((37,))
    _check(tf, lambda x: x * 2 + 1, x, tiled=False)                 # contiguous
    _check(tf, lambda x, b: x + b[:, None], x, b, tiled=False)      # broadcast column
    _check(tf, lambda x: x.t() + 1, x, tiled=False)                 # output keeps the input layout
    _check(tf, lambda x: x.t().contiguous() + 1, tf.rand((5, 300)), tiled=False)   # a 5-wide dim


def test_64bit_offsets_variant(tf, monkeypatch):
    # BIG=True (int64 program ids) is what > 2**31-element tensors use; force it on a small one
    import torchfuse.backends.triton as triton_backend
    monkeypatch.setattr(triton_backend, "_needs_64bit_expr", lambda program, bufs, plan: "True")
    _check(tf, lambda x: x.t().contiguous() + 1, tf.rand((37, 53)), tiled=True)


def test_tile_blocks():
    from torchfuse.backends.triton.launch import tile_blocks
    assert tile_blocks(8192, 8192) == (64, 64, 4)
    assert tile_blocks(4099, 8191) == (64, 64, 4)
    xb, yb, _ = tile_blocks(20, 8192)            # a short x dim: the tile grows along y
    assert xb == 32 and yb == 128
    assert tile_blocks(3, 5)[:2] == (4, 8)
    assert tile_blocks(8192, 8192, 2) == (128, 64, 8)   # 2-byte dtypes: the same 16 KB per tile
    assert tile_blocks(8192, 8192, 1) == (128, 64, 8)


def test_tile_of_a_2_byte_transpose_is_the_same_planned_ahead():
    # precompile plans launches with dtypes where tensors go; the plan made then is kept
    from types import SimpleNamespace

    from torchfuse.backends.triton.launch import _tiled_plan
    kernel = SimpleNamespace(fn=SimpleNamespace(__module__="not_tuned", __name__="k"))
    x = torch.empty(4, 1000, 1024, dtype=torch.bfloat16)
    at_run = _tiled_plan(kernel, 1024, 1000, x.numel(), False, (x, x, x))
    ahead = _tiled_plan(kernel, 1024, 1000, x.numel(), False, (torch.bfloat16,) * 3)
    assert at_run[1:] == ahead[1:] and at_run[3][:2] == (128, 64) and at_run[4] == 8
    wide = _tiled_plan(kernel, 1024, 1000, x.numel(), False, (torch.bfloat16, torch.float32))
    assert wide[3][:2] == (64, 64)


def test_reduction_warps_by_row_length():
    # measured on the H100 (BENCHMARKS.md): 32 warps only for the longest persistent rows
    from types import SimpleNamespace

    from torchfuse.backends.triton.launch import PERSISTENT_LIMIT, _reduction_plan
    kernel = SimpleNamespace(fn=SimpleNamespace(__module__="not_tuned", __name__="k"))

    def warps(rows: int, cols: int) -> int:
        plan = _reduction_plan(kernel, kernel, rows, cols, False, False, ())
        assert plan[0] is kernel
        return plan[4]
    assert warps(4096, PERSISTENT_LIMIT) == 32
    assert warps(8192, 16384) == 16
    assert warps(16384, 1000) <= 4


def test_column_sums_of_a_training_step_read_whole_sectors():
    """A layer's weight/bias gradient is a column sum over [tokens, width]: one column per program
    read one element per sector (49 us for 2048x768 fp32 on the H100); these now run the looped
    kernel with at least 16 columns per tile, and short columns keep the persistent kernel."""
    from types import SimpleNamespace

    from torchfuse.backends.triton import launch as tl_
    persistent = SimpleNamespace(fn=SimpleNamespace(__module__="not_tuned", __name__="p"))
    looped = SimpleNamespace(fn=SimpleNamespace(__module__="not_tuned", __name__="l"))
    for cols, rows in ((768, 2048), (3072, 2048), (2304, 8192), (1000, 2047), (40, 300)):
        kernel, grid, _, (xblock, rblock, _), warps, _ = tl_._reduction_plan(
            persistent, looped, cols, rows, False, True, ())
        assert kernel is looped and xblock >= min(16, cols) and xblock * rblock == tl_.COLUMN_ELEMENTS, (cols, rows)
        assert grid[0] * xblock >= cols
    assert tl_._reduction_plan(persistent, looped, 768, 4, False, True, ())[0] is persistent
    assert tl_._reduction_plan(persistent, looped, 768, 2048, False, False, ())[0] is persistent


def test_layer_norm_weight_gradients(tf):
    """The column sums of a layer norm backward (weight and bias gradients) next to its row-wise
    input gradient, through the Triton backend, against eager autograd."""
    import torch.nn.functional as F
    x, w, b, g = tf.rand((300, 96)), tf.rand((96,)), tf.rand((96,)), tf.rand((300, 96))

    compiled = __import__("torchfuse").compile(lambda x, w, b: F.layer_norm(x, (96,), w, b),
                                               options={**TRITON, "strict": True})
    grads = []
    for fn in (compiled, lambda x, w, b: F.layer_norm(x, (96,), w, b)):
        leaves = [t.detach().clone().requires_grad_() for t in (x, w, b)]
        fn(*leaves).backward(g)
        grads.append([t.grad for t in leaves])
    for got, want in zip(*grads):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_dynamic_shapes(tf):
    fn = lambda x: x.t().contiguous() + 1  # noqa: E731
    tf_compiled = __import__("torchfuse").compile(fn, dynamic=True, options={**TRITON, "strict": True})
    for shape in [(37, 53), (64, 17), (129, 40)]:
        x = tf.rand(shape)
        tf.assert_same(tf_compiled(x), fn(x), check_stride=True)


@pytest.mark.parametrize("split", [False, True])
def test_column_reduction_uses_row_tiles(tf, monkeypatch, split):
    """Column sums (input contiguous across rows) launch the looped kernel with several rows per
    tile (`xfast`); row sums do not."""
    from torchfuse.backends.triton import launch as triton_launch
    seen = []
    real = triton_launch.launch_reduction

    def spy(*args, **kwargs):
        seen.append(kwargs.get("xfast", False))
        return real(*args, **kwargs)

    monkeypatch.setattr(triton_launch, "launch_reduction", spy)
    monkeypatch.setattr(triton_launch, "_sms", [4])     # a small "GPU": tiles of up to 32 rows
    opts = {**TRITON, "split_reductions": split, "split_min_chunk": 64, "num_threads": 2}
    x = tf.rand((5000, 3))
    tf.check(lambda x: x.sum(0), x, options=opts, kernels=2 if split else 1, atol=1e-4, rtol=1e-4)
    assert seen[0] is True
    seen.clear()
    tf.check(lambda x: x[:, :35].amax(0), tf.rand((3000, 70)), options=opts, kernels=1)
    assert seen == [True]
    seen.clear()
    tf.check(lambda x: x.amax(1), tf.rand((3, 5000)), options=opts, kernels=2 if split else 1)
    assert seen[0] is False      # (a split's final kernel reads its partials across rows)
