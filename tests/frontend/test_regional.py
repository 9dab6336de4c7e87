"""Regional compilation (runtime/subgraphs.py): the block of `torch.compiler.nested_compile_region`
is compiled once, with fused kernels, however many layers call it; inference and training
match eager."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import torchfuse
from torchfuse import counters

pytestmark = pytest.mark.skipif(not hasattr(torch.compiler, "nested_compile_region"),
                                reason="torch without nested_compile_region")


class Block(nn.Module):
    def __init__(self, width: int = 48):
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.fc = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + F.gelu(self.fc(self.norm(x)))


@torch.compiler.nested_compile_region
def _block(block: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return block(x)


def _model(blocks: nn.ModuleList, x: torch.Tensor) -> torch.Tensor:
    for b in blocks:
        x = _block(b, x)
    return x


def _compile_counts(layers: int, train: bool) -> tuple[int, int, nn.ModuleList, nn.ModuleList]:
    torch._dynamo.reset()
    torch.manual_seed(0)
    blocks = nn.ModuleList(Block() for _ in range(layers))
    ref = copy.deepcopy(blocks)
    x = torch.randn(6, 48, requires_grad=train)
    graphs, kernels = counters["graphs_compiled"], counters["kernels_generated"]
    f = torch.compile(_model, backend="torchfuse")
    with torch.set_grad_enabled(train):
        out = f(blocks, x)
        x_ref = x.detach().clone().requires_grad_(train)
        expected = _model(ref, x_ref)
        torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    if train:
        out.square().mean().backward()
        expected.square().mean().backward()
        torch.testing.assert_close(x.grad, x_ref.grad, atol=1e-5, rtol=1e-5)
        for p, q in zip(blocks.parameters(), ref.parameters()):
            torch.testing.assert_close(p.grad, q.grad, atol=1e-5, rtol=1e-5)
    return counters["graphs_compiled"] - graphs, counters["kernels_generated"] - kernels, blocks, ref


@pytest.mark.parametrize("train", [False, True])
def test_block_compiled_once_for_every_layer(train):
    graphs2, kernels2, _, _ = _compile_counts(2, train)
    graphs6, kernels6, _, _ = _compile_counts(6, train)
    # the outer graph and the block's graph (forward and backward in training), whatever the depth
    assert graphs2 == graphs6 == (4 if train else 2), (graphs2, graphs6)
    assert kernels2 == kernels6 >= (2 if train else 1), (kernels2, kernels6)
