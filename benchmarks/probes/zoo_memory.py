"""Where a zoo row's peak CUDA memory goes: each backend's first-call and steady-state peak, and
for the backends named by --snapshot, the allocations live at the steady-state peak, by site
(with --first, at the first call's peak too: compile-time and first-launch allocations).

    python benchmarks/probes/zoo_memory.py --only resnet50 --mode infer [--snapshot torchfuse]
    python benchmarks/probes/zoo_memory.py --only hf_gpt_neox --dtype bf16 --first   # library rows too

Printed per backend: peak MiB above what was allocated before the call, for the first call
(compile included) and for a later call; with --snapshot, the largest allocations alive at the
later call's peak, each with the Python frames that made it (torch's own frames dropped), so an
excess shows up as the site that holds it.
"""
from __future__ import annotations

import argparse
import collections
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

import torchfuse  # noqa: E402,F401  (registers the backend)
from zoo import TrainStep, compile_with, free_memory  # noqa: E402
from zoo_library import LIBRARY_BY_NAME  # noqa: E402
from zoo_models import BY_NAME  # noqa: E402

MiB = 2 ** 20


def _step(name: str, mode: str, dtype: torch.dtype, backend: str):
    zm = BY_NAME[name] if name in BY_NAME else LIBRARY_BY_NAME[name]
    model, inputs = zm.make("gpu", "cuda", dtype)
    if mode == "train":
        model.train()
        return TrainStep(model, compile_with(backend, model), zm.loss, inputs)
    compiled = compile_with(backend, model)

    def infer():
        with torch.no_grad():
            return compiled(*inputs)
    return infer


def _site(frames: list[dict]) -> str:
    keep = [f for f in frames if "/torch/" not in f["filename"] or "torchfuse" in f["filename"]
            or "cudagraph" in f["filename"]]
    return " <- ".join(f"{os.path.basename(f['filename'])}:{f['line']}:{f['name']}" for f in keep[:3])


def live_at_peak(snapshot: dict, top: int) -> list[str]:
    """The allocations alive when the traced allocated bytes peaked, largest sites first."""
    trace = snapshot["device_traces"][0]
    live: dict[int, dict] = {}
    total = peak = 0
    peak_live: dict[int, dict] = {}
    peak_event: dict = {}
    for ev in trace:
        if ev["action"] == "alloc":
            live[ev["addr"]] = ev
            total += ev["size"]
            if total > peak:
                peak, peak_live, peak_event = total, dict(live), ev
        elif ev["action"] == "free_completed" and ev["addr"] in live:
            total -= live.pop(ev["addr"])["size"]
    sites: dict[str, list[int]] = collections.defaultdict(lambda: [0, 0])
    for ev in peak_live.values():
        s = sites[_site(ev.get("frames", []))]
        s[0] += ev["size"]
        s[1] += 1
    lines = [f"  traced peak {peak / MiB:.0f} MiB in {len(peak_live)} allocations"]
    # The allocation that made the peak, with its whole Python stack: says whether the peak
    # falls in the forward, the backward or the optimizer step, and at which wrapper line.
    frames = peak_event.get("frames", [])
    lines.append("  peak made by " + " <- ".join(
        f"{os.path.basename(f['filename'])}:{f['line']}:{f['name']}" for f in frames[:12])[:600])
    # Sizes alive at the peak, so two backends' peaks can be compared buffer by buffer.
    sizes = collections.Counter(round(ev["size"] / MiB, 1) for ev in peak_live.values())
    lines.append("  sizes alive (MiB x count): " + ", ".join(
        f"{size}x{n}" for size, n in sorted(sizes.items(), reverse=True)))
    for site, (size, n) in sorted(sites.items(), key=lambda kv: -kv[1][0])[:top]:
        lines.append(f"  {size / MiB:8.1f} MiB {n:4d}x  {site[:230]}")
    return lines


def measure(name: str, mode: str, dtype: torch.dtype, backend: str, snapshot: bool, top: int,
            first_snapshot: bool = False) -> list[str]:
    torch._dynamo.reset()
    free_memory()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn = _step(name, mode, dtype, backend)
    built = torch.cuda.memory_allocated() - base   # the model (and its copy) and inputs
    torch.cuda.reset_peak_memory_stats()
    if snapshot and first_snapshot:
        torch.cuda.memory._record_memory_history(max_entries=200000, stacks="python")
    out = fn()
    torch.cuda.synchronize()
    first = torch.cuda.max_memory_allocated() - base - built
    first_lines = []
    if snapshot and first_snapshot:
        first_lines = ["  first call:"] + live_at_peak(torch.cuda.memory._snapshot(), top)
        torch.cuda.memory._record_memory_history(enabled=None)
    del out
    fn()
    torch.cuda.synchronize()
    held = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    if snapshot:
        torch.cuda.memory._record_memory_history(max_entries=200000, stacks="python")
    out = fn()
    torch.cuda.synchronize()
    later = torch.cuda.max_memory_allocated() - held
    lines = [f"## {name} {mode} {dtype} {backend}: model+inputs {built / MiB:.0f} MiB, first call peak "
             f"+{first / MiB:.0f} MiB, later call peak +{later / MiB:.0f} MiB over {(held - base - built) / MiB:.0f} "
             f"MiB held between calls"] + first_lines
    if snapshot:
        snap = torch.cuda.memory._snapshot()
        torch.cuda.memory._record_memory_history(enabled=None)
        lines += live_at_peak(snap, top)
    del out, fn
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", required=True, help="comma-separated zoo model names")
    ap.add_argument("--mode", choices=("train", "infer"), default="infer")
    ap.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    ap.add_argument("--backends", default="eager,inductor,torchfuse")
    ap.add_argument("--snapshot", default="torchfuse", help="backends whose peak is broken down by site")
    ap.add_argument("--first", action="store_true", help="break the first call's peak down by site too")
    ap.add_argument("--top", type=int, default=12)
    ap.add_argument("--out", help="append the report to this file")
    args = ap.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    report = []
    for name in args.only.split(","):
        for backend in args.backends.split(","):
            report += measure(name, args.mode, dtype, backend, backend in args.snapshot.split(","), args.top,
                              args.first)
            print("\n".join(report[-1:]), flush=True)
    text = "\n".join(report)
    print(text)
    if args.out:
        with open(args.out, "a") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
