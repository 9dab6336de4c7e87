"""Host time per launched kernel: eager, Inductor and torchfuse side by side, in one process.

    python benchmarks/launch_bench.py [--only blocks,prefill,decode] [--steps 50] [--profile]

Workloads (CUDA, TF32 off):
  blocks   a chain of 100 blocks, each a tiny matmul ([32, 64] @ [64, 64], fp32) and one
           pointwise kernel (tanh, scale, residual add): 200 launches a call, nothing to fuse
           across the matmuls, so the host's cost per launch is all that differs;
  prefill  an 8-layer Llama-style decoder (RMSNorm, RoPE, grouped-query SDPA attention, SwiGLU;
           hidden 1024, 16 heads, 4 KV heads), bf16, batch 4 x 256 tokens, hidden states out;
  decode   one token per sequence (batch 4) on the same decoder with a static KV cache of 512
           positions: the step writes its keys and values into the cache (index_copy_) at a
           position held in a tensor, so every step has the same shapes.

Per workload and backend: kernels a step (GPU kernels, memcpys and memsets from torch.profiler),
GPU time a step (the profiler's sum of their durations), the step's wall time (back to back, one
`torch.cuda.synchronize()` after all steps), the host's enqueue time (the same loop before
that synchronize), host microseconds per launched kernel (enqueue time over kernels), and the
relative error against eager (||out - eager|| / ||eager||).  When the host enqueues slower than
the GPU runs, the wall time is the host's.  `--profile` writes a cProfile of Inductor's and
torchfuse's steps (tottime and cumulative) and torch.profiler's CPU ops by input shape to $OUT
(or the working directory) as launch_profile_<workload>_<backend>.txt.
The table is printed last.
"""
from __future__ import annotations

import argparse
import math
import os
import sys
import time
from typing import Callable

os.environ.setdefault("TORCHFUSE_FIRST_CALLS", "wait")   # timings are of compiled graphs, not the ATen tier
import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torchfuse  # noqa: E402,F401  (registers the backend)
from profile_text import cprofile_text  # noqa: E402


def _register() -> None:
    """`backend="torchfuse"` without an installed entry point (the source tree on PYTHONPATH)."""
    from torch._dynamo import list_backends, register_backend
    if "torchfuse" not in list_backends(exclude_tags=()):
        from torchfuse.frontend.dynamo import torchfuse_backend
        register_backend(torchfuse_backend, name="torchfuse")


# ---------------------------------------------------------------------------------------------
# workloads
# ---------------------------------------------------------------------------------------------
class Chain(torch.nn.Module):
    """100 x (tiny matmul, then one pointwise kernel): tanh(x @ w) * 0.5 + x."""

    def __init__(self, n: int = 100, d: int = 64):
        super().__init__()
        self.ws = torch.nn.ParameterList([torch.nn.Parameter(torch.randn(d, d) / math.sqrt(d)) for _ in range(n)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for w in self.ws:
            x = torch.tanh(x @ w) * 0.5 + x
        return x


class RMSNorm(torch.nn.Module):
    def __init__(self, d: int, eps: float = 1e-6):
        super().__init__()
        self.weight, self.eps = torch.nn.Parameter(1 + 0.1 * torch.randn(d)), eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        return (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype) * self.weight


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    a, b = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-b, a), dim=-1) * sin


