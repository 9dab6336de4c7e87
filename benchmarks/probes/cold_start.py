"""Cold start in a fresh process with every cache empty: where the first call's time goes.

    python benchmarks/probes/cold_start.py [--model gpt2] [--dtype bf16] [--backends torchfuse,inductor] [--cprofile]

For each backend, a new process with new, empty folders for torchfuse's, Inductor's and
Triton's caches (TORCHFUSE_CACHE_DIR, TORCHINDUCTOR_CACHE_DIR, TRITON_CACHE_DIR) imports torch
and torchfuse, builds the zoo model (GPU size: GPT-2 small is batch 8 x 512 tokens) and times
its first call (inference, no_grad), nothing warmed up before: compile workers, CUDA context,
Triton's driver and compiler all start inside it, as on a fresh machine.  It prints the import
times, the first and second call and, for torchfuse, `counters.seconds` by stage and the
counters (graphs, kernels generated, distinct Triton binaries, kernels compiled in workers), and
torchfuse's debug log lines about the precompile (per-job seconds in the workers, the slowest),
with milliseconds since the process started.
`--cprofile` also writes the first call's cProfile (cumulative, top 60) to $OUT or "." as
cold_profile_<backend>.txt.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

CHILD = r'''
import json, logging, os, sys, time
logging.basicConfig(level=logging.WARNING, format="%(relativeCreated)8.0f ms %(name)s: %(message)s")
logging.getLogger("torchfuse").setLevel(logging.DEBUG)     # the precompile's own timings, on stderr
t0 = time.perf_counter()
import torch
t_torch = time.perf_counter() - t0
t1 = time.perf_counter()
import torchfuse
t_tf = time.perf_counter() - t1
from torch._dynamo import list_backends, register_backend
if "torchfuse" not in list_backends(exclude_tags=()):      # (the source tree on PYTHONPATH: no entry point)
    from torchfuse.frontend.dynamo import torchfuse_backend
    register_backend(torchfuse_backend, name="torchfuse")
sys.path.insert(0, {bench!r})
caches = {{k: os.environ[k] for k in ("TORCHFUSE_CACHE_DIR", "TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR")}}
from zoo_models import BY_NAME
os.environ.update(caches)     # (importing zoo points the caches at fresh folders)
backend, name, dtype, cprof = {backend!r}, {name!r}, {dtype!r}, {cprof!r}
model, inputs = BY_NAME[name].make("gpu", "cuda", torch.bfloat16 if dtype == "bf16" else torch.float32)
torch.cuda.synchronize()
fn = torch.compile(model, backend=backend)
if cprof:
    import cProfile, io, pstats
    pr = cProfile.Profile(); pr.enable()
t = time.perf_counter()
with torch.no_grad():
    fn(*inputs)
torch.cuda.synchronize()
first = time.perf_counter() - t
if cprof:
    pr.disable()
    s = io.StringIO(); pstats.Stats(pr, stream=s).sort_stats("cumulative").print_stats(60)
    open(os.path.join(os.environ.get("OUT") or ".", "cold_profile_" + backend + ".txt"), "w").write(s.getvalue())
t = time.perf_counter()
with torch.no_grad():
    fn(*inputs)
torch.cuda.synchronize()
second = time.perf_counter() - t
triton_bins = sum(1 for _, _, fs in os.walk(caches["TRITON_CACHE_DIR"]) for f in fs if f.endswith(".cubin"))
print("RESULT", json.dumps(dict(import_torch_s=t_torch, import_torchfuse_s=t_tf, first_call_s=first,
                                second_call_s=second, stages=dict(torchfuse.counters.seconds),
                                counters=dict(torchfuse.counters), triton_cubins=triton_bins)))
'''


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="gpt2")
    ap.add_argument("--dtype", choices=("fp32", "bf16"), default="bf16")
    ap.add_argument("--backends", default="torchfuse,inductor")
    ap.add_argument("--cprofile", action="store_true")
    ap.add_argument("--timeout", type=float, default=600)
    args = ap.parse_args()
    bench = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    results = {}
    for backend in args.backends.split(","):
        with tempfile.TemporaryDirectory() as caches:
            env = dict(os.environ, TORCHFUSE_CACHE_DIR=os.path.join(caches, "torchfuse"),
                       TORCHINDUCTOR_CACHE_DIR=os.path.join(caches, "inductor"),
                       TRITON_CACHE_DIR=os.path.join(caches, "triton"))
            code = CHILD.format(bench=bench, backend=backend, name=args.model, dtype=args.dtype, cprof=args.cprofile)
            proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                                  timeout=args.timeout)
            line = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
            if not line:
                print(f"{backend}: failed\n{proc.stderr[-3000:]}")
                continue
            results[backend] = json.loads(line[-1][7:])
            results[backend]["log"] = [x for x in proc.stderr.splitlines()
                                       if "precompil" in x or "workers" in x or "compiled" in x][:12]
    for backend, r in results.items():
        print(f"== {backend}: import torch {r['import_torch_s']:.2f} s, torchfuse {r['import_torchfuse_s']:.2f} s; "
              f"first call {r['first_call_s']:.2f} s, second {1e3 * r['second_call_s']:.1f} ms; "
              f"{r['triton_cubins']} Triton binaries in its cache")
        if r["stages"]:
            print("   stages (s): " + ", ".join(f"{k} {v:.2f}" for k, v in sorted(r["stages"].items(), key=lambda kv: -kv[1])))
            print("   counters: " + ", ".join(f"{k} {v}" for k, v in sorted(r["counters"].items())))
        for x in r["log"]:
            print("   " + x[:200])


if __name__ == "__main__":
    main()
