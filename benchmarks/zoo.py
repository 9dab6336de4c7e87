"""Model zoo benchmark: eager vs Inductor vs torchfuse on every zoo model (zoo_models.py), the
yardstick for every change.

    python benchmarks/zoo.py                                  # all rows; CUDA if there is one
    python benchmarks/zoo.py --device cpu --only resnet18,bert --budget 2
    python benchmarks/zoo.py --family decoder --train --shard 2/4 --json shard2.json
    python benchmarks/zoo.py --list

A row is one model in one mode: inference in fp32, inference in bf16 (bf16 weights and inputs),
or one fp32 training step (forward, loss, backward through the compiled model, then an eager
`SGD(momentum=0.9, foreach=True)` step).  Per row and backend (eager, Inductor = `torch.compile(m)`
with random ops through ATen's generator (fallback_random, as in PyTorch's accuracy runs),
torchfuse = `torch.compile(m, backend="torchfuse")`, Dynamo reset before each compile; every
judged run from one RNG seed, so that dropout draws the same mask in each):

  * cold compile: the first call (Dynamo, AOTAutograd, the compiler; for training the whole first
    step, backward graph included), with the Inductor, Triton and torchfuse caches in fresh temp
    folders for this process, after each backend compiled a tiny function (imports and CUDA
    start-up not counted); torchfuse's share by stage is printed and kept in --json;
  * accuracy, judged as PyTorch's benchmark harness judges it (torchfuse.tools.accuracy, see
    Judge): every output tensor, or the forward's output tensors and every parameter gradient of
    the first training step (all backends start from the same weights: each trains its own deep
    copy), against the model in higher precision (fp64 for fp32 rows, fp32 for bf16 rows); a compiler passes if its
    RMSE is within 1.5x eager's at the row's precision plus a small floor (bf16: and a cosine
    similarity of 0.99); the table shows the worst tensor's error as a multiple of eager's;
  * no silent fallback: torchfuse compiles with options={"strict": True, "sync_checks": False,
    "first_calls": "wait"} (strict's raise on a failed build, not its synchronization after every
    call; the first call waits for its kernels rather than running through ATen meanwhile), and a
    row whose graphs ran eagerly for any reason fails with the reason;
  * time per call: on CUDA, CUDA events around back-to-back calls, median of the samples
    (gpu_bench.bench), one backend after the other, TF32 off, and for a row whose backends all
    run under HOST_BOUND_MS again with the backends taking turns (a host-bound
    row's time is the host's, which has slow phases seconds long); on CPU, the three interleaved in
    blocks within --budget seconds (cpu_bench's _time_interleaved, through _time_quietly: --wait
    waits for other processes to go quiet), so that load from other processes hits all three
    alike, and the table notes how many cores other processes used meanwhile;
  * peak CUDA memory above what was allocated before the backend ran (inference: activations
    and workspace; training: also the model copy, its gradients and momentum), the first call's
    or the timed calls', less what the accuracy check keeps (garbage collected before and after it);
  * torchfuse's kernels generated and ATen fallback ops in the row's graphs (torchfuse.counters).

A backend that fails is reported with a short reason and the row carries on.  The markdown table
is printed as rows complete, then a summary; --out saves both, --json every number (shards merge
by concatenating their "rows").
"""
from __future__ import annotations

import os
import tempfile

# Fresh compile caches, set before torch, Triton or torchfuse are imported (as gpu_bench does).
def cache_dirs(root: str) -> dict[str, str]:
    """The environment that puts Inductor's, Triton's and torchfuse's caches under `root`."""
    return {var: os.path.join(root, sub) for var, sub in
            (("TORCHINDUCTOR_CACHE_DIR", "inductor"), ("TRITON_CACHE_DIR", "triton"),
             ("TORCHFUSE_CACHE_DIR", "torchfuse"))}


_CACHE_ROOT = tempfile.mkdtemp(prefix="tf-zoo-")
_CACHE_DIRS = cache_dirs(_CACHE_ROOT)
os.environ.update(_CACHE_DIRS)

