"""CNNs as most users bring them: NCHW weights and inputs, on the GPU.  Does running the
convolutions on channels-last activations pay there (`Config.channels_last_convs`)?

    python benchmarks/probes/nchw_layout.py --only resnet50,mobilenet_v2 --modes infer,train --dtype fp32
    python benchmarks/probes/nchw_layout.py --only timm_resnext50_32x4d,tv_resnet50 --dtype bf16   # library rows

The zoo's "gpu" rows feed channels-last (a tuned user's setup); this probe turns the model and
its inputs back to NCHW and times, per row, eager, Inductor (whose layout optimization converts
NCHW convolutions on CUDA), torchfuse with its per-graph decision ("auto"), and torchfuse with
channels-last forced on and off (inference: the aten pass; training: the Dynamo-graph rewrite).  ms per call (median of
CUDA-event samples, the backends in alternating rounds), TF32 off unless --tf32; training is forward, loss,
backward and an SGD step.
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

import torchfuse  # noqa: E402,F401
from gpu_bench import bench  # noqa: E402
from zoo import TrainStep, free_memory  # noqa: E402
from zoo_models import BY_NAME  # noqa: E402

BACKENDS = {"eager": None, "inductor": None, "torchfuse": {},
            "torchfuse+cl": {"channels_last_convs": True}, "torchfuse+nchw": {"channels_last_convs": False}}


def make(name: str, mode: str, dtype: torch.dtype, backend: str):
    if name in BY_NAME:
        zm = BY_NAME[name]
    else:       # the libraries' own models (zoo_library.py)
        from zoo_library import LIBRARY_BY_NAME
        zm = LIBRARY_BY_NAME[name]
    model, inputs = zm.make("gpu", "cuda", dtype)
    model.to(memory_format=torch.contiguous_format)
    inputs = tuple(x.contiguous() for x in inputs)
    if mode == "train":
        model.train()
    if backend == "eager":
        fwd = model
    elif backend == "inductor":
        fwd = torch.compile(model)
    else:
        fwd = torch.compile(model, backend="torchfuse", options=BACKENDS[backend])
    if mode == "train":
        return TrainStep(model, fwd, zm.loss, inputs)

    def call():
        with torch.no_grad():
            return fwd(*inputs)
    return call


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", required=True)
    ap.add_argument("--modes", default="infer,train")
    ap.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tf32", action="store_true", help="cuDNN's TF32 on for fp32 convolutions (PyTorch's default)")
    args = ap.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = args.tf32
    dtype = torch.float32 if args.dtype == "fp32" else torch.bfloat16
    print("| row | " + " | ".join(f"{b} ms" for b in BACKENDS) + " | tf / Ind | tf+cl / Ind | tf+nchw / Ind |")
    print("|---|" + "---|" * (len(BACKENDS) + 3))
    for name in args.only.split(","):
        for mode in args.modes.split(","):
            if mode == "train" and dtype != torch.float32:
                continue
            torch._dynamo.reset()
            free_memory()
            fns = {b: make(name, mode, dtype, b) for b in BACKENDS}
            times: dict[str, list[float]] = {b: [] for b in BACKENDS}
            for _ in range(args.rounds):
                for b, fn in fns.items():
                    times[b].append(bench(fn, reps=10, inner=5))
            del fns
            ms = {b: sorted(t)[len(t) // 2] for b, t in times.items()}
            ind, tf, cl, nchw = ms["inductor"], ms["torchfuse"], ms["torchfuse+cl"], ms["torchfuse+nchw"]
            print(f"| {name} {mode}-{args.dtype} | " + " | ".join(f"{ms[b]:.2f}" for b in BACKENDS)
                  + f" | {ind / tf:.2f} | {ind / cl:.2f} | {ind / nchw:.2f} |", flush=True)


if __name__ == "__main__":
    main()
