"""Hoisting parameter-only computations out of inference calls (passes/hoist_static.py) and
keeping them between calls (runtime/static_values.py): recomputed when a parameter changes,
never with freezing=True."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

import torchfuse


def _conv_bn_relu() -> nn.Module:
    m = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                      nn.Conv2d(8, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8), nn.ReLU()).eval()
    with torch.no_grad():
        for mod in m.modules():
            if isinstance(mod, nn.BatchNorm2d):
                mod.running_mean.uniform_(-1, 1)
                mod.running_var.uniform_(0.5, 2)
                mod.weight.uniform_(0.5, 1.5)
                mod.bias.uniform_(-1, 1)
    return m


@pytest.fixture
def model_and_input():
    torch.manual_seed(0)
    return _conv_bn_relu(), torch.randn(2, 3, 11, 13)


def test_conv_bn_fold_is_hoisted(model_and_input):
    m, x = model_and_input
    with torch.no_grad():
        e = torchfuse.explain(m, x)
        torch.testing.assert_close(e.output, m(x), rtol=1e-4, atol=1e-4)
    # the folded weights and biases of both convolutions: computed outside the call
    assert len(e.frozen) == 1 and "4 value(s)" in e.frozen[0], e.frozen
    assert "hoisted parameter computations" in str(e)
    # per call only the two ReLU kernels run (the batch norms are folded into the convolutions)
    assert len(e.kernels) == 2, str(e)


@pytest.mark.parametrize("change", ["mul_", "copy_", "data", "load_state_dict"])
def test_parameter_change_is_picked_up(model_and_input, change):
    m, x = model_and_input
    compiled = torch.compile(m, backend="torchfuse")
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), m(x), rtol=1e-4, atol=1e-4)
        bn = m[1]
        if change == "mul_":
            bn.weight.mul_(2)
        elif change == "copy_":
            m[0].weight.copy_(torch.randn_like(m[0].weight))
        elif change == "data":
            bn.running_var.data = torch.rand_like(bn.running_var) + 0.5
        else:
            other = _conv_bn_relu()
            m.load_state_dict(other.state_dict())
        torch.testing.assert_close(compiled(x), m(x), rtol=1e-4, atol=1e-4)


def test_values_are_computed_once_per_parameter_version(model_and_input, monkeypatch):
    from torchfuse.runtime import static_values
    m, x = model_and_input
    calls = []
    original = static_values.StaticPrologue._compute
    monkeypatch.setattr(static_values.StaticPrologue, "_compute",
                        lambda self, *a: (calls.append(1), original(self, *a)))
    compiled = torch.compile(m, backend="torchfuse")
    with torch.no_grad():
        for _ in range(3):
            compiled(x)
        assert len(calls) == 1
        m[4].bias.add_(1)
        torch.testing.assert_close(compiled(x), m(x), rtol=1e-4, atol=1e-4)
        compiled(x)
    assert len(calls) == 2


def test_freezing_takes_parameters_as_constants(model_and_input):
    """Documented behaviour: with freezing=True a parameter changed after the first call is not
    seen (recompile to pick it up)."""
    m, x = model_and_input
    compiled = torchfuse.compile(m, options={"freezing": True})
    with torch.no_grad():
        before = m(x)
        torch.testing.assert_close(compiled(x), before, rtol=1e-4, atol=1e-4)
        m[1].weight.mul_(3)
        torch.testing.assert_close(compiled(x), before, rtol=1e-4, atol=1e-4)   # stale, as documented
        assert not torch.allclose(m(x), before)
    assert torchfuse.Config.from_options(mode="max-autotune").freezing


def test_autocast_weight_casts_and_bias_sums_are_hoisted():
    torch.manual_seed(0)
    lin = nn.Linear(16, 8)
    scale = nn.Parameter(torch.rand(8) + 0.5)

    def fn(x):
        w = (lin.weight * scale[:, None]).to(torch.bfloat16)   # parameter-only work
        return torch.relu(x.to(torch.bfloat16) @ w.t() + lin.bias.to(torch.bfloat16))

    x = torch.randn(4, 16)
    with torch.no_grad():
        e = torchfuse.explain(fn, x)
        torch.testing.assert_close(e.output, fn(x), rtol=2e-2, atol=2e-2)
    assert e.frozen and "hoisted" in e.frozen[0], str(e)


def test_returned_and_view_values_are_not_hoisted():
    """A parameter-only value the caller receives must be fresh each call (the caller may
    modify it); a plain view of a parameter costs nothing and is left in the graph."""
    torch.manual_seed(0)
    w = nn.Parameter(torch.randn(5, 5))
    m = nn.Module()
    m.w = w

    def fn(x):
        return x @ m.w.t(), m.w * 2

    x = torch.randn(3, 5)
    compiled = torch.compile(fn, backend="torchfuse")
    with torch.no_grad():
        a1, b1 = compiled(x)
        b1.add_(100)
        a2, b2 = compiled(x)
        torch.testing.assert_close(b2, w * 2)
        torch.testing.assert_close(a2, x @ w.t())
        e = torchfuse.explain(fn, x)
    assert not e.frozen, e.frozen


def test_training_graphs_are_not_hoisted(model_and_input):
    m, x = model_and_input
    m = copy.deepcopy(m).train()
    e = torchfuse.explain(lambda x: m(x).sum(), x.requires_grad_())
    assert e.kernels and not e.frozen


def test_parameters_made_under_inference_mode():
    """Inference tensors keep no version counter: the hoisted values are then recomputed on every
    call, so an in-place change made under inference_mode is still seen."""
    with torch.inference_mode():
        m = _conv_bn_relu()
        x = torch.randn(2, 3, 11, 13)
        compiled = torch.compile(m, backend="torchfuse")
        torch.testing.assert_close(compiled(x), m(x), rtol=1e-4, atol=1e-4)
        m[1].weight.mul_(2)
        torch.testing.assert_close(compiled(x), m(x), rtol=1e-4, atol=1e-4)


def test_broadcast_of_a_parameter_is_not_held():
    """A parameter-only value much larger than what it reads (a position-bias table added to a
    per-window mask, broadcast over the windows) is recomputed where it is read; the small
    table it comes from is what is hoisted."""
    torch.manual_seed(0)
    table = nn.Parameter(torch.randn(3, 49, 49))
    m = nn.Module()
    m.table = table

    def fn(x):
        mask = torch.zeros(64, 1, 49, 49)
        mask[:, :, :20, 30:] = -100.0
        bias = (m.table * 2).unsqueeze(0) + mask        # [64, 3, 49, 49] from a [3, 49, 49] table
        return torch.softmax(x + bias, -1)

    x = torch.randn(64, 3, 49, 49)
    with torch.no_grad():
        e = torchfuse.explain(fn, x)
        torch.testing.assert_close(e.output, fn(x), rtol=1e-5, atol=1e-6)
    assert e.frozen and f"({3 * 49 * 49} elements)" in e.frozen[0], e.frozen


def test_gather_larger_than_its_table_is_not_held():
    """A learned position embedding gathered at constant positions for every sequence of the
    batch (OPT) selects rows: the reader gathers them in its own kernel for the reads a held copy
    costs, so the gather is not held once it is larger than its table (here 1.5x); a gather
    smaller than its table still is."""
    torch.manual_seed(0)
    m = nn.Module()
    m.table = nn.Parameter(torch.randn(2048, 64))

    def fn(x):
        positions = (torch.arange(x.shape[1], dtype=torch.long) + 2).expand(x.shape[0], x.shape[1])
        return x + torch.nn.functional.embedding(positions, m.table) * 0.5

    x = torch.randn(2, 1536, 64)       # [2, 1536, 64] gathered from a [2048, 64] table: 1.5x
    with torch.no_grad():
        e = torchfuse.explain(fn, x)
        torch.testing.assert_close(e.output, fn(x))
        assert not e.frozen, e.frozen
        small = torch.randn(1, 1536, 64)   # 0.75x the table: held
        e = torchfuse.explain(fn, small)
        torch.testing.assert_close(e.output, fn(small))
    assert e.frozen and f"({1536 * 64} elements)" in e.frozen[0], e.frozen


class _Rotary(nn.Module):
    """A decoder's rotary embedding as transformers writes it: cos/sin tables built per call from
    a [head_dim / 2] frequency buffer, in steps (outer product, cat, cos) none of which more than
    doubles its own input."""

    def __init__(self, head_dim: int, weight_rows: int):
        super().__init__()
        self.register_buffer("inv_freq", 1.0 / 10000 ** (torch.arange(0, head_dim, 2).float() / head_dim))
        self.proj = nn.Linear(head_dim, head_dim)
        self.scale = nn.Parameter(torch.rand(weight_rows, head_dim) + 0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(x.shape[1], dtype=torch.float32)
        freqs = torch.outer(positions, self.inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        q = self.proj(x)
        half = q.shape[-1] // 2
        rotated = torch.cat((-q[..., half:], q[..., :half]), dim=-1)
        return (q * emb.cos() + rotated * emb.sin()) * (self.scale * 2)


def test_a_table_much_larger_than_its_sources_is_not_held():
    """A rotary table ([positions, head_dim] = 64K elements from a 32-element buffer) is measured
    against the buffer it comes from, not against the step before it: it is not held between
    calls (held, it raised a decoder's peak above Inductor's, which frees it before the logits),
    while a parameter-only value of its sources' size (`scale * 2`) still is."""
    torch.manual_seed(0)
    m = _Rotary(64, 1024).eval()
    x = torch.randn(2, 1024, 64)
    with torch.no_grad():
        e = torchfuse.explain(m, x)
        torch.testing.assert_close(e.output, m(x), rtol=1e-4, atol=1e-4)
    assert len(e.frozen) == 1 and f"({1024 * 64} elements)" in e.frozen[0] and "1 value(s)" in e.frozen[0], e.frozen