import argparse  # noqa: E402
import copy  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402
import warnings  # noqa: E402
from dataclasses import asdict, dataclass, field  # noqa: E402
from typing import Callable  # noqa: E402

os.environ.setdefault("TORCHFUSE_FIRST_CALLS", "wait")   # timings are of compiled graphs, not the ATen tier
import torch  # noqa: E402
import torch.nn as nn  # noqa: E402

import torchfuse  # noqa: E402
from cpu_bench import _short, _time_interleaved, _time_quietly, machine_line  # noqa: E402
from gpu_bench import bench as cuda_bench  # noqa: E402
from torchfuse.tools.accuracy import flatten  # noqa: E402
from zoo_judge import (PERTURBATION, PERTURBED_RUNS, RNG_SEED, Judge, free_memory, perturbed_errors,  # noqa: E402,F401
                       precise_reference, reference_run, reset_rng, row_tensors)
from zoo_models import FAMILIES, MODELS, SIZES, ZooModel  # noqa: E402

# Importing the two benchmarks above points the cache variables at their own fresh folders;
# point them back at ours (nothing has compiled yet, so every cache is still cold).
os.environ.update(_CACHE_DIRS)

BACKENDS = ("eager", "inductor", "torchfuse")
COMPILERS = BACKENDS[1:]
COUNTER_KEYS = ("graphs_compiled", "kernels_generated", "fallback_ops", "eager_fallbacks")


# ----------------------------------------------------------------------------------------------
# results
# ----------------------------------------------------------------------------------------------
@dataclass
class Result:
    """One backend in one row."""
    ms: float | None = None
    compile_s: float | None = None      # first call, Dynamo included
    peak_mib: float | None = None
    err: float | None = None            # compilers: worst tensor's error vs the reference over eager's;
                                        # eager: its worst relative RMSE vs the reference
    ok: bool | None = None
    error: str | None = None            # why the backend failed


@dataclass
class Row:
    model: str
    family: str
    mode: str            # "infer" | "train"
    dtype: str           # "fp32" | "bf16"
    size: str
    device: str
    results: dict[str, Result] = field(default_factory=lambda: {b: Result() for b in BACKENDS})
    tf_counters: dict[str, int] = field(default_factory=dict)
    tf_stages: dict[str, float] = field(default_factory=dict)   # seconds of the first call, by stage
    notes: list[str] = field(default_factory=list)

    @property
    def name(self) -> str:
        return f"{self.model} {self.mode}-{self.dtype}"

    def ratio(self, num: str, den: str = "torchfuse", key: str = "ms") -> float | None:
        a, b = getattr(self.results[num], key), getattr(self.results[den], key)
        return a / b if a and b else None


# ----------------------------------------------------------------------------------------------
# running one row
# ----------------------------------------------------------------------------------------------
# extra torchfuse options (--tf-options), e.g. {"channels_last_convs": false} to compare layouts
TF_OPTIONS: dict = {}


def compile_with(backend: str, model: nn.Module) -> Callable:
    if backend == "eager":
        return model
    if backend == "inductor":
        # random ops through ATen's generator, as PyTorch's harness compiles for its accuracy runs:
        # Inductor's own Philox stream would draw another dropout mask than eager's (the same for
        # eager and torchfuse, which keeps ATen's random ops), and the judge would compare masks
        return torch.compile(model, options={"fallback_random": True})
    # strict: a graph torchfuse cannot compile raises (the row fails with the reason) instead of
    # running eagerly with a warning; without strict's synchronization after every call to read
    # the index checks (a bad index still raises, at the next call), which serialized host and
    # GPU in every row whose graphs check an index (embeddings, gathers, scatters); the first call
    # waits for kernels compiling in the background (first_calls="wait"), so the judge and the
    # timings see the compiled graphs, never the ATen tier that would run meanwhile
    return torch.compile(model, backend="torchfuse",
                         options={"strict": True, "sync_checks": False, "first_calls": "wait", **TF_OPTIONS})