class Layer(torch.nn.Module):
    def __init__(self, d: int, heads: int, kv_heads: int, inter: int, batch: int, max_len: int):
        super().__init__()
        self.heads, self.kv_heads, self.hd = heads, kv_heads, d // heads
        self.q = torch.nn.Linear(d, d, bias=False)
        self.kv = torch.nn.Linear(d, 2 * kv_heads * self.hd, bias=False)
        self.o = torch.nn.Linear(d, d, bias=False)
        self.gate_up = torch.nn.Linear(d, 2 * inter, bias=False)
        self.down = torch.nn.Linear(inter, d, bias=False)
        self.n1, self.n2 = RMSNorm(d), RMSNorm(d)
        self.register_buffer("cache_k", torch.randn(batch, kv_heads, max_len, self.hd), persistent=False)
        self.register_buffer("cache_v", torch.randn(batch, kv_heads, max_len, self.hd), persistent=False)

    def _repeat(self, t: torch.Tensor) -> torch.Tensor:
        b, h, s, hd = t.shape
        rep = self.heads // self.kv_heads
        return t[:, :, None].expand(b, h, rep, s, hd).reshape(b, h * rep, s, hd)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, pos: torch.Tensor | None,
                mask: torch.Tensor | None) -> torch.Tensor:
        b, s, d = x.shape
        h = self.n1(x)
        q = self.q(h).view(b, s, self.heads, self.hd).transpose(1, 2)
        k, v = self.kv(h).view(b, s, 2, self.kv_heads, self.hd).permute(2, 0, 3, 1, 4)
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        if pos is None:          # prefill: attention over the prompt, causal
            a = F.scaled_dot_product_attention(q, self._repeat(k), self._repeat(v), is_causal=True)
        else:                    # decode: write this step's keys and values, attend to the cache
            self.cache_k.index_copy_(2, pos, k)
            self.cache_v.index_copy_(2, pos, v)
            a = F.scaled_dot_product_attention(q, self._repeat(self.cache_k), self._repeat(self.cache_v),
                                               attn_mask=mask)
        x = x + self.o(a.transpose(1, 2).reshape(b, s, d))
        g, u = self.gate_up(self.n2(x)).chunk(2, dim=-1)
        return x + self.down(F.silu(g) * u)


class Decoder(torch.nn.Module):
    def __init__(self, layers: int = 8, d: int = 1024, heads: int = 16, kv_heads: int = 4, inter: int = 2816,
                 vocab: int = 32000, batch: int = 4, max_len: int = 512):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, d)
        self.layers = torch.nn.ModuleList([Layer(d, heads, kv_heads, inter, batch, max_len) for _ in range(layers)])
        self.norm = RMSNorm(d)
        hd = d // heads
        inv = 1.0 / (10000 ** (torch.arange(0, hd, 2).float() / hd))
        freqs = torch.outer(torch.arange(max_len).float(), inv)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos", emb.cos(), persistent=False)
        self.register_buffer("sin", emb.sin(), persistent=False)
        self.register_buffer("positions", torch.arange(max_len), persistent=False)

    def forward(self, ids: torch.Tensor, pos: torch.Tensor | None = None) -> torch.Tensor:
        x = self.embed(ids)
        if pos is None:
            where = self.positions[:ids.shape[1]]
            mask = None
        else:
            where = pos
            mask = (self.positions <= pos)[None, None, None, :]
        cos, sin = self.cos[where].to(x.dtype), self.sin[where].to(x.dtype)
        for layer in self.layers:
            x = layer(x, cos, sin, pos, mask)
        return self.norm(x)


def workloads() -> dict[str, Callable[[], tuple[torch.nn.Module, tuple]]]:
    def blocks() -> tuple[torch.nn.Module, tuple]:
        return Chain().cuda(), (torch.randn(32, 64, device="cuda"),)

    def prefill() -> tuple[torch.nn.Module, tuple]:
        model = Decoder().cuda().to(torch.bfloat16)
        return model, (torch.randint(0, 32000, (4, 256), device="cuda"),)

    def decode() -> tuple[torch.nn.Module, tuple]:
        model = Decoder().cuda().to(torch.bfloat16)
        return model, (torch.randint(0, 32000, (4, 1), device="cuda"), torch.tensor([256], device="cuda"))
    return {"blocks": blocks, "prefill": prefill, "decode": decode}


