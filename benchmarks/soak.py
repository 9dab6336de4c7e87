"""A long-running process compiling random programs: does torchfuse stay correct, and do its
memory and its cache stay bounded?

    python benchmarks/soak.py --minutes 20 [--cache-max-bytes 50000000] [--every 60]

Programs come from the fuzzer's generator (`torchfuse.tools.fuzz.programs`: pointwise chains,
reductions, views and broadcasts over random shapes and dtypes), each compiled afresh and
compared with eager.  Every `--every` seconds a line: elapsed minutes, programs checked, programs
per second over the interval, mismatches, the process's resident memory and how much of it torch's
cache-artifact recorder holds (every AOTAutograd cache entry, kept for
`torch.compiler.save_cache_artifacts()`), and the cache folder's size.  The cache folder is a new one (removed at the end) unless `--cache-dir` names one.  The
table is printed last.
"""
from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time
import warnings


def rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2 ** 20


def folder_mib(path: str) -> float:
    total = 0
    for root, _, files in os.walk(path):
        for name in files:
            try:
                total += os.path.getsize(os.path.join(root, name))
            except OSError:
                pass
    return total / 2 ** 20


def torch_artifacts_mib() -> float:
    """What torch's cache-artifact recorder holds: every AOTAutograd cache entry written in this
    process is kept in memory for `torch.compiler.save_cache_artifacts()` (Inductor's entries
    too), a part of the process's growth that is torch's and not torchfuse's."""
    try:
        from torch.compiler._cache import CacheArtifactManager
        seen = CacheArtifactManager._seen_artifacts
    except (ImportError, AttributeError):
        return float("nan")
    return sum(len(getattr(a, "content", b"")) for a in seen if isinstance(getattr(a, "content", None), bytes)) / 2 ** 20


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--minutes", type=float, default=20.0)
    ap.add_argument("--every", type=float, default=60.0, help="seconds between report lines")
    ap.add_argument("--cache-dir", help="the cache folder (default: a new temporary one)")
    ap.add_argument("--cache-max-bytes", type=int, default=50_000_000)
    ap.add_argument("--seed", type=int, default=0, help="torch's seed (the programs themselves are random)")
    args = ap.parse_args()
    own = args.cache_dir is None
    cache = args.cache_dir or tempfile.mkdtemp(prefix="torchfuse-soak-")
    os.environ["TORCHFUSE_CACHE_DIR"] = cache

    import torch

    from torchfuse.tools.fuzz import NotTorchfuse, check_program, programs

    torch.manual_seed(args.seed)
    strategy = programs()
    options = {"cache_max_bytes": args.cache_max_bytes}
    rows = []
    start = last = time.perf_counter()
    checked = since = mismatches = torch_failures = 0
    warnings.simplefilter("ignore")       # hypothesis' example() outside a test, torchfuse's fallbacks
    try:
        while time.perf_counter() - start < args.minutes * 60:
            prog = strategy.example()
            try:
                check_program(prog, options)
            except AssertionError as e:
                mismatches += 1
                print(f"  mismatch ({prog.digest()}): {str(e).splitlines()[0][:200]}\n"
                      f"  inputs {prog.inputs!r}, options {prog.options!r}\n{prog.source()}", flush=True)
            except NotTorchfuse as e:     # torch's own compile stack fails on it too (aot_eager)
                torch_failures += 1
                print(f"  not torchfuse's ({prog.digest()}): {str(e).splitlines()[0][:200]}", flush=True)
            checked += 1
            since += 1
            now = time.perf_counter()
            if now - last >= args.every:
                rows.append(((now - start) / 60, checked, since / (now - last), mismatches, rss_mib(),
                             torch_artifacts_mib(), folder_mib(cache)))
                print("%.1f min: %d programs, %.1f/s, %d mismatches, RSS %.0f MiB (torch's artifact recorder "
                      "%.1f MiB), cache %.1f MiB" % rows[-1], flush=True)
                last, since = now, 0
    finally:
        if own:
            shutil.rmtree(cache, ignore_errors=True)
    print("\n| minutes | programs | programs/s | mismatches | RSS MiB | of it torch's artifact recorder MiB "
          "| cache MiB |\n|---|---|---|---|---|---|---|")
    for r in rows:
        print("| %.1f | %d | %.1f | %d | %.0f | %.1f | %.1f |" % r)
    print(f"\n{torch_failures} programs failed under torch's aot_eager as well (not counted as mismatches)")


if __name__ == "__main__":
    main()