class TrainStep:
    """forward (compiled or not), loss, backward, then an eager SGD step with momentum."""

    def __init__(self, model: nn.Module, forward: Callable, loss: Callable, inputs: tuple):
        self.forward, self.loss, self.inputs = forward, loss, inputs
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.opt = torch.optim.SGD(self.params, lr=1e-3, momentum=0.9, foreach=True)

    def __call__(self) -> torch.Tensor:
        loss = self._backward()
        self.opt.step()
        return loss

    def first(self) -> tuple[torch.Tensor, list[torch.Tensor], list[torch.Tensor]]:
        """One step from RNG_SEED (the reference's dropout mask: reset_rng); returns the loss,
        copies of the gradients it stepped with, and the forward's output tensors (copied to the
        CPU: held on the device through the backward, they would add to the row's peak)."""
        reset_rng()
        outputs: list[torch.Tensor] = []
        loss = self._backward(outputs)
        grads = [p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p) for p in self.params]
        self.opt.step()
        return loss, grads, outputs

    def _backward(self, outputs: list | None = None) -> torch.Tensor:
        self.opt.zero_grad(set_to_none=True)
        out = self.forward(*self.inputs)
        if outputs is not None:
            outputs.extend(t.detach().cpu() for t in flatten(out))
        loss = self.loss(out, self.inputs)
        del out
        loss.backward()
        return loss.detach()


MiB = 2 ** 20


def cuda_memory(device: str) -> tuple[int, int]:
    """(peak, current) bytes allocated on the CUDA device; zeros on the CPU."""
    if device != "cuda":
        return 0, 0
    return torch.cuda.max_memory_allocated(), torch.cuda.memory_allocated()


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _back_to_back_ms(fn: Callable, calls: int = 20) -> float:
    """Wall-clock milliseconds per call over `calls` calls with one synchronize at the end: a
    host-bound row's host time, next to the CUDA-event timing of a few calls per sample."""
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / calls * 1e3


# A CUDA row this fast (ms per call) is timed again with the backends taking turns: its time is
# mostly the host's, and the lent machines' hosts have slow phases seconds long (opt bf16
# inference: Inductor 5.1 then 3.3 ms per call in one process, torchfuse 4.8 then 2.6), which a
# timing of one backend after another hands to whichever was being timed.  Small CNNs' training
# steps are host-bound too (mobilenet_v3: 10 ms of GPU time in a 20-24 ms step, by the profiler;
# in one run torchfuse 0.88x Inductor timed after it, 1.38x in the profiler's run).
HOST_BOUND_MS = 30.0


# --batch: the rows' inputs cut to this many samples (0: the size's own batch)
BATCH = 0


def small_batch(inputs: tuple, batch: int) -> tuple:
    """The first `batch` samples of every batched tensor input (dim 0 as long as the first
    tensor's; layout kept: a channels-last image stays channels-last): the host-bound regime of
    small-batch inference.  (Not for graph rows: their node features' dim 0 is no batch.)"""
    tensors = [x for x in inputs if isinstance(x, torch.Tensor) and x.dim() > 0]
    if not tensors or tensors[0].shape[0] <= batch:
        return inputs
    n = tensors[0].shape[0]
    return tuple(x[:batch].clone() if isinstance(x, torch.Tensor) and x.dim() > 0 and x.shape[0] == n else x
                 for x in inputs)


