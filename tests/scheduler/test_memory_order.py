"""Wrapper steps started as late as their inputs allow (scheduler/memory_order.py): a branch whose
result is read only at the end of a block moves after the last other reader of its input; steps
with side effects (random numbers) keep their order and nothing moves across them."""
from __future__ import annotations

import re

import pytest

import torch
import torch.nn as nn

import torchfuse


def _wrapper_calls(tmp_path) -> str:
    return "\n".join(p.read_text().split("\ndef call_profiled")[0] for p in sorted(tmp_path.rglob("*wrapper.py")))


class DownsampleFirst(nn.Module):
    """A bottleneck block whose forward computes the shortcut's convolution first (as the zoo's
    ResNeXt does): its result would be alive through the whole main branch."""

    def __init__(self) -> None:
        super().__init__()
        self.down = nn.Conv2d(16, 32, 1, 2, bias=False)
        self.c1 = nn.Conv2d(16, 8, 1, bias=False)
        self.c2 = nn.Conv2d(8, 8, 3, 2, 1, bias=False)
        self.c3 = nn.Conv2d(8, 32, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = self.down(x)
        out = torch.relu(self.c1(x))
        out = torch.relu(self.c2(out))
        return torch.relu(self.c3(out) + identity)


def test_shortcut_branch_starts_after_the_main_branch_read_its_input(tmp_path):
    torch.manual_seed(0)
    m = DownsampleFirst().eval()
    x = torch.randn(2, 16, 32, 32)
    with torch.no_grad():
        e = torchfuse.explain(m, x, options={"debug": True, "debug_dir": tmp_path})
        torch.testing.assert_close(e.output, m(x), rtol=1e-5, atol=1e-5)
    src = _wrapper_calls(tmp_path)
    convs = re.findall(r"= _c\d+\((\w+), (\w+), None, \[(\d), \d\]", src)
    assert len(convs) == 4, src
    # the first convolution run is the main branch's 1x1 (stride 1); the stride-2 shortcut
    # follows it at once (x's last reader), not first and not at the end
    assert [c[2] for c in convs] == ["1", "2", "2", "1"], convs


def test_random_steps_keep_their_order(tmp_path):
    """A matmul read only at the end could start later, but not across random draws, whose
    order decides which numbers each gets: results equal eager's under the same seed."""
    w = torch.randn(24, 24)

    def fn(x):
        h = x @ w                    # read only by the last line
        r1 = torch.rand_like(x)
        r2 = torch.rand_like(x) * 2
        return r1 - r2 + h.sum(1, keepdim=True)

    x = torch.randn(24, 24)
    compiled = torchfuse.compile(fn, options={"debug": True, "debug_dir": tmp_path})
    torch.manual_seed(7)
    got = compiled(x)
    torch.manual_seed(7)
    torch.testing.assert_close(got, fn(x), rtol=1e-5, atol=1e-5)


def _layer_then_aggregate(h, w1, b, w2, src, dst):
    """An activation, a matmul, then the next aggregation's zeros: the zeros could be computed
    by the activation's kernel, before the matmul."""
    y = torch.relu(h @ w1 + b) @ w2
    return torch.zeros_like(y).index_add(0, dst, y[src] * 0.5)


@pytest.mark.parametrize("nodes", [2048, 64])
def test_a_large_accumulator_is_not_allocated_before_a_matmul(tf, nodes):
    """A scatter's zeros join an earlier kernel only where small (scheduler/fusion.py
    `_join_earlier`): 1 MiB of them (2048 x 128 fp32) would otherwise be alive beside the
    matmul's output, for one launch saved; 32 KiB still join."""
    width = 128
    h, w1, b = tf.rand((nodes, 32)), tf.rand((32, width), low=-0.2, high=0.2), tf.rand((width,))
    w2 = tf.rand((width, width), low=-0.1, high=0.1)
    src, dst = torch.randint(0, nodes, (3 * nodes,)), torch.randint(0, nodes, (3 * nodes,))
    e = tf.check(_layer_then_aggregate, h, w1, b, w2, src, dst, atol=1e-4, rtol=1e-4,
                 allow_fallbacks={"aten.mm.default", "aten.addmm.default"})
    joined = [k.name for k in e.kernels if any("relu" in w for w in k.writes) and any("index_add" in w for w in k.writes)]
    assert bool(joined) == (nodes == 64), [(k.name, k.writes) for k in e.kernels]


def _reads_across_a_matmul(h, w1, w2):
    a = torch.relu(h @ w1)
    return a @ w2, a * 2.0 + 1.0


def test_a_large_step_reading_an_earlier_kernel_still_joins_it(tf):
    """`a * 2 + 1`, after the second matmul, joins the kernel that made `a` (1 MiB): reading
    `a` there saves reading it again, whatever its lifetime."""
    h, w1, w2 = tf.rand((2048, 32)), tf.rand((32, 128), low=-0.2, high=0.2), tf.rand((128, 16), low=-0.2, high=0.2)
    e = tf.check(_reads_across_a_matmul, h, w1, w2, atol=1e-4, rtol=1e-4, kernels=1,
                 allow_fallbacks={"aten.mm.default"})
    assert any("relu" in w for w in e.kernels[0].writes) and len(e.kernels[0].writes) == 2, e.kernels[0].writes
