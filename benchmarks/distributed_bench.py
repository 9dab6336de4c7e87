"""Data-parallel training with torchfuse: DistributedDataParallel and FSDP2 (`fully_shard` per
block) on several GPUs (NCCL) or CPU processes (gloo), eager / Inductor / torchfuse side by side.

    python benchmarks/distributed_bench.py --device cuda --world 2 --only gpt2,resnet50
    python benchmarks/distributed_bench.py --device cpu --world 2 --size tiny --steps 3   # a check
    python benchmarks/distributed_bench.py --fsdp-tp --world 4 --tp 2        # 2-D: fsdp_tp_llama.py
    python benchmarks/distributed_bench.py --cpu-gloo                       # the same, tiny, on CPU

Models are the zoo's (zoo_models.py, training mode, fp32, TF32 off), at the zoo's "gpu" size on
CUDA: the zoo's batch is the global batch, each rank runs its 1/world slice.  Per (model,
strategy, backend), in one process group:
  * correctness: parameters after CHECK_STEPS SGD steps against one process running the same
    global batch as `world` micro-batches with gradients accumulated (what data parallelism
    computes: a batch norm normalizes each rank's slice), judged by the largest relative L2
    error over the parameters, next to the same reference run twice (its own run-to-run spread);
  * first step seconds (compile included), then ms per step over --steps steps (CUDA-synced),
    samples per second of the global batch, and the peak memory allocated per GPU;
  * the graphs Dynamo compiled (DDP's bucket boundaries split graphs: torch's DDPOptimizer).

DDP wraps the model and the wrapper is compiled (`torch.compile(DDP(model))`, so Dynamo splits the
graph at bucket boundaries); FSDP2 shards each block (children of an nn.ModuleList, and blocks of
nn.Sequential stages) and the root, and each block is compiled (`block.compile()`, as torchtitan
does: FSDP2's hooks run between compiled blocks).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import socket
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

os.environ.setdefault("TORCHFUSE_FIRST_CALLS", "wait")   # timings are of compiled graphs, not the ATen tier
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
import torch.nn as nn  # noqa: E402

import torchfuse  # noqa: E402,F401  (registers the backend)
from zoo_models import BY_NAME  # noqa: E402

CHECK_STEPS = 3
LR = 1e-3


def _slice(inputs: tuple, rank: int, world: int) -> tuple:
    return tuple(x.chunk(world)[rank] for x in inputs)


def _blocks(model: nn.Module) -> list[nn.Module]:
    """The modules FSDP2 shards one by one: children of an nn.ModuleList (transformer layers) and
    the non-leaf children of an nn.Sequential (a ResNet stage's blocks), outermost only."""
    found: list[nn.Module] = []
    for m in model.modules():
        if isinstance(m, nn.ModuleList):
            found += list(m.children())
        elif isinstance(m, nn.Sequential):
            found += [c for c in m.children() if list(c.children()) and not isinstance(c, nn.Sequential)
                      and any(True for _ in c.parameters())]
    inner = {id(d) for b in found for d in b.modules() if d is not b}
    return [b for b in found if id(b) not in inner]


def _compiler(backend: str):
    if backend == "eager":
        return None
    return {"backend": "inductor"} if backend == "inductor" else {"backend": "torchfuse"}


def _wrap(model: nn.Module, strategy: str, backend: str, device: torch.device):
    """(the callable a step runs, the module whose state_dict holds the full parameters)."""
    kwargs = _compiler(backend)
    if strategy == "ddp":
        ddp = nn.parallel.DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
        return (torch.compile(ddp, **kwargs) if kwargs else ddp), model
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    # FSDP2 shards contiguous parameters only (a channels-last conv weight raises in eager too):
    # weights go back to contiguous, inputs stay channels-last
    model.to(memory_format=torch.contiguous_format)
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    for block in _blocks(model):
        if kwargs:
            block.compile(**kwargs)
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, model


def _full_state(model: nn.Module, strategy: str) -> dict[str, torch.Tensor]:
    state = {}
    for name, p in model.named_parameters():
        t = p.full_tensor() if strategy == "fsdp" else p
        state[name] = t.detach().float().cpu().clone()
    return state


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _run_one(name: str, strategy: str, backend: str, args, device: torch.device) -> tuple[dict, dict]:
    zm = BY_NAME[name]
    rank, world = dist.get_rank(), dist.get_world_size()
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    model, inputs = zm.make(args.size, device, torch.float32)
    model.train()
    mine = _slice(inputs, rank, world)
    fn, holder = _wrap(model, strategy, backend, device)
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9, foreach=True)

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        zm.loss(fn(*mine), mine).backward()
        opt.step()

    t0 = time.perf_counter()
    step()
    _sync(device)
    first_s = time.perf_counter() - t0
    for _ in range(CHECK_STEPS - 1):
        step()
    state = _full_state(holder, strategy)
    _sync(device)
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(args.steps):
        step()
    _sync(device)
    ms = (time.perf_counter() - t0) * 1e3 / args.steps
    if args.profile:      # every rank steps (the collectives need them all), rank 0 profiles
        _profile(step, args.profile, device, f"{name} {strategy} {backend}", report=rank == 0,
                 trace_dir=args.trace_dir)
    times = [torch.tensor([ms], device=device)]
    # a step is as slow as its slowest rank
    dist.all_reduce(times[0], op=dist.ReduceOp.MAX)
    peak = torch.cuda.max_memory_allocated(device) / 2 ** 20 if device.type == "cuda" else 0.0
    graphs = int(torch._dynamo.utils.counters["stats"].get("unique_graphs", 0))
    result = dict(model=name, strategy=strategy, backend=backend, first_s=first_s, ms=times[0].item(),
                  samples_s=inputs[0].shape[0] / (times[0].item() / 1e3), peak_mib=peak, graphs=graphs)
    del fn, holder, model, opt
    return result, state