def run_row(zm: ZooModel, mode: str, dtype: str, size: str, device: str, budget: float, wait: float,
            backends: tuple[str, ...], verbose: bool, compile_only: bool = False) -> Row:
    """One row.  Each backend is compiled afresh (Dynamo reset first) and called once: cold compile
    time and accuracy.  On CUDA it is then timed and dropped; on CPU all are kept and timed together
    at the end (Inductor then recompiles once, from its warm caches, in the timing's warm-up: the
    reset before torchfuse's compile dropped its Dynamo cache entry).  `compile_only`: the first
    call alone (no accuracy check, no timing)."""
    row = Row(zm.name, zm.family, mode, dtype, size, device)
    torch_dtype = torch.bfloat16 if dtype == "bf16" else torch.float32
    train = mode == "train"
    model, inputs = zm.make(size, device, torch_dtype)
    if BATCH and zm.family != "graph":     # (a graph's node features have no batch dim)
        inputs = small_batch(inputs, BATCH)
    if train:
        model.train()
    judge = Judge(row, model, inputs, zm.loss, [n for n, p in model.named_parameters() if p.requires_grad])
    if not compile_only:
        try:
            judge.reference()   # now, so that it is not counted in eager's peak memory
        except Exception as e:   # the model cannot run in higher precision: time it, judge nothing
            judge.unavailable = f"no {'fp32' if dtype == 'bf16' else 'fp64'} reference: {_short(e)}"
            row.notes.append(judge.unavailable)
            print(f"  !! {judge.unavailable}", flush=True)
    timed: dict[str, Callable] = {}
    host_bound: dict[str, Callable] = {}   # CUDA rows under HOST_BOUND_MS, kept to time again
    with torch.set_grad_enabled(train):
        for backend in backends:
            res = row.results[backend]
            torch._dynamo.reset()
            free_memory()
            base = cuda_memory(device)[1]
            if device == "cuda":
                torch.cuda.reset_peak_memory_stats()
            before = dict(torchfuse.counters)
            stages_before = dict(torchfuse.counters.seconds)
            try:
                with warnings.catch_warnings(record=True) as caught:
                    warnings.simplefilter("always")
                    if train:
                        m = copy.deepcopy(model)
                        fn: Callable = TrainStep(m, compile_with(backend, m), zm.loss, inputs)
                        first: Callable = fn.first
                    else:
                        fwd = compile_with(backend, model)
                        fn = lambda fwd=fwd, inputs=inputs: fwd(*inputs)
                        first = lambda fn=fn: (reset_rng(), fn())[1]   # judged: from the reference's seed
                    _sync(device)
                    t0 = time.perf_counter()
                    out = first()
                    _sync(device)
                    res.compile_s = time.perf_counter() - t0
                if backend == "torchfuse":
                    row.tf_counters = {k: torchfuse.counters[k] - before.get(k, 0) for k in COUNTER_KEYS}
                    row.tf_stages = {k: round(v - stages_before.get(k, 0.0), 3)
                                     for k, v in torchfuse.counters.seconds.items() if v > stages_before.get(k, 0.0)}
                    print(f"  torchfuse first call {res.compile_s:.1f} s; stages: " + ", ".join(
                        f"{k} {v:.2f}" for k, v in sorted(row.tf_stages.items(), key=lambda kv: -kv[1])[:8]), flush=True)
                    ours = [str(w.message).splitlines()[0][:300] for w in caught if "torchfuse" in str(w.message)]
                    for w in ours:
                        print(f"  warning: {w}", flush=True)
                    if row.tf_counters["eager_fallbacks"]:
                        # strict mode raises on a failed build; a graph refused whole at lowering
                        # (Unsupported) still runs eagerly: a failed row all the same
                        eager_runs = [w for w in ours if "eagerly" in w]
                        raise RuntimeError(f"{row.tf_counters['eager_fallbacks']} graph(s) ran eagerly: "
                                           + "; ".join(eager_runs or ["no warning"]))
                if compile_only:
                    del out
                    continue
                peak, held_now = cuda_memory(device)
                # Garbage of the first call waiting for the collector is not what the backend
                # holds; collected later, inside the judge, it would make the judge's share
                # negative and inflate the timing's peak by its size.
                free_memory()
                held = cuda_memory(device)[1]
                judge(backend, out)
                free_memory()
                judged = cuda_memory(device)[1] - held   # an fp64 reference: not this backend's memory
                del out
                if device == "cuda":
                    torch.cuda.reset_peak_memory_stats()
                    res.ms = cuda_bench(fn, reps=10, inner=3)
                    timed_peak = cuda_memory(device)[0]
                    res.peak_mib = (max(peak, timed_peak - judged) - base) / MiB
                    print(f"  {backend} ms per call: {res.ms:.3f} by CUDA events, "
                          f"{_back_to_back_ms(fn):.3f} back to back (wall clock over 20 calls)", flush=True)
                    if res.ms < HOST_BOUND_MS:
                        host_bound[backend] = fn
                    print(f"  {backend} memory MiB above the row's start: first call peak {(peak - base) / MiB:.0f}, "
                          f"held after it {(held_now - base) / MiB:.0f} ({(held - base) / MiB:.0f} once collected), "
                          f"judge keeps {judged / MiB:.0f}, timed steps peak {(timed_peak - judged - base) / MiB:.0f}",
                          flush=True)
                else:
                    timed[backend] = fn
            except Exception as e:   # keep the row going; report the failure
                res.error = _short(e)
                print(f"  !! {backend} failed on {row.name}: {res.error}", flush=True)
                if verbose:
                    traceback.print_exc()
            finally:
                # this backend's model copy and code go (kept in `timed` on CPU, and in `host_bound`
                # for a fast CUDA row)
                fn = first = fwd = m = None
        if timed:
            time_on_cpu(row, timed, budget, wait, verbose)
        timed_alone = [b for b in backends if row.results[b].ms is not None]
        if len(host_bound) > 1 and set(host_bound) == set(timed_alone):
            # every backend is host-bound: timed again, taking turns (the reset before each
            # compile dropped Inductor's Dynamo entry: it recompiles from its caches in the warm-up)
            try:
                seconds = _time_interleaved(host_bound, (), budget, torch.cuda.synchronize)
                times = {b: t * 1e3 for b, t in seconds.items()}
            except Exception as e:
                print(f"  !! interleaved timing failed on {row.name}: {_short(e)}", flush=True)
            else:
                print("  taking turns, ms per call: " + ", ".join(
                    f"{b} {row.results[b].ms:.3f} -> {t:.3f}" for b, t in times.items()), flush=True)
                for b, t in times.items():
                    row.results[b].ms = t
                row.notes.append("host-bound: timed taking turns")
    del model, inputs, judge, timed, host_bound
    torch._dynamo.reset()
    free_memory()
    return row