# ---------------------------------------------------------------------------------------------
# measuring
# ---------------------------------------------------------------------------------------------
def _kernels_and_gpu_ms(fn: Callable, args: tuple, steps: int = 5) -> tuple[float, float]:
    """GPU kernels (and memcpys/memsets) a step and their summed duration a step (ms)."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            fn(*args)
        torch.cuda.synchronize()
    events = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    return len(events) / steps, sum(e.device_time for e in events) / steps / 1e3


def _steps(fn: Callable, args: tuple, steps: int) -> tuple[float, float]:
    """(host enqueue ms, wall ms) a step, `steps` steps back to back, one synchronize at the end."""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(steps):
        fn(*args)
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    t2 = time.perf_counter()
    return (t1 - t0) * 1e3 / steps, (t2 - t0) * 1e3 / steps


def _rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double(), ref.double()
    return float((out - ref).norm() / ref.norm().clamp_min(1e-30))


def run(name: str, make: Callable, steps: int, rounds: int, profile_dir: str | None) -> list[dict]:
    torch.manual_seed(0)
    model, args = make()
    rows = []
    with torch.no_grad():
        ref = model(*args).clone()
        for backend in ("eager", "inductor", "torchfuse"):
            torch._dynamo.reset()
            fn = model if backend == "eager" else torch.compile(model, backend=backend)
            t0 = time.perf_counter()
            out = fn(*args)
            torch.cuda.synchronize()
            first = time.perf_counter() - t0
            for _ in range(5):
                out = fn(*args)
            err = _rel_err(out, ref)
            kernels, gpu_ms = _kernels_and_gpu_ms(fn, args)
            # several rounds, best kept: the host is shared and noisy
            host_ms, wall_ms = min(_steps(fn, args, steps) for _ in range(rounds))
            rows.append(dict(workload=name, backend=backend, kernels=kernels, gpu_ms=gpu_ms, wall_ms=wall_ms,
                             host_ms=host_ms, host_us_per_kernel=1e3 * host_ms / max(kernels, 1), err=err,
                             first_s=first))
            if profile_dir is not None and backend != "eager":
                stats = cprofile_text(lambda: fn(*args), steps)
                from torch.profiler import ProfilerActivity, profile

                from torchfuse.backends.triton import launch as triton_launch
                with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
                    for _ in range(5):
                        fn(*args)
                    torch.cuda.synchronize()
                ops = prof.key_averages(group_by_input_shape=True).table(sort_by="self_cpu_time_total", row_limit=25,
                                                                          max_name_column_width=50)
                with open(os.path.join(profile_dir, f"launch_profile_{name}_{backend}.txt"), "w") as f:
                    f.write(f"verified launcher conventions: {triton_launch._trusted}\n" + stats
                            + "\n\ntorch.profiler, CPU self time, 5 steps, by input shape\n" + ops)
    return rows


def table(rows: list[dict]) -> str:
    head = (f"{'workload':9} {'backend':10} {'kernels':>7} {'gpu ms':>7} {'wall ms':>8} {'host ms':>8} "
            f"{'host us/kernel':>14} {'vs inductor':>11} {'rel err':>8} {'first s':>7}")
    out = [head, "-" * len(head)]
    ind = {r["workload"]: r for r in rows if r["backend"] == "inductor"}
    for r in rows:
        ratio = ind[r["workload"]]["wall_ms"] / r["wall_ms"] if r["workload"] in ind else float("nan")
        out.append(f"{r['workload']:9} {r['backend']:10} {r['kernels']:7.0f} {r['gpu_ms']:7.3f} {r['wall_ms']:8.3f} "
                   f"{r['host_ms']:8.3f} {r['host_us_per_kernel']:14.2f} {ratio:10.2f}x {r['err']:8.1e} "
                   f"{r['first_s']:7.1f}")
    return "\n".join(out)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--only", default="blocks,prefill,decode")
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--profile", action="store_true", help="cProfile the compiled steps (written to $OUT or .)")
    a = p.parse_args()
    _register()
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    torch._dynamo.config.cache_size_limit = 64
    profile_dir = (os.environ.get("OUT") or ".") if a.profile else None
    rows = []
    for name in a.only.split(","):
        rows += run(name, workloads()[name], a.steps, a.rounds, profile_dir)
        print(table(rows), flush=True)
    print(f"\n{torch.cuda.get_device_name()}, torch {torch.__version__}, "
          f"triton {__import__('triton').__version__}\n" + table(rows))


if __name__ == "__main__":
    main()
