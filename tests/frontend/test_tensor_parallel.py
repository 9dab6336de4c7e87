"""2-D parallel training with compiled blocks, on CPU with gloo and 4 processes: a tiny Llama-style
model (RMSNorm, attention with q/k/v column-wise and o row-wise, SwiGLU MLP) with tensor
parallelism (DTensor, `parallelize_module`) over one dimension of a 2 x 2 DeviceMesh and FSDP2
(`fully_shard`) over the other, each block compiled.  The first block is sequence parallel
(torchtitan's plan: its graphs all-gather and reduce-scatter), the second is not (all-reduce
after the row-wise layers; its input is gathered by a PrepareModuleInput hook traced into its
graph).  After 3 SGD steps the parameters equal one process's eager training on the whole
batch, for eager and for torchfuse; torchfuse compiled graphs that held functional
collectives, with no graph break and no graph run eagerly (strict mode)."""
from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F

from tests.frontend.test_distributed import _free_port

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                                reason="needs torch.distributed with gloo")
DP, TP = 2, 2
DIM, HEADS, HIDDEN, SEQ, BATCH, STEPS = 32, 4, 48, 6, 4, 3


class RMSNorm(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * self.weight


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(DIM, DIM, bias=False) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        # -1: the heads of this rank (q/k/v are column-wise sharded by heads)
        q, k, v = (w(x).view(b, t, -1, DIM // HEADS).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(o.transpose(1, 2).reshape(b, t, -1))


class FeedForward(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w1, self.w3 = nn.Linear(DIM, HIDDEN, bias=False), nn.Linear(DIM, HIDDEN, bias=False)
        self.w2 = nn.Linear(HIDDEN, DIM, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attention_norm, self.attention = RMSNorm(DIM), Attention()
        self.ffn_norm, self.feed_forward = RMSNorm(DIM), FeedForward()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x))
        return h + self.feed_forward(self.ffn_norm(h))


class Llama(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([Block(), Block()])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def make_model() -> Llama:
    torch.manual_seed(0)
    model = Llama()
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim == 1:          # norm weights away from 1: a wrong gradient shows
                p.uniform_(0.5, 1.5)
    return model


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(BATCH, SEQ, DIM, generator=g), torch.randn(BATCH, SEQ, DIM, generator=g)


def _parallelize(model: Llama, mesh) -> None:
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                                   SequenceParallel, parallelize_module)
    tp = mesh["tp"]
    plan = {f"attention.{w}": ColwiseParallel() for w in ("wq", "wk", "wv")}
    plan.update({"feed_forward.w1": ColwiseParallel(), "feed_forward.w3": ColwiseParallel()})
    seq_in = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
    parallelize_module(model.layers[0], tp, {   # sequence parallel: in and out sharded by tokens
        **plan, "attention_norm": SequenceParallel(), "ffn_norm": SequenceParallel(),
        "attention": seq_in, "feed_forward": seq_in,
        "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
        "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1))})
    parallelize_module(model.layers[1], tp, {**plan, "attention.wo": RowwiseParallel(),
                                             "feed_forward.w2": RowwiseParallel()})
    parallelize_module(model.layers[1], tp, PrepareModuleInput(
        input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),), use_local_output=True))
    for block in model.layers:
        fully_shard(block, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])


def _train(backend: str, mesh) -> dict[str, torch.Tensor]:
    model = make_model()
    _parallelize(model, mesh)
    if backend == "torchfuse":
        for block in model.layers:
            # dynamic=False: a recompile with automatic dynamic shapes fails in Dynamo's DTensor
            # tracing under sequence parallelism ("unhashable type: non-nested SymInt", torch 2.13,
            # aot_eager too); torchtitan compiles its blocks with static shapes as well
            block.compile(backend="torchfuse", dynamic=False, options={"strict": True})
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    dp, tp = mesh["dp"].get_local_rank(), mesh["tp"].get_local_rank()
    rows = slice(dp * BATCH // DP, (dp + 1) * BATCH // DP)
    cols = slice(tp * SEQ // TP, (tp + 1) * SEQ // TP)
    for step in range(STEPS):
        x, y = batch(step)
        # the first block takes this rank's tokens (sequence parallel), the last returns all of them
        x = x[rows, cols].requires_grad_()   # (as an embedding's output would: one graph for both blocks' calls)
        F.mse_loss(model(x), y[rows]).backward()
        opt.step()
        opt.zero_grad()
    return {k: v.full_tensor().detach().clone() for k, v in model.state_dict().items()}


def _worker(rank: int, port: int, out_dir: str, cache_dir: str, backends: tuple[str, ...] = ("eager", "torchfuse"),
            tag: str = "") -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), TORCHFUSE_CACHE_DIR=cache_dir)
    torch.set_num_threads(1)       # 4 processes on a few cores
    dist.init_process_group("gloo", rank=rank, world_size=DP * TP)
    try:
        import torchfuse
        from torch.distributed.device_mesh import init_device_mesh
        mesh = init_device_mesh("cpu", (DP, TP), mesh_dim_names=("dp", "tp"))
        states = {backend: _train(backend, mesh) for backend in backends}
        if rank in (0, DP * TP - 1):
            torch.save({"states": states, "counters": dict(torchfuse.counters),
                        "dynamo": {k: dict(v) for k, v in torch._dynamo.utils.counters.items()}},
                       os.path.join(out_dir, f"rank{rank}{tag}.pt"))
    finally:
        dist.destroy_process_group()


def test_fsdp2_tensor_parallel_training_matches_one_process(tmp_path):
    pytest.importorskip("torch.distributed.fsdp").__dict__.get("fully_shard") or pytest.skip("no FSDP2 in this torch")
    pytest.importorskip("torch.distributed.tensor.parallel")
    mp.spawn(_worker, args=(_free_port(), str(tmp_path), str(tmp_path / "cache")), nprocs=DP * TP)
    ref = make_model()
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for step in range(STEPS):
        x, y = batch(step)
        F.mse_loss(ref(x), y).backward()
        opt.step()
        opt.zero_grad()
    for rank in (0, DP * TP - 1):
        got = torch.load(tmp_path / f"rank{rank}.pt")
        counts, dynamo = got["counters"], got["dynamo"]
        assert not dynamo.get("graph_break"), dynamo["graph_break"]
        assert counts.get("eager_fallbacks", 0) == 0, counts
        # forward and backward of each block, and of the second block's input hook (FSDP2's
        # pre-forward hook, which Dynamo skips, runs between it and the block)
        assert counts["graphs_compiled"] >= 4 and counts["kernels_generated"] > 0, counts
        # all-gathers and reduce-scatters of the first block, all-reduces of the second, forward
        # and backward (16 on torch 2.13)
        assert counts.get("collectives", 0) >= 12, counts
        for backend, state in got["states"].items():
            for name, value in ref.state_dict().items():
                torch.testing.assert_close(state[name], value, atol=1e-5, rtol=1e-5,
                                           msg=lambda m: f"{backend}, rank {rank}, {name}: {m}")

    # A restart: the same processes again on the same cache load every block's graphs from the
    # graph cache (DTensor's DeviceMesh, a graph input, is keyed by its layout and group names,
    # not by its bytes: graph_cache._mesh_identity) and train to the same parameters.
    mp.spawn(_worker, args=(_free_port(), str(tmp_path), str(tmp_path / "cache"), ("torchfuse",), "-restart"),
             nprocs=DP * TP)
    for rank in (0, DP * TP - 1):
        first, again = torch.load(tmp_path / f"rank{rank}.pt"), torch.load(tmp_path / f"rank{rank}-restart.pt")
        assert again["counters"].get("graph_cache_hits", 0) >= 4, again["counters"]
        assert again["counters"].get("eager_fallbacks", 0) == 0, again["counters"]
        for name, value in first["states"]["torchfuse"].items():
            torch.testing.assert_close(again["states"]["torchfuse"][name], value, atol=0, rtol=0,
                                       msg=lambda m: f"restart, rank {rank}, {name}: {m}")