def warm_up(backends: tuple[str, ...], device: str) -> None:
    """Compile a tiny function with every backend first (forward and backward), as compile_bench
    does, so that the first row's cold compile does not also carry imports, CUDA start-up and
    Triton's driver build, which later rows never pay."""
    for backend in backends:
        torch._dynamo.reset()
        fn = compile_with(backend, nn.Linear(4, 4).to(device))
        fn(torch.randn(2, 4, device=device)).relu().sum().backward()
    torch._dynamo.reset()
    _sync(device)


def time_on_cpu(row: Row, fns: dict[str, Callable], budget: float, wait: float, verbose: bool) -> None:
    """Interleaved medians (waiting up to `wait` s for other processes to go quiet, and retrying a
    timing they disturbed, as cpu_bench does); if a backend throws while timing, time the others alone."""
    try:
        times, load = _time_quietly(fns, (), budget, wait, 3 if wait > 0 else 1)
        if load is not None and load >= 0.15:
            row.notes.append(f"other processes used {load:.2f} cores while timing")
    except Exception:
        times = {}
        for name, fn in fns.items():
            try:
                times.update(_time_interleaved({name: fn}, (), budget / len(fns)))
            except Exception as e:
                row.results[name].error = f"while timing: {_short(e)}"
                print(f"  !! {name} failed while timing {row.name}: {_short(e)}", flush=True)
                if verbose:
                    traceback.print_exc()
    for name, seconds in times.items():
        row.results[name].ms = seconds * 1e3


# ----------------------------------------------------------------------------------------------
# reporting
# ----------------------------------------------------------------------------------------------
HEAD = ("| model | mode | eager ms | inductor ms | torchfuse ms | ind/tf | eager/tf | acc inductor | acc torchfuse "
        "| compile s ind / tf | peak MiB eager / ind / tf | tf kernels | tf fallbacks | notes |")


def _num(v: float | None, fmt: str = ".2f") -> str:
    return "-" if v is None else format(v, fmt)


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v:.3f}" if v < 10 else f"{v:.1f}"


def _acc(r: Result) -> str:
    if r.error:
        return "error"
    if r.ok is None:
        return "-"
    return f"{'ok' if r.ok else 'FAIL'} {r.err:.2f}x"


