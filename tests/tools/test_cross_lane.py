"""tools/cross_lane.py: loads of another lane's store in generated Triton, and their emulation
under the interpreter."""
from __future__ import annotations

import os

import pytest
import torch

from torchfuse.tools.cross_lane import _stale, cross_lane_loads

os.environ.setdefault("TRITON_INTERPRET", "1")

SOURCE = '''@triton.jit
def k_persistent(in0, buf0, buf1, xnumel, rnumel, XBLOCK: tl.constexpr):
    t0 = tl.load(in0 + ((x0 * 64) + y0) + xzero, mask=xmask & rmask, other=0)
    tl.store(buf0 + ((x0 * 64) + y0) + xzero, t0, xmask & rmask)
    t1 = tl.load(buf0 + ((x0 * 64)) + xzero, mask=xmask, other=0).to(tl.float32)
    tl.store(buf1 + (x0) + xzero, t1, xmask)


@triton.jit
def k_looped(in0, buf0, xnumel, rnumel, XBLOCK: tl.constexpr):
    t0 = tl.load(in0 + ((x0 * 64) + y0) + xzero, mask=xmask & rmask, other=0)
    tl.store(buf0 + ((x0 * 64) + y0) + xzero, t0, xmask & rmask)
    t1 = tl.load(buf0 + ((x0 * 64) + y0) + xzero, mask=xmask & rmask, other=0)
    t2 = tl.load(buf1 + ((x0 * 64)) + xzero, mask=xmask, other=0)
'''


def test_finds_only_loads_of_a_stored_buffer_at_another_index():
    # k_looped reloads what it stored at the same index (its own thread's value) and reads buf1,
    # which it does not store; k_persistent reads the row's first element of its own output
    assert cross_lane_loads(SOURCE) == ["buf0[((x0 * 64))] in k_persistent"]


def test_stale_replaces_only_those_loads():
    out = _stale(SOURCE, 0.5)
    assert "t1 = tl.zeros_like(tl.load(buf0 + ((x0 * 64)) + xzero, mask=xmask, other=0).to(tl.float32)) + 0.5" in out
    assert out.replace("tl.zeros_like(", "").count("+ 0.5") == 1
    assert out.count("\n") == SOURCE.count("\n")


def test_generated_reductions_have_none(tf):
    """A stored prologue reloaded by a looped reduction (the same lanes) is no cross-lane load;
    the kernels match eager."""
    pytest.importorskip("triton")
    x = tf.rand((6, 3000))
    e = tf.check(lambda x: ((x * 2).exp(), (x * 2).exp().sum(1), torch.var_mean(x + 1, 1)), x,
                 options={"cpu_backend": "triton"}, atol=1e-4, rtol=1e-4, min_kernels=1)
    for k in e.kernels:
        assert not cross_lane_loads(k.source), (k.name, k.source)
