"""Do the Triton kernels' index checks synchronize the host with the GPU?  An embedding + GELU
graph called back to back, with the checks (default), without (`runtime_checks=False`) and with
a read of the check results at every call (`strict=True`):

    python benchmarks/probes/triton_check_sync.py [--calls 200] [--rounds 5]

Per variant: host microseconds per call (the calls only, GPU not waited for: the min and median
over rounds of `--calls` calls each), GPU-waited microseconds per call, and the host-device
synchronizations per call, counted with torch.cuda.set_sync_debug_mode("warn") (each
synchronizing call warns).  Then a bad id must still raise eager's IndexError: at the next call
(default) or at torchfuse.check_kernel_errors(), and at the same call under strict.
Without CUDA it says so and exits 0.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
import warnings

import torch
import torch.nn.functional as F

import torchfuse

VARIANTS = {"checks (async)": {}, "no checks": {"runtime_checks": False}, "checks (strict)": {"strict": True}}


def fn(table: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    return F.gelu(F.embedding(ids, table))


def _syncs_per_call(f, args, calls: int) -> float:
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            for _ in range(calls):
                f(*args)
        finally:
            torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()
    return sum("synchroniz" in str(w.message) for w in caught) / calls


def _host_us(f, args, calls: int, wait: bool) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        f(*args)
    if wait:
        torch.cuda.synchronize()
    return (time.perf_counter() - t0) / calls * 1e6


def _bad_id_raises(f, table: torch.Tensor, ids: torch.Tensor, strict: bool) -> str:
    bad = ids.clone()
    bad[0, 3] = table.shape[0]
    try:
        f(table, bad)
    except IndexError as e:
        return f"raised at the call: {e}"
    if strict:
        return "NO ERROR at the call"
    for k in range(3):                 # a later call raises what an earlier one met
        try:
            f(table, ids)
        except IndexError as e:
            return f"raised at call +{k + 1}: {e}"
    try:
        torchfuse.check_kernel_errors()
    except IndexError as e:
        return f"raised at torchfuse.check_kernel_errors(): {e}"
    return "NO ERROR"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=5)
    a = ap.parse_args()
    if not torch.cuda.is_available():
        print("triton_check_sync: no CUDA device; nothing to measure (run it on a GPU machine)")
        return 0
    table = torch.randn(32000, 256, device="cuda")
    ids = torch.randint(0, 32000, (8, 64), device="cuda")
    compiled = {}
    for name, opts in VARIANTS.items():
        torch._dynamo.reset()
        f = torch.compile(fn, backend="torchfuse", options=opts)
        torch.testing.assert_close(f(table, ids), fn(table, ids))
        compiled[name] = f
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; embedding [8, 64] of [32000, 256] + GELU, "
          f"{a.calls} calls per round, {a.rounds} rounds")
    print("| variant | host us/call min | median | GPU-waited us/call min | syncs/call |")
    print("|---|---|---|---|---|")
    host = {n: [] for n in compiled}
    waited = {n: [] for n in compiled}
    for _ in range(a.rounds):
        for name, f in compiled.items():           # interleaved
            host[name].append(_host_us(f, (table, ids), a.calls, wait=False))
            waited[name].append(_host_us(f, (table, ids), a.calls, wait=True))
    for name, f in compiled.items():
        syncs = _syncs_per_call(f, (table, ids), a.calls)
        print(f"| {name} | {min(host[name]):.1f} | {statistics.median(host[name]):.1f} | "
              f"{min(waited[name]):.1f} | {syncs:.2f} |")
    for name in ("checks (async)", "checks (strict)"):
        print(f"bad id, {name}: {_bad_id_raises(compiled[name], table, ids, strict='strict' in name)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
