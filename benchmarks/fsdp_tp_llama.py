"""FSDP2 x tensor-parallel training of a Llama-style model (the torchtitan recipe), eager /
Inductor / torchfuse: `distributed_bench.py --fsdp-tp` (GPUs, NCCL) or `--cpu-gloo` (a tiny
model on CPU, 4 processes: a smoke run).

The ranks form a (dp, tp) DeviceMesh.  Tensor parallelism over "tp" (`parallelize_module`):
token embedding row-wise into sequence-sharded activations, each block's norms sequence
parallel, q/k/v and the MLP's w1/w3 column-wise, o and w2 row-wise back to sequence-sharded
(so each block's graphs all-gather and reduce-scatter), the output projection column-wise to
replicated logits.  FSDP2 (`fully_shard`) over "dp" shards each block and the root, with bf16
parameters and fp32 gradient reduction (`MixedPrecisionPolicy`; on CPU fp32 unless --bf16).
Each block is compiled on its own (`block.compile`, static shapes), as torchtitan does;
FSDP2's hooks run between compiled blocks.  AdamW, fixed random
tokens per step (each dp rank its rows).  Per backend: the first step's seconds (compile
included), tokens per second over the steps after the third, peak memory allocated per GPU
(the largest rank's), and the loss of every step (averaged over dp ranks), compared with
eager's curve.
"""
from __future__ import annotations

import gc
import math
import os
import time
from dataclasses import dataclass

os.environ.setdefault("TORCHFUSE_FIRST_CALLS", "wait")   # timings are of compiled graphs, not the ATen tier
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F


@dataclass(frozen=True)
class LlamaConfig:
    dim: int
    layers: int
    heads: int
    hidden: int
    vocab: int
    seq: int
    batch: int          # global batch (sequences), split over the dp ranks


SIZES = {
    # ~1.06 B parameters: 18 layers x 51.4 M + embedding and output 2 x 65.5 M
    "gpu": LlamaConfig(dim=2048, layers=18, heads=16, hidden=5632, vocab=32000, seq=2048, batch=8),
    "tiny": LlamaConfig(dim=64, layers=2, heads=4, hidden=96, vocab=128, seq=16, batch=4),
}