def _profile(step, steps: int, device: torch.device, title: str, report: bool, top: int = 12,
             trace_dir: str | None = None) -> None:
    """GPU time per step by kernel, printed by the rank that reports (the others only step: the
    collectives need them all): wall ms per step, the compute kernels' time apart from NCCL's
    (the two overlap), time by kernel group, and the top kernels.  With `trace_dir`, host ops
    are recorded too, the costliest printed by self time, and a Chrome trace is written there."""
    from torch.profiler import ProfilerActivity, profile
    _sync(device)
    if not report:
        for _ in range(steps):
            step()
        _sync(device)
        return
    activities = [ProfilerActivity.CUDA] + ([ProfilerActivity.CPU] if trace_dir else [])
    t0 = time.perf_counter()
    with profile(activities=activities) as prof:
        for _ in range(steps):
            step()
        _sync(device)
    wall = (time.perf_counter() - t0) * 1e3 / steps
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "probes"))
    from zoo_profile import cuda_kernels, top_lines   # the zoo probe's table
    kernels = cuda_kernels(prof, steps)
    groups = {"gemm": ("gemm", "cutlass", "sm90", "nvjet", "cublas"), "attention": ("flash", "fmha", "attention"),
              "nccl": ("nccl",)}
    by_group = {g: sum(v[0] for n, v in kernels.items() if any(w in n.lower() for w in words))
                for g, words in groups.items()}
    busy = sum(v[0] for v in kernels.values())
    by_group["other (fused, ATen elementwise)"] = busy - sum(by_group.values())
    print(f"## profile {title}: wall {wall:.2f} ms/step (profiled), compute kernels "
          f"{busy - by_group['nccl']:.2f} ms/step, NCCL {by_group['nccl']:.2f}, "
          f"{sum(v[1] for v in kernels.values()):.0f} kernels/step; "
          + ", ".join(f"{g} {ms:.2f}" for g, ms in by_group.items()), flush=True)
    print("\n".join(top_lines(kernels, top)), flush=True)
    if trace_dir:       # host ops too: where a host-bound step's time goes
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=top * 2,
                                        max_name_column_width=70), flush=True)
        os.makedirs(trace_dir, exist_ok=True)
        prof.export_chrome_trace(os.path.join(trace_dir, f"{title.replace(' ', '_')}.json"))


