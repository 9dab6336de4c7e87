"""A/B one torchfuse option on zoo rows: Inductor, torchfuse, and torchfuse with the option
changed, timed interleaved in one process (cpu_bench's interleaved blocks, synchronized on the
GPU), outputs compared with Inductor's.  option_ab.py is the GPU inference A/B with peak memory.

    python benchmarks/probes/option_ab_zoo.py --device cuda --rows gru:infer,gru:train \
        --options '{"cat_in_place": false}'
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from cpu_bench import _time_interleaved  # noqa: E402
from zoo import TrainStep  # noqa: E402
from zoo_models import BY_NAME  # noqa: E402


def run_row(name: str, mode: str, device: str, options: dict, budget: float) -> dict:
    zm = BY_NAME.get(name)
    if zm is None:          # a `zoo.py --zoo library` row (timm, torchvision, torch_geometric, ...)
        from zoo_library import LIBRARY_BY_NAME
        zm = LIBRARY_BY_NAME[name]
    size = "gpu" if device == "cuda" else "cpu"
    fns, outs = {}, {}
    for key in ("inductor", "torchfuse", "torchfuse_changed"):
        torch._dynamo.reset()
        torch.manual_seed(0)
        model, inputs = zm.make(size, device, torch.float32)
        compiled = torch.compile(model) if key == "inductor" else torch.compile(
            model, backend="torchfuse", options=options if key == "torchfuse_changed" else {})
        if mode == "train":
            model.train()
            fn = TrainStep(model, compiled, zm.loss, inputs)
            outs[key] = fn.first()[0].float()
        else:
            def fn(compiled=compiled, inputs=inputs):
                with torch.no_grad():
                    return compiled(*inputs)
            out = fn()
            out = out[0] if isinstance(out, (tuple, list)) else out
            outs[key] = getattr(out, "logits", out).float()
        fns[key] = fn
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    med = {k: seconds * 1e3 for k, seconds in _time_interleaved(fns, (), budget, sync).items()}
    err = {k: (outs[k] - outs["inductor"]).abs().max().item() for k in outs}
    return {"row": f"{name} {mode}", "ms": med, "max_abs_diff_vs_inductor": err,
            "ind/tf": med["inductor"] / med["torchfuse"], "ind/changed": med["inductor"] / med["torchfuse_changed"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--rows", required=True, help="name:infer|train, comma-separated")
    ap.add_argument("--options", required=True, help="JSON dict of the changed torchfuse options")
    ap.add_argument("--budget", type=float, default=20.0, help="seconds of timing per row")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    results = []
    for row in args.rows.split(","):
        name, mode = row.split(":")
        r = run_row(name, mode, args.device, json.loads(args.options), args.budget)
        results.append(r)
        print(json.dumps(r), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1))
    print(f"\n| row | inductor ms | torchfuse ms | changed ms | ind/tf | ind/changed |  ({args.options})")
    for r in results:
        m = r["ms"]
        print(f"| {r['row']} | {m['inductor']:.3f} | {m['torchfuse']:.3f} | {m['torchfuse_changed']:.3f} "
              f"| {r['ind/tf']:.2f} | {r['ind/changed']:.2f} |")


if __name__ == "__main__":
    main()
