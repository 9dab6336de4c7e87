"""First-call (compile) time of a model with fresh caches: torchfuse with and without parallel
Triton precompile, and Inductor.  One process per measurement (caches must be cold).

    python benchmarks/probes/compile_time.py [gpt2-bf16] """
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile

CHILD = r'''
import os, sys, time, json
sys.path.insert(0, {probes!r})
import torch, torchfuse
from model_profile import models
name, backend, workers = {name!r}, {backend!r}, {workers!r}
make_model, make_args = models()[name]
model, args = make_model(), make_args()
with torch.no_grad():
    fn = torch.compile(model) if backend == "inductor" else \
        torch.compile(model, backend="torchfuse", options={{"compile_workers": workers}})
    torch.cuda.synchronize(); t = time.perf_counter(); fn(*args); torch.cuda.synchronize()
    first = time.perf_counter() - t
print(json.dumps({{"first": first, "precompiled": torchfuse.counters["kernels_precompiled"]}}))
'''


def measure(name: str, backend: str, workers: int) -> dict:
    tmp = tempfile.mkdtemp(prefix="tf-ct-")
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=f"{tmp}/i", TRITON_CACHE_DIR=f"{tmp}/t", TORCHFUSE_CACHE_DIR=f"{tmp}/f")
    code = CHILD.format(probes=os.path.dirname(os.path.abspath(__file__)), name=name, backend=backend, workers=workers)
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    try:
        return json.loads(out.stdout.strip().splitlines()[-1])
    except Exception:
        return {"error": out.stderr[-800:]}


if __name__ == "__main__":
    for name in (sys.argv[1] if len(sys.argv) > 1 else "gpt2-bf16").split(","):
        for backend, workers in (("torchfuse", 1), ("torchfuse", 0), ("inductor", 0)):
            print(name, backend, f"workers={workers}", measure(name, backend, workers), flush=True)