def table_line(row: Row) -> str:
    r = row.results
    notes = list(row.notes)
    if r["eager"].err is not None:
        notes.insert(0, f"eager rel. RMSE vs {'fp32' if row.dtype == 'bf16' else 'fp64'} {r['eager'].err:.1e}")
    if row.tf_counters.get("graphs_compiled", 0) > (2 if row.mode == "train" else 1):
        notes.append(f"{row.tf_counters['graphs_compiled']} torchfuse graphs")
    notes += [f"{b}: {r[b].error}" for b in BACKENDS if r[b].error]
    cells = [row.model, f"{row.mode}-{row.dtype}", _ms(r["eager"].ms), _ms(r["inductor"].ms), _ms(r["torchfuse"].ms),
             _num(row.ratio("inductor")), _num(row.ratio("eager")), _acc(r["inductor"]), _acc(r["torchfuse"]),
             f"{_num(r['inductor'].compile_s, '.1f')} / {_num(r['torchfuse'].compile_s, '.1f')}",
             " / ".join(_num(r[b].peak_mib, ".0f") for b in BACKENDS),
             str(row.tf_counters.get("kernels_generated", "-")), str(row.tf_counters.get("fallback_ops", "-")),
             "; ".join(notes).replace("|", "/")]
    return "| " + " | ".join(cells) + " |"


def markdown_table(rows: list[Row]) -> str:
    return "\n".join([HEAD, "|" + "---|" * HEAD.count(" | ") + "---|"] + [table_line(r) for r in rows])


def geomean(values: list[float]) -> float | None:
    return math.exp(sum(math.log(v) for v in values) / len(values)) if values else None


def summary(rows: list[Row]) -> str:
    vs_ind = [(r.ratio("inductor"), r.name) for r in rows if r.ratio("inductor")]
    vs_eager = [(r.ratio("eager"), r.name) for r in rows if r.ratio("eager")]
    compile_ratio = [r.ratio("torchfuse", "inductor", "compile_s") for r in rows
                     if r.ratio("torchfuse", "inductor", "compile_s")]
    failures = [f"{r.name} ({b} {r.results[b].err:.2f}x eager's error)" for r in rows for b in COMPILERS if r.results[b].ok is False]
    errors = [f"{r.name} ({b}: {r.results[b].error})" for r in rows for b in BACKENDS if r.results[b].error]
    eager_runs = [f"{r.name} ({r.tf_counters['eager_fallbacks']})" for r in rows if r.tf_counters.get("eager_fallbacks")]
    worst = min(vs_ind, default=None)
    slow_compiles = [f"{r.name} {r.mode}-{r.dtype} ({r.ratio('torchfuse', 'inductor', 'compile_s'):.2f}x)" for r in rows
                     if (r.ratio("torchfuse", "inductor", "compile_s") or 0) > 0.6]

    def listing(items: list[str]) -> str:
        return ", ".join(items) if items else "none"

    lines = [
        "## Summary",
        f"- rows: {len(rows)}",
        f"- geomean speed-up of torchfuse over Inductor (inductor ms / torchfuse ms, > 1: torchfuse faster): "
        f"{_num(geomean([v for v, _ in vs_ind]), '.3f')} over {len(vs_ind)} rows",
        f"- geomean speed-up of torchfuse over eager: {_num(geomean([v for v, _ in vs_eager]), '.3f')} "
        f"over {len(vs_eager)} rows",
        f"- worst row vs Inductor: {f'{worst[0]:.2f}x {worst[1]}' if worst else '-'}",
        f"- torchfuse slower than eager: {listing([f'{n} ({v:.2f}x)' for v, n in vs_eager if v < 1])}",
        f"- torchfuse below 0.9x Inductor: {listing([f'{n} ({v:.2f}x)' for v, n in vs_ind if v < 0.9])}",
        f"- accuracy failures: {listing(failures)}",
        f"- backend errors: {listing(errors)}",
        f"- torchfuse graphs that ran eagerly: {listing(eager_runs)}",
        f"- accuracy not judged (no higher-precision reference): "
        f"{listing([r.name for r in rows if any(' reference: ' in n for n in r.notes)])}",
        f"- geomean cold-compile ratio torchfuse / Inductor (< 1: torchfuse compiles faster): "
        f"{_num(geomean(compile_ratio), '.3f')} over {len(compile_ratio)} rows",
        f"- cold compile above 0.6x Inductor's: {listing(slow_compiles)}",
    ]
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------------
# selection and main
# ----------------------------------------------------------------------------------------------
def zoo_models(zoo: str) -> tuple[list[ZooModel], tuple[str, ...]]:
    """The models and families of --zoo: "hand" (zoo_models.py), "library" (zoo_library.py: the
    libraries' own models, those whose library imports) or "all"."""
    if zoo == "hand":
        return MODELS, FAMILIES
    import zoo_library
    for lib, why in zoo_library.missing().items():
        if why:
            print(f"zoo: {lib} rows left out ({why})")
    if zoo == "library":
        return zoo_library.LIBRARY_MODELS, zoo_library.LIBRARY_FAMILIES
    return MODELS + zoo_library.LIBRARY_MODELS, tuple(dict.fromkeys(FAMILIES + zoo_library.LIBRARY_FAMILIES))


