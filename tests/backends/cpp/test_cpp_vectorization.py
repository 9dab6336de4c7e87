"""The C++ backend's inner loops must vectorize: g++ says so with -fopt-info-vec-optimized.

A regression here (a libm call, an OpenMP clause that disables simd, a bool reduction) costs
4-9x on transcendental-heavy kernels while every value stays correct, so correctness tests
alone would not notice.
"""
import re
import shutil
import subprocess

import pytest
import torch
import torch.nn.functional as F

import torchfuse
from torchfuse.backends.cpp.codegen import translation_unit
from torchfuse.config import Config

pytestmark = pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++")

CASES = {
    # name: (fn, number of inner loops that must vectorize)
    "gelu_erf": (lambda x: F.gelu(x), 1),
    "gelu_tanh": (lambda x: F.gelu(x, approximate="tanh"), 1),
    "sigmoid_exp_log": (lambda x: torch.sigmoid(x) + torch.exp(x) * torch.log(x.abs() + 1), 1),
    "elu_expm1": (lambda x: F.elu(x), 1),      # (std::expm1, a libm call: 10x slower)
    "softmax": (lambda x: torch.softmax(x, -1), 3),
    "log_softmax": (lambda x: torch.log_softmax(x, -1), 3),
    "layer_norm": (lambda x: F.layer_norm(x, (256,)), 3),
    "rotary_sin_cos": (lambda x: x * torch.cos(x[:1] * 0.1) + x.flip(-1) * torch.sin(x[:1] * 0.1), 1),
    # an RGB batch going channels-last: the 3-long channel loop is unrolled in the vector loop
    "rgb_to_channels_last": (lambda x: x[:48].reshape(4, 3, 32, 32).contiguous(memory_format=torch.channels_last) * 2, 1),
}


# a Swin / relative-position attention softmax: a bias gathered by an index table, and the
# all(-inf) row test of _safe_softmax (a bool reduction)
_TABLE = torch.randn(49, 2)
_INDEX = torch.randint(-49, 49, (256,))


def _gathered_bias_softmax(x):
    bias = _TABLE[_INDEX].view(16, 16, 2).permute(2, 0, 1)       # (2, 16, 16)
    return torch.ops.aten._safe_softmax(x.view(-1, 2, 16, 16) + bias, -1)


CASES["gathered_bias_safe_softmax"] = (_gathered_bias_softmax, 3)


def _rotary_heads_to_rows(x):
    """Llama's rotary backward: per-head rows (8 heads of 32) rotated by an angle table broadcast
    over heads, written back as (tokens, heads * 32): the flat loop over 256 columns reads the
    table at column % 32, which only vectorizes once that loop is split into heads x 32."""
    q = x.view(8, 64, 32)
    angles = x[:, :32] * 0.1
    rotated = torch.cat([-q[..., 16:], q[..., :16]], -1)
    return (q * torch.cos(angles) + rotated * torch.sin(angles)).transpose(0, 1).reshape(64, 256)


CASES["rotary_heads_to_rows"] = (_rotary_heads_to_rows, 1)


# bool tensors next to floats in one loop: a ReLU's output stored with the mask its backward
# saves, and a mask loaded next to a gradient (threshold_backward, attention masks).  Through a
# bool* pointer g++ 12 vectorized neither ("no vectype for stmt": 7x slower than eager)
_MASK = torch.rand(64, 256) > 0.5
CASES["bool_mask_stored_with_floats"] = (lambda x: (lambda t: (t <= 0, t))(torch.relu(x + 0.25)), 1)
CASES["bool_mask_loaded_with_floats"] = (lambda x: torch.where(_MASK, 0.0, x * 2 + 1), 1)


@pytest.mark.parametrize("name", sorted(CASES))
def test_inner_loops_vectorize(name, tmp_path):
    fn, loops = CASES[name]
    x = torch.randn(64, 256)
    e = torchfuse.explain(fn, x)
    torch.testing.assert_close(e.output, fn(x))
    assert len(e.kernels) == 1, str(e)
    unit = translation_unit([e.kernels[0].source])
    src = tmp_path / "k.cpp"
    src.write_text(unit)
    cfg = Config()
    out = subprocess.run([cfg.cxx, *cfg.cxx_flags, "-fopt-info-vec-optimized", str(src), "-o", str(tmp_path / "k.so")],
                         capture_output=True, text=True, check=True)
    # (a kernel with run-time checks returns whether one failed: int64_t, not void)
    first = unit[:unit.index(f' {e.kernels[0].name}(')].count("\n") + 1
    vectorized = {int(m.group(1)) for m in re.finditer(r"k\.cpp:(\d+):\d+: optimized: loop vectorized", out.stderr)
                  if int(m.group(1)) >= first}
    assert len(vectorized) >= loops, f"{len(vectorized)} of {loops} inner loops vectorized:\n{out.stderr}\n{unit[-3000:]}"


def test_gather_uniform_across_lanes_keeps_contiguous_lane_offsets():
    """A channels-last bilinear upsample reads its source pixel through index tables that depend
    on the output row and column only: along the vectorized channel loop the offset is
    contiguous.  Cast to int32 (as a per-lane gather from an int32-addressable buffer is), g++
    made every load a gather: the same kernel ran 7x slower.  Only the swin-style gather, whose
    loaded index differs per lane, is cast (gathered_bias_safe_softmax)."""
    x = torch.randn(64, 256)

    def upsample(x):
        return F.interpolate(torch.relu(x.view(4, 16, 16, 16).permute(0, 3, 1, 2)), scale_factor=2, mode="bilinear")

    e = torchfuse.explain(upsample, x)
    torch.testing.assert_close(e.output, upsample(x))
    assert len(e.kernels) == 1, str(e)
    source = e.kernels[0].source
    assert "#pragma omp simd" in source and "static_cast<int32_t>" not in source, source


def test_row_gather_in_reduction_kernel_keeps_contiguous_lane_offsets():
    """An embedding followed by LayerNorm (BERT's first kernel) gathers one table row per
    output row: the row loop is scalar and the vector loops run along the row, so the offset is
    contiguous in every lane.  The int32 cast meant for per-lane gathers made g++ load every
    element of all three passes with a gather instruction: the kernel ran 3.5x slower."""
    table, w, b = torch.randn(997, 72), torch.randn(72), torch.randn(72)
    ids = torch.randint(0, 997, (3, 41))

    def embed_norm(ids, table, w, b):
        return F.layer_norm(F.embedding(ids, table), (72,), w, b) * 2

    e = torchfuse.explain(embed_norm, ids, table, w, b)
    torch.testing.assert_close(e.output, embed_norm(ids, table, w, b))
    assert len(e.kernels) == 1, str(e)
    source = e.kernels[0].source
    assert "#pragma omp simd" in source and "static_cast<int32_t>" not in source, source
