"""Compiled models under data parallelism, on CPU with the gloo backend and 2 processes:
`DistributedDataParallel(torchfuse.compile(model))` and a model sharded with FSDP2
(`fully_shard`) whose forward is compiled.  After 3 SGD steps on each rank's half of every batch the parameters
equal a single-process reference's on the whole batch, and every rank ran fused kernels."""
from __future__ import annotations

import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                                reason="needs torch.distributed with gloo")
WORLD = 2
STEPS = 3


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.norm, self.fc2, self.head = nn.Linear(16, 32), nn.LayerNorm(32), nn.Linear(32, 32), nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # written out, not nn.Sequential's loop: a graph break inside a loop (FSDP2's hooks on the
        # sharded layers) makes Dynamo run the whole frame eagerly
        h = F.gelu(self.norm(self.fc1(x)))
        h = F.relu(self.fc2(h) * 0.5 + h)
        return self.head(h)


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return MLP()


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(8 * WORLD, 16, generator=g), torch.randn(8 * WORLD, 4, generator=g)


def _worker(rank: int, kind: str, port: int, out_dir: str, cache_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), TORCHFUSE_CACHE_DIR=cache_dir)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    try:
        import torchfuse
        from torchfuse import counters
        model = make_model()
        if kind == "ddp":
            # the compiled model inside DDP: Dynamo does not trace DDP's own forward (it calls
            # the module from a function Dynamo skips), so torch.compile(DDP(model)) would run
            # the model eagerly; gradients are reduced by DDP's hooks either way
            wrapped = nn.parallel.DistributedDataParallel(torchfuse.compile(model))
        else:
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.fsdp import fully_shard
            mesh = init_device_mesh("cpu", (WORLD,))
            for layer in (model.fc1, model.fc2, model.head):
                fully_shard(layer, mesh=mesh)
            wrapped = fully_shard(model, mesh=mesh)
            # FSDP2's hooks are skipped by Dynamo (torch._dynamo.config.skip_fsdp_hooks), so a
            # compiled root would graph-break into eager mode: compile the forward itself, which
            # runs between the hooks on unsharded parameters
            model.forward = torchfuse.compile(model.forward)
        compiled = wrapped
        opt = torch.optim.SGD(wrapped.parameters(), lr=0.1)
        for step in range(STEPS):
            x, y = batch(step)
            mine = slice(rank * 8, (rank + 1) * 8)
            F.mse_loss(compiled(x[mine]), y[mine]).backward()
            opt.step()
            opt.zero_grad()
        state = model.state_dict()
        if kind == "fsdp":
            state = {k: v.full_tensor() for k, v in state.items()}
        torch.save({"state": state, "kernels": counters["kernels_generated"], "all": dict(counters),
                    "dynamo": {k: dict(v) for k, v in torch._dynamo.utils.counters.items()}},
                   os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("kind", ["ddp", "fsdp"])
def test_data_parallel_training_matches_one_process(kind, tmp_path):
    if kind == "fsdp":
        pytest.importorskip("torch.distributed.fsdp").__dict__.get("fully_shard") or \
            pytest.skip("no FSDP2 in this torch")
    mp.spawn(_worker, args=(kind, _free_port(), str(tmp_path), str(tmp_path / "cache")), nprocs=WORLD)
    ref = make_model()
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for step in range(STEPS):
        x, y = batch(step)
        F.mse_loss(ref(x), y).backward()
        opt.step()
        opt.zero_grad()
    for rank in range(WORLD):
        got = torch.load(tmp_path / f"rank{rank}.pt")
        assert got["kernels"] > 0, f"rank {rank} generated no kernel: {got['all']}, Dynamo: {got['dynamo']}"
        for name, value in ref.state_dict().items():
            torch.testing.assert_close(got["state"][name], value, atol=1e-5, rtol=1e-5,
                                       msg=lambda m: f"rank {rank}, {name}: {m}")
