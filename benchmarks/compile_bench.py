"""Cold and warm first-call time, torchfuse next to Inductor, by stage.

    python benchmarks/compile_bench.py --only gpt2,resnet50 [--device cuda] [--dtype bf16] [--train]
    python benchmarks/compile_bench.py --cold --only gpt2,llama,resnet50:train --dtype bf16 --rounds 3 [--first-calls wait]

For each zoo model and backend, two fresh processes share one new set of cache directories
(torchfuse's, Inductor's, Triton's): the first call of the first process is the cold start, the
first call of the second the warm start (a restart).  Each process first compiles a tiny
function, so imports and CUDA start-up are not counted.  torchfuse's own stages come from
`torchfuse.counters.seconds` ("backend" is AOTAutograd plus every torchfuse stage, or the graph
cache's load; the rest of a first call is Dynamo's trace and the first run).  The "dynamo"
backend is Dynamo's trace alone (backend="eager"): no warm start with Dynamo in the path can be
faster; the "aot" backend is Dynamo and AOTAutograd (backend="aot_eager"), the floor of a
training step's cold start (`--cold-only` skips the warm process).  The "saved" ("inductor-saved") backend is torchfuse (Inductor) through `aot_compile`:
the first process saves the program, the second loads it (no Dynamo trace) and makes its first
call; the program keeps only guards that survive a restart (torch.compiler's
`keep_portable_guards_unsafe`: HuggingFace models carry identity guards that cannot be saved).  The table is printed last.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

CHILD = r'''
import json, sys, time
sys.path.insert(0, {bench!r})
import os
caches = {{k: os.environ[k] for k in ("TORCHFUSE_CACHE_DIR", "TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR")}}
import torch, torchfuse
import zoo
from zoo import TrainStep, compile_with
from zoo_models import BY_NAME
os.environ.update(caches)     # (importing zoo points the caches at fresh folders, for its cold timings)
name, backend, device, dtype, train = {name!r}, {backend!r}, {device!r}, {dtype!r}, {train!r}
zoo.TF_OPTIONS["first_calls"] = {first_calls!r}     # (zoo's own harness waits: its judge checks compiled graphs)
if not {cold!r}:     # --cold: nothing started before the timed call (compile workers, Triton's driver, g++)
    tiny = compile_with({{"dynamo": "inductor", "aot": "inductor", "saved": "torchfuse", "inductor-saved": "inductor"}}.get(backend, backend), torch.nn.Linear(4, 4).to(device))
    tiny(torch.randn(2, 4, device=device)).sum().backward()
    torch._dynamo.reset()
torchfuse.counters.seconds.clear()
torchfuse.counters.clear()
zm = BY_NAME[name]
model, inputs = zm.make("gpu" if device == "cuda" else "cpu", device,
                        torch.bfloat16 if dtype == "bf16" else torch.float32)
if device == "cuda":
    torch.cuda.synchronize()
t0 = time.perf_counter()
make = ((lambda m: torch.compile(m, backend={{"dynamo": "eager", "aot": "aot_eager"}}[backend])) if backend in ("dynamo", "aot")
        else (lambda m: compile_with(backend, m)))
if backend in ("saved", "inductor-saved"):     # a saved program: the cold process saves it, the warm one loads it
    torch._dynamo.config.enable_aot_compile = True     # off by default before torch 2.13
    program = os.path.join(os.path.dirname(caches["TORCHFUSE_CACHE_DIR"]), "program.tf")
    # a program saves only guards that survive a restart: tensor metadata and global state (the
    # saved program must be called with a model of the same structure)
    portable = getattr(torch.compiler, "keep_portable_guards_unsafe", None) or (lambda guards: [
        g.guard_type in ("GLOBAL_STATE", "SHAPE_ENV") or (g.guard_type == "TENSOR_MATCH" and not g.is_global)
        for g in guards])
    def call_model(m, *args):
        return m(*args)
    def make(m):
        if os.path.exists(program):
            with open(program, "rb") as f:
                loaded = torch.compiler.load_compiled_function(f)
        else:
            loaded = torch.compile(call_model, fullgraph=True, backend={{"saved": "torchfuse", "inductor-saved": "inductor"}}[backend],
                                   options={{"guard_filter_fn": portable}}).aot_compile(((m, *inputs), {{}}))
            loaded.save_compiled_function(program)
        return lambda *args: loaded(m, *args)
if train:
    model.train()
    step = TrainStep(model, make(model), zm.loss, inputs)
else:
    compiled = make(model)
    def step():
        with torch.no_grad():
            return compiled(*inputs)
step()
if device == "cuda":
    torch.cuda.synchronize()
first = time.perf_counter()
# kernels still compiling in the background (first_calls="eager"): the first call did not wait
# for them; "until compiled" is when the last of them was ready
ready = torchfuse.wait_compiled()
until = max(first, ready)
t1 = time.perf_counter()
step()           # the next call, on the compiled graphs (loading binaries a first launch loads)
if device == "cuda":
    torch.cuda.synchronize()
print("RESULT", json.dumps({{"first_call_s": first - t0, "until_compiled_s": until - t0,
                            "next_call_s": time.perf_counter() - t1,
                            "stages": dict(torchfuse.counters.seconds),
                            "graphs_linked": torchfuse.counters["compiled_graph_loads"],
                            "counters": {{k: v for k, v in torchfuse.counters.items()
                                         if k.startswith("kernels_") or k in ("calls_tiered", "tiered_switches")}}}}))
'''


def run_child(name: str, backend: str, args: argparse.Namespace, caches: str) -> dict:
    env = dict(os.environ, TORCHFUSE_CACHE_DIR=os.path.join(caches, "torchfuse"),
               TORCHINDUCTOR_CACHE_DIR=os.path.join(caches, "inductor"), TRITON_CACHE_DIR=os.path.join(caches, "triton"))
    name, _, mode = name.partition(":")       # "resnet50:train": a training step whatever --train says
    code = CHILD.format(bench=os.path.dirname(os.path.abspath(__file__)), name=name, backend=backend,
                        device=args.device, dtype=args.dtype, train=args.train or mode == "train", cold=args.cold,
                        first_calls=args.first_calls)
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=args.timeout)
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    return {"error": (proc.stderr.strip().splitlines() or ["no output"])[-1][:300]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", default="gpt2,resnet50", help="comma-separated zoo model names")
    ap.add_argument("--backends", default="dynamo,torchfuse,saved,inductor,inductor-saved",
                    help="dynamo: Dynamo's trace alone (backend='eager'), the floor of any warm start; saved "
                         "(inductor-saved): torchfuse (Inductor) through aot_compile, saved by the cold process and "
                         "loaded by the warm one")
    ap.add_argument("--device", default="cuda" if _has_cuda() else "cpu")
    ap.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    ap.add_argument("--train", action="store_true", help="a training step instead of inference")
    ap.add_argument("--timeout", type=float, default=900)
    ap.add_argument("--cold-only", action="store_true", help="skip the warm start (the second process)")
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--cold", action="store_true",
                    help="cold starts only, as on a fresh machine: nothing compiled before the timed call (compile "
                         "workers, Triton's driver, the C++ compiler start inside it), every cache empty; the "
                         "backends alternate, --rounds times; a model named NAME:train is a training step")
    ap.add_argument("--rounds", type=int, default=3, help="with --cold: rounds of fresh processes")
    ap.add_argument("--first-calls", choices=("eager", "wait"), default="eager",
                    help="torchfuse's first_calls option: eager (the default: calls made while kernels compile in "
                         "the background run through ATen) or wait (the first call waits for the kernels)")
    args = ap.parse_args()
    if args.cold:
        cold_table(args)
        return
    results: dict[str, dict[str, dict]] = {}
    for name in args.only.split(","):
        for backend in args.backends.split(","):
            with tempfile.TemporaryDirectory(prefix="compile-bench-") as caches:
                cold = run_child(name, backend, args, caches)
                warm = {} if args.cold_only else run_child(name, backend, args, caches)
            results.setdefault(name, {})[backend] = {"cold": cold, "warm": warm}
            print(f"{name} {backend}: cold {cold}, warm {warm}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    mode = "train" if args.train else "infer"
    lines = [f"\n{args.device} {args.dtype} {mode}: first-call seconds (cold / warm), torchfuse stages of the "
             f"{'cold' if args.cold_only else 'warm'} start",
             "| model | Dynamo alone warm | Dynamo + AOTAutograd cold | Inductor cold | Inductor warm | torchfuse cold | torchfuse warm | tf/ind cold "
             "| tf/ind warm | saved, load + first call: Inductor / tf | tf saved / Ind warm | tf stages |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, by in results.items():
        get = lambda b, k: by.get(b, {}).get(k, {}).get("first_call_s")  # noqa: E731
        ic, iw, tc, tw = get("inductor", "cold"), get("inductor", "warm"), get("torchfuse", "cold"), get("torchfuse", "warm")
        f = lambda v: "—" if v is None else f"{v:.2f}"  # noqa: E731
        r = lambda a, b: "—" if a is None or not b else f"{a / b:.2f}x"  # noqa: E731
        stages = by.get("torchfuse", {}).get("cold" if args.cold_only else "warm", {}).get("stages", {})
        lines.append(f"| {name} | {f(get('dynamo', 'warm'))} | {f(get('aot', 'cold'))} | {f(ic)} | {f(iw)} | {f(tc)} | {f(tw)} | {r(tc, ic)} | {r(tw, iw)} | "
                     f"{f(get('inductor-saved', 'warm'))} / {f(get('saved', 'warm'))} | {r(get('saved', 'warm'), iw)} | "
                     + ", ".join(f"{k} {v:.2f}" for k, v in sorted(stages.items(), key=lambda kv: -kv[1])) + " |")
    print("\n".join(lines))


def cold_table(args: argparse.Namespace) -> None:
    """--cold: per model, each backend's cold first call in fresh processes, backends alternating,
    the median of the rounds; for torchfuse also the time until every kernel was compiled (with
    first_calls="eager" calls before then run through ATen, and the first call does not wait
    for kernels), the next call's time, its wait for kernel compilation ("precompile: wait"), the
    calls run through ATen and where its kernels were compiled."""
    import statistics
    backends = [b for b in args.backends.split(",") if b in ("torchfuse", "inductor")] or ["torchfuse", "inductor"]
    rows = []
    for name in args.only.split(","):
        runs: dict[str, list[dict]] = {b: [] for b in backends}
        for _ in range(args.rounds):
            for backend in backends:
                with tempfile.TemporaryDirectory(prefix="compile-bench-") as caches:
                    result = run_child(name, backend, args, caches)
                print(f"{name} {backend}: {json.dumps(result)}", flush=True)
                runs[backend].append(result)
        med = {b: statistics.median(r["first_call_s"] for r in rs) if rs and all("first_call_s" in r for r in rs)
               else None for b, rs in runs.items()}
        tf = [r for r in runs.get("torchfuse", []) if "first_call_s" in r]

        def tf_median(get) -> float | None:
            return statistics.median(get(r) for r in tf) if tf else None
        wait = tf_median(lambda r: r["stages"].get("precompile: wait", 0.0))
        until = tf_median(lambda r: r.get("until_compiled_s", r["first_call_s"]))
        next_call = tf_median(lambda r: r.get("next_call_s", 0.0))
        where = tf[-1].get("counters", {}) if tf else {}
        rows.append((name, med.get("inductor"), med.get("torchfuse"), until, next_call, wait,
                     where.get("calls_tiered", 0),
                     f"{where.get('kernels_compiled_in_workers', 0)} / {where.get('kernels_compiled_while_waiting', 0)}"))
    f = lambda v: "—" if v is None else f"{v:.2f}"  # noqa: E731
    print(f"\n{args.device} {args.dtype}: cold first call, fresh process, all caches empty (median of {args.rounds}, "
          f"backends alternating), seconds; torchfuse first_calls={args.first_calls!r}")
    print("| model | Inductor | torchfuse first call | tf/ind | tf until compiled | tf next call | tf waits for kernels "
          "| calls through ATen | kernels in workers / while waiting |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name, ind, tf_s, until, next_call, wait, tiered, where in rows:
        ratio = "—" if ind is None or tf_s is None else f"{tf_s / ind:.2f}x"
        print(f"| {name} | {f(ind)} | {f(tf_s)} | {ratio} | {f(until)} | {f(next_call)} | {f(wait)} | {tiered} "
              f"| {where} |")


def _has_cuda() -> bool:
    try:
        import torch
        return torch.cuda.is_available()
    except ImportError:
        return False


if __name__ == "__main__":
    main()
