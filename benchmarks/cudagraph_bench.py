"""mode="reduce-overhead" side by side: eager, Inductor and torchfuse under CUDA graphs (and
torchfuse without them), on small-batch decoder inference and on training steps.

    python benchmarks/cudagraph_bench.py [--rows infer,train] [--only llama,gpt2,resnet18] [--json out.json]

Inference rows: Llama-style (GQA) and GPT-2-style 6-layer decoders, batch 1-4 x 32-128 tokens,
bf16 and fp32, the hidden states out.  Training rows: forward, loss, backward and an eager SGD
step for the same GPT-2-style model and for a ResNet-18 (zoo), each step after
`torch.compiler.cudagraph_mark_step_begin()`.  Per row: ms per call (back to back, host
included), ratios, and the peak memory above what was allocated before the row: of all four
over the first calls and captures (allocated bytes), and what the allocator holds at the end
(reserved bytes: a CUDA graph's pool shows only there).  TF32 off.  The table is printed last.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Callable

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

os.environ.setdefault("TORCHFUSE_FIRST_CALLS", "wait")   # timings are of compiled graphs, not the ATen tier
import torch  # noqa: E402

import torchfuse  # noqa: E402,F401  (registers the backend)
from zoo import TrainStep  # noqa: E402
from zoo_models import BY_NAME  # noqa: E402
from zoo_transformers import HFOutput, _transformers  # noqa: E402

BACKENDS = ("eager", "inductor-ro", "torchfuse-ro", "torchfuse")


@dataclass
class Row:
    name: str
    ms: dict[str, float] = field(default_factory=dict)
    peak_mib: dict[str, float] = field(default_factory=dict)      # first calls and captures included
    steady_mib: dict[str, float] = field(default_factory=dict)    # a few calls after those
    reserved_mib: dict[str, float] = field(default_factory=dict)  # what the allocator holds at the end (pools)
    error: dict[str, str] = field(default_factory=dict)


def decoder(kind: str) -> torch.nn.Module:
    tf = _transformers()
    torch.manual_seed(0)
    if kind == "llama":
        cfg = tf.LlamaConfig(hidden_size=1024, intermediate_size=2816, num_hidden_layers=6, num_attention_heads=16,
                             num_key_value_heads=4, vocab_size=32000, max_position_embeddings=2048, use_cache=False)
        model = tf.LlamaModel(cfg)
    else:
        cfg = tf.GPT2Config(n_embd=768, n_layer=6, n_head=12, vocab_size=50257, n_positions=1024, use_cache=False,
                            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
        model = tf.GPT2Model(cfg)
    return HFOutput(model, ("input_ids",), "last_hidden_state")


def compiled(backend: str, model: torch.nn.Module) -> Callable:
    if backend == "eager":
        return model
    if backend == "inductor-ro":
        return torch.compile(model, mode="reduce-overhead")
    if backend == "torchfuse-ro":
        return torch.compile(model, backend="torchfuse", mode="reduce-overhead")
    return torch.compile(model, backend="torchfuse")


def timed(step: Callable, budget: float = 0.5) -> float:
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    t0, n = time.perf_counter(), 0
    while time.perf_counter() - t0 < budget or n < 10:
        step()
        n += 1
        if n % 10 == 0:
            torch.cuda.synchronize()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / n * 1e3


def interleaved(steps: dict[str, Callable], rounds: int) -> dict[str, float]:
    """Median ms per call over `rounds` rounds, every backend timed once per round in turn: a host
    whose speed drifts moves every backend alike.  (A backend compiled before the last Dynamo reset
    recompiles once in the warm-up, from warm caches.)"""
    for step in steps.values():
        for _ in range(3):
            step()
    times: dict[str, list[float]] = {b: [] for b in steps}
    for _ in range(rounds):
        for backend, step in steps.items():
            times[backend].append(timed(step, budget=0.25))
    return {b: sorted(t)[len(t) // 2] for b, t in times.items()}


def host_profile(step: Callable, calls: int = 50, top: int = 20) -> str:
    """cProfile of `calls` steps by own time: where a host-bound step spends its time."""
    from profile_text import cprofile_text
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    return cprofile_text(step, calls, tottime_rows=top, cumulative_rows=0)


def run_row(row: Row, make: Callable[[str], Callable], rounds: int = 1, profile: bool = False) -> None:
    kept: dict[str, Callable] = {}
    for backend in BACKENDS:
        torch._dynamo.reset()
        torch.cuda.empty_cache()
        torch.cuda.synchronize()
        base, base_reserved = torch.cuda.memory_allocated(), torch.cuda.memory_reserved()
        torch.cuda.reset_peak_memory_stats()
        try:
            step = make(backend)
            row.ms[backend] = timed(step)
            row.peak_mib[backend] = (torch.cuda.max_memory_allocated() - base) / 2 ** 20
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            for _ in range(3):
                step()
            torch.cuda.synchronize()
            row.steady_mib[backend] = (torch.cuda.max_memory_allocated() - base) / 2 ** 20
            # CUDA graph replays allocate nothing, so the graphs' pool shows in reserved bytes only
            row.reserved_mib[backend] = (torch.cuda.memory_reserved() - base_reserved) / 2 ** 20
            if profile and backend != "eager":
                print(f"## {row.name} {backend}: host profile of 50 steps\n{host_profile(step)}", flush=True)
            if rounds > 1:
                kept[backend] = step
        except Exception as e:   # keep the table going
            row.error[backend] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
            print(f"  !! {row.name} {backend}: {row.error[backend]}", flush=True)
        step = None
    if len(kept) > 1:
        row.ms.update(interleaved(kept, rounds))
    kept.clear()
    print(f"{row.name}: " + ", ".join(f"{b} {row.ms.get(b, float('nan')):.3f} ms" for b in BACKENDS), flush=True)


def inference_row(kind: str, dtype: torch.dtype, batch: int, seq: int, rounds: int, profile: bool) -> Row:
    row = Row(f"{kind} infer {str(dtype)[6:]} {batch}x{seq}")
    model = decoder(kind).cuda().eval().to(dtype)
    ids = torch.randint(0, 30000, (batch, seq), device="cuda")

    def make(backend: str) -> Callable:
        fn = compiled(backend, model)

        def step() -> None:
            with torch.no_grad():
                fn(ids)
        return step
    run_row(row, make, rounds, profile)
    return row


def training_row(name: str, rounds: int, profile: bool) -> Row:
    row = Row(f"{name} train fp32")

    def make(backend: str) -> Callable:
        if name == "gpt2":
            model = decoder("gpt2").cuda().train()
            inputs = (torch.randint(0, 30000, (4, 128), device="cuda"),)
            loss = lambda out, inputs: out.float().square().mean()  # noqa: E731
        else:
            zm = BY_NAME[name]
            model, inputs = zm.make("cpu", "cuda")
            model.train()
            loss = zm.loss
        train = TrainStep(model, compiled(backend, model), loss, inputs)

        def step() -> None:
            torch.compiler.cudagraph_mark_step_begin()
            train()
        return step
    run_row(row, make, rounds, profile)
    return row


def table(rows: list[Row]) -> str:
    lines = ["| row | eager ms | Inductor RO ms | torchfuse RO ms | torchfuse ms | tf RO / ind RO | tf RO / eager "
             "| first-call peak MiB Ind RO / tf RO / tf | reserved MiB after Ind RO / tf RO / tf |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        ms = [r.ms.get(b) for b in BACKENDS]
        f = lambda v: "—" if v is None else f"{v:.3f}"  # noqa: E731
        speed = f"{ms[1] / ms[2]:.2f}x" if ms[1] and ms[2] else "—"
        vs_eager = f"{ms[0] / ms[2]:.2f}x" if ms[0] and ms[2] else "—"
        peaks = " / ".join("—" if b not in r.peak_mib else f"{r.peak_mib[b]:.0f}" for b in BACKENDS[1:])
        later = " / ".join("—" if b not in r.reserved_mib else f"{r.reserved_mib[b]:.0f}" for b in BACKENDS[1:])
        lines.append(f"| {r.name} | {' | '.join(f(v) for v in ms)} | {speed} | {vs_eager} | {peaks} | {later} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="infer,train", help="infer, train or both")
    ap.add_argument("--only", help="comma-separated models: llama, gpt2, resnet18")
    ap.add_argument("--json", help="write the rows here")
    ap.add_argument("--rounds", type=int, default=1,
                    help="> 1: keep every backend's step and time them interleaved, the median of this many rounds")
    ap.add_argument("--profile", action="store_true", help="print a cProfile of each compiled backend's steps")
    args = ap.parse_args()
    wanted = lambda model: not args.only or model in args.only.split(",")  # noqa: E731
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    rows: list[Row] = []
    if "infer" in args.rows:
        for kind, dtype, batch, seq in [("llama", torch.bfloat16, 1, 32), ("llama", torch.bfloat16, 4, 128),
                                        ("llama", torch.float32, 1, 64), ("gpt2", torch.bfloat16, 1, 64),
                                        ("gpt2", torch.float32, 2, 96)]:
            if wanted(kind):
                rows.append(inference_row(kind, dtype, batch, seq, args.rounds, args.profile))
    if "train" in args.rows:
        for name in ("gpt2", "resnet18"):
            if wanted(name):
                rows.append(training_row(name, args.rounds, args.profile))
    if args.json:
        with open(args.json, "w") as f:
            json.dump([asdict(r) for r in rows], f, indent=1)
    print(f"\n{torch.cuda.get_device_name()}, torch {torch.__version__}\n" + table(rows))


if __name__ == "__main__":
    main()
