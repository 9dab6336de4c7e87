"""Where a model's first call (cold compile) goes: Dynamo alone, Dynamo + AOTAutograd, torchfuse
(with and without parallel Triton precompile) and Inductor, each in a fresh process with fresh
cache directories.  torchfuse's own stages come from `torchfuse.counters.seconds`.

    python benchmarks/probes/compile_time.py [gpt2-bf16,resnet] [--backends eager,aot_eager,...]

Backends: `eager` is Dynamo's trace alone (the graph runs as is), `aot_eager` adds AOTAutograd's
functionalized aten trace, `torchfuse:N` is torchfuse with `compile_workers=N` (0: one per core),
`inductor` is the default backend.  Every child first compiles a tiny function with its backend,
so one-time imports and CUDA start-up are not counted.
"""
from __future__ import annotations

import argparse
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
name, backend = {name!r}, {backend!r}
kw = {{"backend": backend}}
if backend.startswith("torchfuse"):
    kw = {{"backend": "torchfuse", "options": {{"compile_workers": int(backend.split(":")[1])}}}}
elif backend == "inductor":
    kw = {{}}
import logging
worker_lines = []
class _Keep(logging.Handler):
    def emit(self, record):
        if "workers" in record.getMessage():
            worker_lines.append(record.getMessage())
logging.getLogger("torchfuse").setLevel(logging.DEBUG)
logging.getLogger("torchfuse").addHandler(_Keep())
tiny = torch.compile(lambda x: (x * 2 + 1).sum(-1), **kw)
tiny(torch.randn(4, 8, device="cuda")); torch.cuda.synchronize()
torch._dynamo.reset(); torchfuse.counters.seconds.clear()
make_model, make_args = models()[name]
model, args = make_model(), make_args()
profile = {profile!r} and backend.startswith("torchfuse")
import contextlib
with contextlib.nullcontext() if name.endswith("train") else torch.no_grad():
    fn = torch.compile(model, **kw)
    if profile:
        import cProfile, pstats, io
        prof = cProfile.Profile(); prof.enable()
    torch.cuda.synchronize(); t = time.perf_counter(); fn(*args); torch.cuda.synchronize()
    first = time.perf_counter() - t
    if profile:
        prof.disable(); buf = io.StringIO()
        pstats.Stats(prof, stream=buf).sort_stats("cumulative").print_stats(60)
        pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(40)
        with open(os.path.join({profile!r}, f"profile_{{name}}_{{backend.replace(':', '_')}}.txt"), "w") as f:
            f.write(buf.getvalue())
    t = time.perf_counter(); fn(*args); torch.cuda.synchronize()
    second = time.perf_counter() - t
out = {{"first": first, "second": second, "precompiled": torchfuse.counters["kernels_precompiled"],
       "kernels": torchfuse.counters["kernels_generated"], "workers": worker_lines}}
out.update({{k: round(v, 3) for k, v in torchfuse.counters.seconds.items()}})
print(json.dumps(out))
'''


def measure(name: str, backend: str, profile: str = "") -> dict:
    tmp = tempfile.mkdtemp(prefix="tf-ct-")
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=f"{tmp}/i", TRITON_CACHE_DIR=f"{tmp}/t",
               TORCHFUSE_CACHE_DIR=f"{tmp}/f")
    code = CHILD.format(probes=os.path.dirname(os.path.abspath(__file__)), name=name, backend=backend,
                       profile=profile)
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    try:
        return json.loads(out.stdout.strip().splitlines()[-1])
    except Exception:
        return {"error": out.stderr[-800:]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("models", nargs="?", default="gpt2-bf16")
    ap.add_argument("--backends", default="eager,aot_eager,torchfuse:0,torchfuse:1,inductor")
    ap.add_argument("--profile", default="", help="folder for a cProfile of each torchfuse first call")
    a = ap.parse_args()
    rows = []
    for name in a.models.split(","):
        for backend in a.backends.split(","):
            r = measure(name, backend, a.profile)
            print(name, backend, json.dumps(r), flush=True)
            rows.append((name, backend, r))
    stages = ["backend", "passes", "lowering", "schedule", "codegen", "build", "precompile"]
    print("\nbackend: AOTAutograd + torchfuse's stages; precompile: the worker processes + loading")
    print("\n| model | backend | first call s | " + " | ".join(stages) + " | kernels |")
    print("|---|---|---|" + "---|" * (len(stages) + 1))
    for name, backend, r in rows:
        if "error" in r:
            print(f"| {name} | {backend} | error |" + " |" * (len(stages) + 1))
            continue
        cells = " | ".join(f"{r[s]:.2f}" if s in r else "" for s in stages)
        print(f"| {name} | {backend} | {r['first']:.2f} | {cells} | {r['kernels'] or ''} |")


if __name__ == "__main__":
    main()
