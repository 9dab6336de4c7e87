"""What a new batch size costs: one zoo model compiled with torchfuse at its own batch, then called
at other batch sizes, counting for each size the graphs torchfuse compiled, the kernels it
generated, the Triton compiles this process ran itself, the first call's seconds, the largest
difference from eager, and the median time of later calls, torchfuse's and eager's (a graph
compiled for symbolic sizes should run as fast as eager and the static graph did).

    python benchmarks/probes/new_sizes.py --only llama --dtype bf16 --batches 4,16,3,32,5
    python benchmarks/probes/new_sizes.py --only resnet18 --mode train --batches 32,96,17,128

The target (issue "Compile latency"): after the first dynamic recompile (the first new size) no
size compiles a graph, generates a kernel or compiles a Triton kernel.  With `--dynamic` the model
is compiled with `dynamic=True`, and no size after the first compiles anything.  Inputs at a new
batch are rows of the model's example inputs, drawn at random (same rows for every backend).
"""
from __future__ import annotations

import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import zoo  # noqa: E402  (first: it points every compile cache at fresh folders)
import torch  # noqa: E402

import torchfuse  # noqa: E402
from compile_profile import _count_triton_compiles, row_parser, zoo_row  # noqa: E402

COUNTS = ("graphs_compiled", "kernels_generated")


def _rows(inputs: tuple[torch.Tensor, ...], batch: int, seed: int) -> tuple[torch.Tensor, ...]:
    """The example inputs at `batch` rows: rows drawn (with repeats) from the example's own."""
    gen = torch.Generator().manual_seed(seed)
    index = torch.randint(0, inputs[0].shape[0], (batch,), generator=gen).to(inputs[0].device)
    out = []
    for x in inputs:
        y = x.index_select(0, index)
        if x.dim() == 4 and x.is_contiguous(memory_format=torch.channels_last):
            y = y.contiguous(memory_format=torch.channels_last)
        out.append(y)
    return tuple(out)


def _ms(fn, device: str, calls: int = 5) -> float:
    """Median milliseconds of `calls` calls after one more (the size's steady speed)."""
    times = []
    for _ in range(calls + 1):
        start = time.perf_counter()
        fn()
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return sorted(times[1:])[calls // 2] * 1e3


def main() -> None:
    ap = row_parser(__doc__)
    ap.add_argument("--batches", default="4,16,3,32,5", help="batch sizes to call after the first")
    ap.add_argument("--dynamic", action="store_true", help="compile with dynamic=True")
    args = ap.parse_args()
    device = args.device
    zm, model, inputs = zoo_row(args)
    in_process = _count_triton_compiles()
    compiled = torch.compile(model, backend="torchfuse", dynamic=True if args.dynamic else None)
    if args.mode == "train":
        model.train()

    def run(fn, xs):
        if args.mode == "train":
            model.zero_grad(set_to_none=True)
            out = fn(*xs)
            out = out if isinstance(out, torch.Tensor) else out[0]
            zm.loss(out, xs).backward()
            return torch.cat([p.grad.flatten().float() for p in model.parameters() if p.grad is not None][:4])
        with torch.no_grad():
            out = fn(*xs)
        return (out if isinstance(out, torch.Tensor) else out[0]).float()

    rows = []
    for i, batch in enumerate([inputs[0].shape[0]] + [int(b) for b in args.batches.split(",")]):
        xs = inputs if i == 0 else _rows(inputs, batch, seed=i)
        before = {k: torchfuse.counters[k] for k in COUNTS}
        triton_before = in_process[0]
        start = time.perf_counter()
        got = run(compiled, xs)
        if device == "cuda":
            torch.cuda.synchronize()
        seconds = time.perf_counter() - start
        counts = [torchfuse.counters[k] - before[k] for k in COUNTS]
        want = run(model, xs)
        err = ((got - want).abs().max() / want.abs().max().clamp_min(1e-6)).item()
        rows.append((batch, *counts, in_process[0] - triton_before, seconds, err,
                     _ms(lambda: run(compiled, xs), device), _ms(lambda: run(model, xs), device)))
    print(f"# {args.only} {args.mode}-{args.dtype} on {device}{' dynamic=True' if args.dynamic else ''}"
          f" ({torch.cuda.get_device_name() if device == 'cuda' else 'cpu'})")
    print("| batch | graphs compiled | kernels generated | Triton compiles here | first call s | max rel err "
          "| torchfuse ms | eager ms |")
    print("|---|---|---|---|---|---|---|---|")
    for batch, graphs, kernels, tcomp, seconds, err, ms, eager_ms in rows:
        print(f"| {batch} | {graphs} | {kernels} | {tcomp} | {seconds:.2f} | {err:.1e} | {ms:.2f} | {eager_ms:.2f} |")


if __name__ == "__main__":
    main()