def _reference(name: str, args, device: torch.device, world: int) -> dict[str, torch.Tensor]:
    """One process, the global batch as `world` micro-batches, gradients accumulated."""
    zm = BY_NAME[name]
    model, inputs = zm.make(args.size, device, torch.float32)
    model.train()
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9, foreach=True)
    for _ in range(CHECK_STEPS):
        opt.zero_grad(set_to_none=True)
        for r in range(world):
            part = _slice(inputs, r, world)
            (zm.loss(model(*part), part) / world).backward()
        opt.step()
    return {n: p.detach().float().cpu().clone() for n, p in model.named_parameters()}


def _error(state: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> tuple[float, str]:
    """Largest relative L2 error over the parameters (a parameter near zero against the overall
    parameter norm's share, as the zoo's gradient rule does), and that parameter's name."""
    total = math.sqrt(sum(r.double().norm().item() ** 2 for r in ref.values()))
    count = sum(r.numel() for r in ref.values())
    worst, where = 0.0, ""
    for n, r in ref.items():
        floor = 1e-2 * total * math.sqrt(r.numel() / count)
        err = (state[n].double() - r.double()).norm().item() / max(r.double().norm().item(), floor, 1e-30)
        if err > worst:
            worst, where = err, n
    return worst, where


def _worker(rank: int, args, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if args.device == "cuda":
        torch.cuda.set_device(rank)
        device = torch.device("cuda", rank)
    else:
        device = torch.device("cpu")
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    dist.init_process_group("nccl" if args.device == "cuda" else "gloo", rank=rank, world_size=args.world)
    results = []
    try:
        for name in args.only.split(","):
            states = {}
            for strategy in args.strategies.split(","):
                for backend in args.backends.split(","):
                    try:
                        res, state = _run_one(name, strategy, backend, args, device)
                        states[(strategy, backend)] = state
                    except Exception as e:   # keep going; the table says what failed
                        res = dict(model=name, strategy=strategy, backend=backend, error=f"{type(e).__name__}: {e}"[:300])
                    results.append(res)
                    if rank == 0:
                        print(json.dumps(res), flush=True)
            if rank == 0:
                ref = _reference(name, args, device, args.world)
                # the reference against itself run again: how far apart two runs of the same
                # program land (cuDNN's and cuBLAS's non-deterministic reductions, amplified by
                # train-mode batch norm), the floor for the errors above
                noise = _error(_reference(name, args, device, args.world), ref)[0]
                for res in results:
                    key = (res["strategy"], res["backend"])
                    if res["model"] == name and key in states:
                        res["param_err"], res["worst_param"] = _error(states[key], ref)
                        res["ref_noise"] = noise
        if rank == 0:
            with open(out, "w") as f:
                json.dump(results, f)
    finally:
        dist.destroy_process_group()


def _table(results: list[dict], args) -> str:
    lines = [f"<!-- python benchmarks/distributed_bench.py --device {args.device} --world {args.world} "
             f"--only {args.only} --steps {args.steps} -->",
             "| model | strategy | backend | ms / step | samples/s | vs Inductor | vs eager | first step s | "
             "peak MiB / GPU | graphs | param error vs 1 process (worst parameter) | 1 process vs itself |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    by = {(r["model"], r["strategy"], r["backend"]): r for r in results}
    for r in results:
        if "error" in r:
            lines.append(f"| {r['model']} | {r['strategy']} | {r['backend']} | failed: {r['error'][:120]} |")
            continue
        ratio = lambda other: (f"{by[(r['model'], r['strategy'], other)]['ms'] / r['ms']:.2f}"
                               if "ms" in by.get((r["model"], r["strategy"], other), {}) else "-")
        lines.append(f"| {r['model']} | {r['strategy']} | {r['backend']} | {r['ms']:.2f} | {r['samples_s']:.1f} | "
                     f"{ratio('inductor')} | {ratio('eager')} | {r['first_s']:.1f} | {r['peak_mib']:.0f} | "
                     f"{r['graphs']} | {r.get('param_err', float('nan')):.1e} ({r.get('worst_param', '-')}) | "
                     f"{r.get('ref_noise', float('nan')):.1e} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--only", default="gpt2,resnet50", help="comma-separated zoo models")
    ap.add_argument("--strategies", default="ddp,fsdp")
    ap.add_argument("--backends", default="eager,inductor,torchfuse")
    ap.add_argument("--size", choices=("tiny", "cpu", "gpu"), default=None,
                    help='zoo size (default: "gpu" on cuda, "tiny" on cpu)')
    ap.add_argument("--steps", type=int, default=20, help="timed steps")
    ap.add_argument("--out", help="write the markdown table to this file")
    ap.add_argument("--profile", type=int, default=0, metavar="N",
                    help="after timing, print rank 0's GPU kernels over N steps (torch.profiler)")
    ap.add_argument("--trace-dir", default=None,
                    help="--profile: also record host ops and write rank 0's Chrome trace per run here")
    ap.add_argument("--tf-options", default="", help="--fsdp-tp: torchfuse's options, as JSON")
    ap.add_argument("--fsdp-tp", action="store_true",
                    help="FSDP2 x tensor parallel Llama-style training instead of the zoo (fsdp_tp_llama.py)")
    ap.add_argument("--tp", type=int, default=2, help="--fsdp-tp: tensor-parallel ranks (the rest is FSDP2)")
    ap.add_argument("--cpu-gloo", action="store_true",
                    help="--fsdp-tp smoke run: tiny model, CPU, gloo, 4 processes (2 x 2), 4 steps")
    ap.add_argument("--bf16", action=argparse.BooleanOptionalAction, default=None,
                    help="--fsdp-tp: bf16 parameters, fp32 reduction (default: on CUDA only)")
    args = ap.parse_args()
    if args.cpu_gloo:
        args.fsdp_tp, args.device, args.world, args.size = True, "cpu", 4, args.size or "tiny"
        args.steps = min(args.steps, 4)
    args.size = args.size or ("gpu" if args.device == "cuda" else "tiny")
    if args.fsdp_tp:
        args.bf16 = args.device == "cuda" if args.bf16 is None else args.bf16
        return _main_fsdp_tp(args)
    results = _spawn(_worker, args)
    table = _table(results, args)
    print(table)
    if args.out:
        with open(args.out, "w") as f:
            f.write(table + "\n")


def _spawn(worker, args) -> list:
    """`worker(rank, args, port, out)` on `args.world` processes; rank 0's results, from `out`."""
    import tempfile
    if args.device == "cuda" and torch.cuda.device_count() < args.world:
        sys.exit(f"--world {args.world} needs {args.world} GPUs; {torch.cuda.device_count()} visible")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "results.json")
        mp.spawn(worker, args=(args, port, out), nprocs=args.world)
        with open(out) as f:
            return json.load(f)


def _main_fsdp_tp(args) -> None:
    import fsdp_tp_llama
    if args.world % args.tp:
        sys.exit(f"--world {args.world} is not a multiple of --tp {args.tp}")
    results = _spawn(fsdp_tp_llama.worker, args)
    cfg = fsdp_tp_llama.SIZES[args.size]
    header = (f"<!-- python benchmarks/distributed_bench.py --fsdp-tp --device {args.device} --world {args.world} "
              f"--tp {args.tp} --size {args.size} --steps {args.steps}{' --bf16' if args.bf16 else ''} -->\n"
              f"Llama-style, {cfg.layers} layers, dim {cfg.dim}, {cfg.seq} tokens x {cfg.batch} sequences per step, "
              f"mesh {args.world // args.tp} (FSDP2) x {args.tp} (TP)"
              + (f", {results[0]['params_m']:.3g} M parameters" if results and "params_m" in results[0] else ""))
    table = fsdp_tp_llama.table(results, header)
    print(table)
    for r in results:
        if "losses" in r:
            print(f"loss {r['backend']}: " + " ".join(f"{x:.4f}" for x in r["losses"]))
    if args.out:
        with open(args.out, "w") as f:
            f.write(table + "\n")


if __name__ == "__main__":
    main()
