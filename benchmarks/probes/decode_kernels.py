"""Which device kernels one decode step launches, per backend: transformers' Llama with a static
cache (generate_bench.py's model and sizes), the forward compiled, the prompt's forward run,
then one one-token forward profiled.  Prints each backend's kernels by name (counts), so the
kernels one backend launches beyond another's show by name.

    python benchmarks/probes/decode_kernels.py [--model llama] [--backends inductor,torchfuse]
"""
from __future__ import annotations

import argparse
import collections
import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault("TORCHFUSE_FIRST_CALLS", "wait")

import torch  # noqa: E402

from generate_bench import _static_cache, build, compiled_forward  # noqa: E402


def _kind(name: str) -> str:
    """A kernel's name without what varies between graphs (Triton's numbering, template args)."""
    name = re.sub(r"_\d+(_[a-z_]+)?$", "", name)          # poi_fused_mul_3_tiled -> poi_fused_mul
    return re.sub(r"<.*", "", name)[:90]


def kernels(model_name: str, backend: str, prompt: int, batch: int, device: str) -> collections.Counter:
    from torch.profiler import ProfilerActivity, profile
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    model = build(model_name, "gpu" if device == "cuda" else "cpu", dtype, device, prompt + 16)
    torch._dynamo.reset()
    if backend != "eager":
        model.forward = compiled_forward(model.forward, backend, "default")
    cache = _static_cache(model, batch, prompt + 16)
    ids = torch.randint(1, model.config.vocab_size, (batch, prompt), device=device)
    with torch.no_grad():
        model(input_ids=ids, past_key_values=cache, cache_position=torch.arange(prompt, device=device), use_cache=True)

        def step(i: int):
            return model(input_ids=ids[:, -1:].clone(), past_key_values=cache,
                         cache_position=torch.tensor([prompt + i], device=device), use_cache=True)
        for i in range(3):
            step(i)
        if device == "cuda":
            torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA if device == "cuda" else ProfilerActivity.CPU]) as prof:
            step(3)
            if device == "cuda":
                torch.cuda.synchronize()
    return collections.Counter(_kind(e.name) for e in prof.events()
                               if device != "cuda" or e.device_type == torch.autograd.DeviceType.CUDA)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="llama")
    ap.add_argument("--backends", default="inductor,torchfuse")
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    a = ap.parse_args()
    counts = {b: kernels(a.model, b, a.prompt, a.batch, a.device) for b in a.backends.split(",")}
    names = sorted(set().union(*counts.values()), key=lambda n: -max(c[n] for c in counts.values()))
    print("| kernel | " + " | ".join(counts) + " |")
    print("|---|" + "---|" * len(counts))
    print("| **all** | " + " | ".join(str(sum(c.values())) for c in counts.values()) + " |")
    for n in names:
        print(f"| {n} | " + " | ".join(str(c[n]) for c in counts.values()) + " |")


if __name__ == "__main__":
    main()
