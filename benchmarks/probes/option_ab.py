"""Does a torchfuse option pay on real models?  Zoo rows compiled twice, with the default
options and with one override, timed in alternating rounds in one process, with peak memory.

    python benchmarks/probes/option_ab.py --only resnet50,regnety --options '{"conv_bn_fold_devices": ["cpu"]}'

Per row: ms per call (median of CUDA-event samples, rounds alternating between the two
compiles so drift hits both), the ratio, and each one's peak allocated MiB above what was
allocated before it: the first call (compile and any hoisted values included) and a later one.
Inference rows (no_grad), TF32 off.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

import torchfuse  # noqa: E402
from gpu_bench import bench  # noqa: E402
from zoo import free_memory  # noqa: E402
from zoo_models import BY_NAME  # noqa: E402

MiB = 2 ** 20


def build(name: str, dtype: torch.dtype, options: dict) -> tuple:
    torch._dynamo.reset()
    free_memory()
    model, inputs = BY_NAME[name].make("gpu", "cuda", dtype)
    model.eval()
    compiled = torch.compile(model, backend="torchfuse", options=options)
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()

    def call():
        with torch.no_grad():
            return compiled(*inputs)
    out = call()
    torch.cuda.synchronize()
    first = (torch.cuda.max_memory_allocated() - base) / MiB
    del out
    held = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out = call()
    torch.cuda.synchronize()
    later = (torch.cuda.max_memory_allocated() - held) / MiB
    held_mib = (held - base) / MiB
    del out
    return call, first, later, held_mib


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", required=True)
    ap.add_argument("--options", required=True, help="JSON object: the override (B); A is the default")
    ap.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    override = json.loads(args.options)
    print(f"| row | A ms | B ms | A/B | A peak first / later / held MiB | B peak first / later / held MiB |")
    print("|---|---|---|---|---|---|")
    for name in args.only.split(","):
        a = build(name, dtype, {})
        b = build(name, dtype, override)
        ta, tb = [], []
        for _ in range(args.rounds):
            ta.append(bench(a[0], reps=10))
            tb.append(bench(b[0], reps=10))
        ma, mb = statistics.median(ta), statistics.median(tb)
        print(f"| {name} {args.dtype} | {ma:.3f} | {mb:.3f} | {ma / mb:.3f} | {a[1]:.0f} / {a[2]:.0f} / {a[3]:.0f} "
              f"| {b[1]:.0f} / {b[2]:.0f} / {b[3]:.0f} |", flush=True)
        del a, b


if __name__ == "__main__":
    main()
