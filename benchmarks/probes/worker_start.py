"""What a Triton compile worker costs to start, and a job on it, against compiling in-process.

    python benchmarks/probes/worker_start.py [--workers 1,2,4] [--rounds 3] [--arch 90]

Runs without a GPU: Triton compiles for `GPUTarget("cuda", arch, 32)` (its wheel ships ptxas)
through the workers' target-only driver.  Each round, interleaved: a bare interpreter, `import
triton`, `import torch` (fresh processes); N workers started together until each is ready
(interpreter, `import triton`, a warm-up compile) and the first job on each; a job on a worker
started without the warm-up; and in a fresh process, the first and second compile of this
process (what the first call's wait does when no worker is free).  Prints the median of each.
"""
from __future__ import annotations

import argparse
import os
import pickle
import statistics
import subprocess
import sys
import tempfile
import time

SRC = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "src")
sys.path.insert(0, SRC)

KERNELS = '''
import triton
import triton.language as tl

@triton.jit
def softmax_like(x, y, n, RBLOCK: tl.constexpr):
    row = tl.program_id(0)
    offs = tl.arange(0, RBLOCK)
    m = offs < n
    a = tl.load(x + row * n + offs, m, other=float("-inf")).to(tl.float32)
    e = tl.exp(a - tl.max(a, 0))
    tl.store(y + row * n + offs, (e / tl.sum(e, 0)).to(y.dtype.element_ty), m)
'''


def _timed(cmd: list[str]) -> float:
    t = time.perf_counter()
    subprocess.run(cmd, check=True, capture_output=True, env=_env())
    return time.perf_counter() - t


def _env() -> dict:
    return {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workers", default="1,2,4")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--arch", type=int, default=90)
    args = ap.parse_args()
    os.environ.pop("TRITON_INTERPRET", None)
    from triton.backends.compiler import GPUTarget

    from torchfuse.backends.triton import compile_workers as cw
    target = GPUTarget("cuda", args.arch, 32)
    folder = tempfile.mkdtemp(prefix="worker-start-")
    module = os.path.join(folder, "tf_probe_kernels.py")
    with open(module, "w") as f:
        f.write(KERNELS)
    counter = [0]

    def job(cache: str) -> tuple:
        counter[0] += 1      # a new block size each time: never a cache hit
        return (module, "tf_probe_kernels", "softmax_like", (("*", "bfloat16"), ("*", "bfloat16"), 768), (1,),
                {"RBLOCK": 1024 << (counter[0] % 3), "num_warps": 4}, target, cache, cw.triton_settings(target))

    rows: dict[str, list[float]] = {}

    def add(name: str, value: float) -> None:
        rows.setdefault(name, []).append(value)
    inproc = f"""
import sys, time; sys.path.insert(0, {SRC!r})
from triton.backends.compiler import GPUTarget
from torchfuse.backends.triton import compile_workers as cw
import pickle
jobs = pickle.loads(bytes.fromhex(sys.argv[1]))
for i, job in enumerate(jobs):
    t = time.perf_counter(); cw._use_target(job[6]); cw.compile_job(job); print(time.perf_counter() - t)
"""
    for _ in range(args.rounds):
        add("python -c pass", _timed([sys.executable, "-c", "pass"]))
        add("python -c 'import triton'", _timed([sys.executable, "-c", "import triton"]))
        add("python -c 'import torch'", _timed([sys.executable, "-c", "import torch"]))
        for n in map(int, args.workers.split(",")):
            cache = tempfile.mkdtemp(dir=folder)
            t = time.perf_counter()
            procs = [cw._spawn(target) for _ in range(n)]
            ready = []
            for p in procs:
                assert cw._answer(p, 300) == "ready"
                ready.append(time.perf_counter() - t)
            add(f"{n} worker(s) started together: last ready", max(ready))
            jobs = [job(cache) for _ in procs]
            for p, j in zip(procs, jobs):
                pickle.dump(j, p.stdin)
                p.stdin.flush()
            seconds = [cw._answer(p, 300)[1] for p in procs]
            add(f"{n} worker(s): first job on a ready worker", statistics.median(seconds))
            for p in procs:
                p.stdin.close()
                p.wait()
        cache = tempfile.mkdtemp(dir=folder)
        t = time.perf_counter()
        p = cw._spawn(None)
        assert cw._answer(p, 300) == "ready"
        pickle.dump(job(cache), p.stdin)
        p.stdin.flush()
        cw._answer(p, 300)
        add("worker without warm-up: spawn to first job done", time.perf_counter() - t)
        p.stdin.close()
        p.wait()
        cache = tempfile.mkdtemp(dir=folder)
        out = subprocess.run([sys.executable, "-c", inproc, pickle.dumps([job(cache), job(cache)]).hex()],
                             check=True, capture_output=True, text=True, env=_env()).stdout.split()
        add("in-process: first compile of the process", float(out[0]))
        add("in-process: second compile", float(out[1]))
    width = max(map(len, rows))
    print(f"median of {args.rounds} rounds, seconds (cpus: {os.cpu_count()}, target sm{args.arch})")
    for name, values in rows.items():
        print(f"  {name:<{width}}  {statistics.median(values):6.2f}   (min {min(values):.2f})")
    import shutil
    shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    main()