def select_rows(only: str | None, families: str | None, modes: tuple[str, ...], dtype: str,
                shard: str | None, zoo: str = "hand") -> list[tuple[ZooModel, str, str]]:
    """(model, mode, dtype) rows in zoo order, filtered, then every N-th from the K-th for --shard K/N."""
    models, all_families = zoo_models(zoo)
    if only:
        wanted = [s.strip() for s in only.split(",") if s.strip()]
        unknown = sorted(set(wanted) - {m.name for m in models})
        if unknown:
            raise SystemExit(f"unknown model(s) {unknown}; see --list")
        models = [m for m in models if m.name in wanted]
    if families:
        wanted_f = {s.strip() for s in families.split(",") if s.strip()}
        if wanted_f - set(all_families):
            raise SystemExit(f"unknown famil(ies) {sorted(wanted_f - set(all_families))}; "
                             f"known: {', '.join(all_families)}")
        models = [m for m in models if m.family in wanted_f]
    kinds = [("infer", "fp32"), ("infer", "bf16"), ("train", "fp32")]
    rows = [(m, mode, dt) for m in models for mode, dt in kinds
            if mode in modes and dtype in (dt, "all") and (mode == "infer" or m.trainable) and (dt != "bf16" or m.bf16)]
    if shard:
        k, n = (int(v) for v in shard.split("/"))
        if not 1 <= k <= n:
            raise SystemExit("--shard K/N needs 1 <= K <= N")
        rows = rows[k - 1::n]
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--zoo", choices=("hand", "library", "all"), default="hand",
                   help="hand: the hand-written and transformers models of zoo_models.py; library: the libraries' "
                        "own models (zoo_library.py: timm, torchvision, torchaudio, transformers, torch_geometric)")
    p.add_argument("--only", help="comma-separated model names")
    p.add_argument("--family", help="comma-separated families: " + ",".join(FAMILIES))
    p.add_argument("--shard", help="K/N: run the K-th of N deterministic slices of the selected rows (1 <= K <= N)")
    p.add_argument("--train", action="store_true", help="training rows only (default: training and inference)")
    p.add_argument("--infer", action="store_true", help="inference rows only (default: training and inference)")
    p.add_argument("--dtype", choices=("fp32", "bf16", "all"), default="all",
                   help="fp32: inference and training rows; bf16: inference rows (training is fp32 only)")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--size", choices=SIZES, help='model sizes (default: "gpu" on cuda, "cpu" on cpu)')
    p.add_argument("--budget", type=float, default=3.0, help="seconds of interleaved timing per row on CPU")
    p.add_argument("--wait", type=float, default=0.0,
                   help="CPU: before timing a row, wait up to this many seconds for other processes to go quiet "
                        "and retry a disturbed timing (cpu_bench's --wait); the table notes their load either way")
    p.add_argument("--out", help="write the markdown table and summary to this file")
    p.add_argument("--json", help="write every number to this file")
    p.add_argument("--no-inductor", action="store_true", help="skip Inductor")
    p.add_argument("--list", action="store_true", help="print the selected rows and exit")
    p.add_argument("--compile-only", action="store_true",
                   help="each compiler's cold first call alone, in the zoo's process and order (no eager, no accuracy "
                        "check, no timing)")
    p.add_argument("--verbose", action="store_true", help="print tracebacks of backend failures")
    p.add_argument("--tf-options", default="{}",
                   help='extra torchfuse options as JSON, e.g. \'{"channels_last_convs": false}\'')
    p.add_argument("--batch", type=int, default=0,
                   help="cut every row's batched inputs to this many samples (small-batch inference, the host-bound "
                        "regime; graph rows keep their graph)")
    p.add_argument("--cudnn-tf32", action="store_true",
                   help="keep cuDNN's TF32 for fp32 convolutions on (PyTorch's default; the zoo turns it off)")
    a = p.parse_args(argv)
    TF_OPTIONS.update(json.loads(a.tf_options))
    global BATCH
    BATCH = a.batch
    size = a.size or ("gpu" if a.device == "cuda" else "cpu")
    modes = ("train",) if a.train and not a.infer else ("infer",) if a.infer and not a.train else ("infer", "train")
    selected = select_rows(a.only, a.family, modes, a.dtype, a.shard, a.zoo)
    if a.list:
        for zm, mode, dt in selected:
            print(f"{zm.name:18s} {zm.family:9s} {mode}-{dt}")
        print(f"{len(selected)} rows")
        return 0
    if a.device == "cuda":
        if not torch.cuda.is_available():
            raise SystemExit("--device cuda: no CUDA device")
        # fp32 means fp32, as in Inductor's accuracy runs: cuDNN's TF32 default would let eager and
        # compiled convolutions pick different TF32 algorithms, ~1e-3 apart (far more in gradients
        # through train-mode BatchNorm), which would hide real errors under the tolerance.
        torch.backends.cudnn.allow_tf32 = a.cudnn_tf32
        torch.backends.cuda.matmul.allow_tf32 = False
    backends = tuple(b for b in BACKENDS
                     if not (a.no_inductor and b == "inductor") and not (a.compile_only and b == "eager"))
    device_name = torch.cuda.get_device_name() if a.device == "cuda" else machine_line()
    print(f"zoo: {len(selected)} rows, size {size!r}{f', batch {BATCH}' if BATCH else ''} on {device_name}; "
          f"torch {torch.__version__}")
    print(f"fresh caches under {_CACHE_ROOT}\n")
    print(HEAD, flush=True)
    warm_up(backends, a.device)
    rows: list[Row] = []
    t_start = time.perf_counter()
    for zm, mode, dt in selected:
        print(f"== {zm.name} {mode}-{dt}", flush=True)
        torch._dynamo.config.suppress_errors = False   # a backend's failure is the row's, never hidden
        try:
            row = run_row(zm, mode, dt, size, a.device, a.budget, a.wait, backends, a.verbose, a.compile_only)
        except Exception as e:   # building the model or its reference failed
            row = Row(zm.name, zm.family, mode, dt, size, a.device)
            row.notes.append(f"setup failed: {_short(e)}")
            print(f"  !! setup failed: {_short(e)}", flush=True)
            if a.verbose:
                traceback.print_exc()
            free_memory()
        rows.append(row)
        print(table_line(row), flush=True)
    total = time.perf_counter() - t_start
    report = (f"<!-- python benchmarks/zoo.py {' '.join(sys.argv[1:] if argv is None else argv)} -->\n"
              f"<!-- {device_name}, torch {torch.__version__}, size {size}, {total:.0f} s -->\n\n"
              f"{markdown_table(rows)}\n\n{summary(rows)}\n")
    print("\n" + report)
    if a.out:
        with open(a.out, "w") as f:
            f.write(report)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"device": device_name, "torch": torch.__version__, "size": size, "argv": argv or sys.argv[1:],
                       "rows": [{**asdict(r), "name": r.name} for r in rows]}, f, indent=1)
    return 0   # failures are reported in the table, not through the exit status


if __name__ == "__main__":
    sys.exit(main())
