"""`python -m torchfuse` (or the `torchfuse` command): the environment, the cache, and what
torchfuse makes of a model.

    torchfuse env                          # versions, compiler, CPU vector units, GPUs, cache folder
    torchfuse cache show                   # what the cache holds, by kind
    torchfuse cache clear [--yes]          # remove it (kernels, Triton modules, compiled graphs)
    torchfuse explain pkg.module:factory   # factory() -> (model or function, args): the report
                  [--html report.html]     # also as an HTML page
                  [--inference]            # under torch.no_grad(): the inference graphs
    torchfuse bench [NAME [ARGS...]]       # list / run the benchmarks (source checkout)
"""
from __future__ import annotations

import argparse
import importlib
import platform
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Sequence

KINDS = {"cpp": "C++ kernel libraries", "triton": "Triton modules and autotuning", "graphs": "compiled graphs"}


def _size(folder: Path) -> tuple[int, int]:
    files = [p for p in folder.rglob("*") if p.is_file()] if folder.is_dir() else []
    return len(files), sum(p.stat().st_size for p in files)


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


def cmd_env(args: argparse.Namespace) -> int:
    import torch

    import torchfuse
    from torchfuse.config import Config
    config = Config.from_options()
    print(f"torchfuse   {torchfuse.__version__}")
    print(f"python      {platform.python_version()} ({sys.executable})")
    print(f"torch       {torch.__version__}")
    try:
        import triton
        print(f"triton      {triton.__version__}")
    except ImportError:
        print("triton      not installed (CUDA tensors then run eagerly)")
    try:
        out = subprocess.run([config.cxx, "--version"], capture_output=True, text=True, timeout=30)
        print(f"C++         {config.cxx}: {out.stdout.splitlines()[0] if out.stdout else 'no version output'}")
    except (OSError, subprocess.TimeoutExpired) as e:
        print(f"C++         {config.cxx}: not runnable ({e}); CPU graphs would run eagerly")
    flags = ""
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        pass
    units = [u for u in ("avx2", "avx512f", "avx512bw", "amx_tile") if f" {u}" in flags]
    print(f"CPU         {platform.machine()}, {torch.get_num_threads()} threads, {' '.join(units) or 'no AVX2'}")
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            print(f"GPU {i}       {torch.cuda.get_device_name(i)}")
    else:
        print("GPU         none")
    files, size = _size(Path(config.cache_dir))
    print(f"cache       {config.cache_dir} ({files} files, {_human(size)})")
    return 0


def cmd_cache(args: argparse.Namespace) -> int:
    from torchfuse.config import Config
    root = Path(Config.from_options().cache_dir)
    if args.action == "show":
        print(f"{root}:")
        for kind, what in KINDS.items():
            files, size = _size(root / kind)
            print(f"  {kind:7s} {files:6d} files {_human(size):>10s}  {what}")
        return 0
    present = [root / k for k in KINDS if (root / k).exists()]
    if not present:
        print(f"{root}: nothing to clear")
        return 0
    if not args.yes:
        question = f"remove {', '.join(map(str, present))}? [y/N] "
        try:
            if not sys.stdin.isatty():
                raise EOFError
            answer = input(question)
        except (EOFError, OSError, ValueError):     # no one to ask: a script, CI, a closed stdin
            print(f"torchfuse cache clear: {root} was left as it is: stdin is not a terminal to confirm "
                  f"on; run `torchfuse cache clear --yes` to clear without asking", file=sys.stderr)
            return 1
        if answer.strip().lower() not in ("y", "yes"):
            return 1
    for folder in present:
        shutil.rmtree(folder, ignore_errors=True)
    print(f"cleared {len(present)} folder(s) under {root}")
    return 0


def cmd_explain(args: argparse.Namespace) -> int:
    import json

    import torchfuse
    module_name, _, attr = args.target.partition(":")
    if not attr:
        raise SystemExit("torchfuse explain: give the factory as module:function (it returns (model, args))")
    sys.path.insert(0, ".")
    factory = getattr(importlib.import_module(module_name), attr)
    fn, inputs = factory()
    options = json.loads(args.options) if args.options else None
    import contextlib

    import torch
    # (--inference: the graphs an inference run compiles, as under torch.no_grad())
    with torch.no_grad() if args.inference else contextlib.nullcontext():
        report = torchfuse.explain(fn, *inputs, options=options)
    print(report)
    if args.html:
        print(f"\nHTML report: {report.save_html(args.html)}")
    return 0


def benchmarks_dir() -> Path | None:
    """The source checkout's `benchmarks/` folder (next to `src/torchfuse`), if this torchfuse
    runs from one (an editable install); a wheel ships no benchmarks."""
    folder = Path(__file__).resolve().parents[2] / "benchmarks"
    return folder if (folder / "zoo.py").is_file() else None


def cmd_bench(args: argparse.Namespace) -> int:
    folder = benchmarks_dir()
    if folder is None:
        raise SystemExit("torchfuse bench: the benchmarks live in torchfuse's source checkout "
                         "(benchmarks/); install it from one with `pip install -e .`")
    names = sorted(p.stem for p in folder.glob("*.py") if not p.stem.startswith("_"))
    if args.name is None:
        print("benchmarks (torchfuse bench NAME [its arguments], NAME --help for each):")
        for name in names:
            print(f"  {name}")
        return 0
    if args.name not in names:
        raise SystemExit(f"torchfuse bench: no benchmark {args.name!r}; there are: {', '.join(names)}")
    return subprocess.call([sys.executable, str(folder / f"{args.name}.py"), *args.rest])


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="torchfuse", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="command", required=True)
    sub.add_parser("env", help="versions, compiler, CPU, GPUs and the cache folder").set_defaults(run=cmd_env)
    cache = sub.add_parser("cache", help="show or clear the on-disk cache")
    cache.add_argument("action", choices=("show", "clear"))
    cache.add_argument("-y", "--yes", action="store_true", help="clear without asking")
    cache.set_defaults(run=cmd_cache)
    explain = sub.add_parser("explain", help="compile a model and print what was fused, what fell back and why")
    explain.add_argument("target", help="module:factory, where factory() returns (model or function, args)")
    explain.add_argument("--options", help='torchfuse options as JSON, e.g. \'{"fuse": false}\'')
    explain.add_argument("--html", metavar="FILE", help="also write the report as an HTML page")
    explain.add_argument("--inference", "--no-grad", dest="inference", action="store_true",
                         help="run the model under torch.no_grad(): the inference graphs, not training's")
    explain.set_defaults(run=cmd_explain)
    bench = sub.add_parser("bench", help="run a benchmark from the source checkout (no name: list them)")
    bench.add_argument("name", nargs="?", help="e.g. zoo, cpu_bench, lazy_bench, compile_bench")
    bench.add_argument("rest", nargs=argparse.REMAINDER, help="the benchmark's own arguments")
    bench.set_defaults(run=cmd_bench)
    return ap


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