def rotary(cfg: LlamaConfig, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of the rotary embedding, [seq, head_dim] (rotate-half form, real valued)."""
    half = cfg.dim // cfg.heads // 2
    freqs = 1.0 / (10000.0 ** (torch.arange(half, dtype=torch.float32, device=device) / half))
    angles = torch.outer(torch.arange(cfg.seq, dtype=torch.float32, device=device), freqs)
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos(), angles.sin()


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return (x * cos + torch.cat([-x2, x1], dim=-1) * sin).type_as(x)


class RMSNorm(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        return (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)).type_as(x) * self.weight


class Attention(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.head_dim = cfg.dim // cfg.heads
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(cfg.dim, cfg.dim, bias=False) for _ in range(4))

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        # -1: this rank's heads (q/k/v are column-wise sharded by heads)
        q, k, v = (w(x).view(b, t, -1, self.head_dim).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        q, k = _rope(q, cos, sin), _rope(k, cos, sin)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(o.transpose(1, 2).reshape(b, t, -1))


class FeedForward(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.w1 = nn.Linear(cfg.dim, cfg.hidden, bias=False)
        self.w3 = nn.Linear(cfg.dim, cfg.hidden, bias=False)
        self.w2 = nn.Linear(cfg.hidden, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.attention_norm, self.attention = RMSNorm(cfg.dim), Attention(cfg)
        self.ffn_norm, self.feed_forward = RMSNorm(cfg.dim), FeedForward(cfg)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), cos, sin)
        return h + self.feed_forward(self.ffn_norm(h))


class Llama(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(cfg.vocab, cfg.dim)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
        self.norm = RMSNorm(cfg.dim)
        self.output = nn.Linear(cfg.dim, cfg.vocab, bias=False)

    def forward(self, tokens: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = layer(h, cos, sin)
        return self.output(self.norm(h))


def parallelize(model: Llama, mesh, mixed_precision: bool) -> None:
    """torchtitan's plan: tensor parallel (sequence parallel norms) over mesh["tp"], FSDP2 over
    mesh["dp"]."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                                   SequenceParallel, parallelize_module)
    tp, dp = mesh["tp"], mesh["dp"]
    if tp.size() > 1:
        parallelize_module(model, tp, {
            "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
            "norm": SequenceParallel(),
            "output": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate())})
        for block in model.layers:
            parallelize_module(block, tp, {
                "attention_norm": SequenceParallel(), "ffn_norm": SequenceParallel(),
                "attention": PrepareModuleInput(input_layouts=(Shard(1), None, None),
                                                desired_input_layouts=(Replicate(), None, None)),
                "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
                **{f"attention.{w}": ColwiseParallel() for w in ("wq", "wk", "wv")},
                "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
                "feed_forward.w1": ColwiseParallel(), "feed_forward.w3": ColwiseParallel(),
                "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1))})
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if mixed_precision \
        else MixedPrecisionPolicy()
    for block in model.layers:
        fully_shard(block, mesh=dp, mp_policy=policy)
    fully_shard(model, mesh=dp, mp_policy=policy)


def _batch(cfg: LlamaConfig, step: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    tokens = torch.randint(0, cfg.vocab, (cfg.batch, cfg.seq + 1), generator=g)
    return tokens[:, :-1].to(device), tokens[:, 1:].to(device)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run(backend: str, cfg: LlamaConfig, mesh, device: torch.device, steps: int, mixed: bool,
        profile_steps: int = 0, trace_dir: str | None = None, tf_options: dict | None = None) -> dict:
    """Train `steps` steps with `backend` ("eager", "inductor", "torchfuse"), bf16 mixed
    precision if `mixed`; the measurements.  With `profile_steps`, rank 0 then profiles that
    many more steps (`distributed_bench._profile`); `tf_options`: torchfuse's options."""
    torch._dynamo.reset()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    torch.manual_seed(0)
    with torch.device(device):
        model = Llama(cfg)
    parallelize(model, mesh, mixed_precision=mixed)
    if backend != "eager":
        compiler = backend
        if backend == "torchfuse" and tf_options:
            import torchfuse
            compiler = torchfuse.backend(options=tf_options)
        for block in model.layers:
            block.compile(backend=compiler, dynamic=False)
    cos, sin = rotary(cfg, device)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, foreach=True)
    dp, dp_rank = mesh["dp"].size(), mesh["dp"].get_local_rank()
    rows = slice(dp_rank * cfg.batch // dp, (dp_rank + 1) * cfg.batch // dp)
    losses, times = [], []

    def train_step(step: int) -> torch.Tensor:
        tokens, labels = _batch(cfg, step, device)
        logits = model(tokens[rows], cos, sin)
        loss = F.cross_entropy(logits.float().flatten(0, 1), labels[rows].flatten())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    gc_s = [0.0, 0.0]          # seconds in Python's garbage collector during the timed steps

    def gc_timer(phase: str, info: dict) -> None:
        if phase == "start":
            gc_s[1] = time.perf_counter()
        elif gc_s[1]:
            gc_s[0] += time.perf_counter() - gc_s[1]
    for step in range(steps):
        _sync(device)
        if step == 3:
            gc.callbacks.append(gc_timer)
        t0 = time.perf_counter()
        loss = train_step(step)
        _sync(device)
        times.append(time.perf_counter() - t0)
        losses.append(loss)
    if gc_timer in gc.callbacks:
        gc.callbacks.remove(gc_timer)
    load1 = os.getloadavg()[0]        # other processes busy on the host during the steps?
    if profile_steps and device.type == "cuda":
        from distributed_bench import _profile      # (it imports this module only inside a function)
        _profile(lambda: train_step(steps), profile_steps, device, f"fsdp_tp {backend}",
                 report=dist.get_rank() == 0, top=15, trace_dir=trace_dir)
    # the loss of the global batch: the mean over dp ranks (tp ranks hold the same value)
    curve = torch.stack(losses).float()
    dist.all_reduce(curve, group=mesh["dp"].get_group())
    curve = (curve / dp).tolist()
    timed = times[3:] if len(times) > 3 else times[1:] or times
    # a step is as slow as its slowest rank; memory: the largest rank's peak
    stats = torch.tensor([sum(timed) / len(timed), times[0], gc_s[0] / max(1, steps - 3),
                          torch.cuda.max_memory_allocated(device) / 2 ** 20 if device.type == "cuda" else 0.0],
                         dtype=torch.float64, device=device)
    dist.all_reduce(stats, op=dist.ReduceOp.MAX)
    step_s, first_s, gc_step_s, peak = stats.tolist()
    params = sum(p.numel() for p in model.parameters())    # (the DTensors' global sizes)
    del model, opt
    return dict(backend=backend, params_m=params / 1e6, first_s=first_s, ms=step_s * 1e3,
                tokens_s=cfg.batch * cfg.seq / step_s, peak_mib=peak, gc_ms=gc_step_s * 1e3, load1=load1,
                losses=curve)


def table(results: list[dict], header: str) -> str:
    """A markdown table: one row per backend, the loss curves against eager's."""
    eager = next((r for r in results if r.get("backend") == "eager" and "losses" in r), None)
    lines = [header, "| backend | ms / step | tokens/s | vs Inductor | first step s | peak MiB / GPU | "
             "Python gc ms / step | loss step 1 -> last | max loss diff vs eager |", "|---|---|---|---|---|---|---|---|---|"]
    ind = next((r for r in results if r.get("backend") == "inductor" and "ms" in r), None)
    for r in results:
        if "error" in r:
            lines.append(f"| {r['backend']} | failed: {r['error'][:160]} |")
            continue
        diff = max(abs(a - b) for a, b in zip(r["losses"], eager["losses"])) if eager else math.nan
        vs = f"{r['tokens_s'] / ind['tokens_s']:.2f}" if ind else "-"
        lines.append(f"| {r['backend']} | {r['ms']:.1f} | {r['tokens_s']:.0f} | {vs} | {r['first_s']:.1f} | "
                     f"{r['peak_mib']:.0f} | {r.get('gc_ms', math.nan):.1f} | {r['losses'][0]:.4f} -> {r['losses'][-1]:.4f} | {diff:.2e} |")
    return "\n".join(lines)


def worker(rank: int, args, port: int, out: str) -> None:
    """One rank of `distributed_bench.py --fsdp-tp`: every backend in turn, results to `out` (rank 0)."""
    import json
    import os
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if args.device == "cuda":
        torch.cuda.set_device(rank)
        device = torch.device("cuda", rank)
    else:
        device = torch.device("cpu")
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // args.world))
    dist.init_process_group("nccl" if args.device == "cuda" else "gloo", rank=rank, world_size=args.world)
    try:
        from torch.distributed.device_mesh import init_device_mesh
        mesh = init_device_mesh(device.type, (args.world // args.tp, args.tp), mesh_dim_names=("dp", "tp"))
        cfg = SIZES[args.size]
        results = []
        for backend in args.backends.split(","):
            try:
                res = run(backend, cfg, mesh, device, args.steps, args.bf16,
                          profile_steps=args.profile, trace_dir=args.trace_dir,
                          tf_options=json.loads(args.tf_options) if args.tf_options else None)
            except Exception as e:      # keep going; the table says what failed
                res = dict(backend=backend, error=f"{type(e).__name__}: {e}"[:400])
            results.append(res)
            if rank == 0:
                print(json.dumps(res), flush=True)
        if rank == 0:
            with open(out, "w") as f:
                json.dump(results, f)
    finally:
        dist.destroy_process_group()
