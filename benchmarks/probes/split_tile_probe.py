"""GPU probe for split reductions and 2-D tiled pointwise kernels (issue 3); < 3 min on an H100.

    python benchmarks/probes/split_tile_probe.py            # prints the table
    OUT=/some/dir python benchmarks/probes/split_tile_probe.py   # also writes table, json, kernels

For each workload: eager, Inductor (torch.compile), torchfuse, and torchfuse with the new path
switched off ("tf old": split_reductions=False / flat 1-D pointwise kernels), in milliseconds
(median of CUDA-event samples, 10 back-to-back calls each) and achieved GB/s (each input read
once, each output written once).  The torchfuse columns also say which kernels ran (`_part` =
split reduction, `_tiled` = 2-D tile) and the max difference from eager.
"""
from __future__ import annotations

import json
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "src"))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import gpu_bench  # noqa: E402  (fresh Inductor/Triton/torchfuse caches, set before torch is imported)
import torch  # noqa: E402

import torchfuse  # noqa: E402
import torchfuse.codegen.triton as tgen  # noqa: E402

# `--smoke`: tiny sizes on the CPU (C++ backend, wall-clock timing) to check the script itself
SMOKE = "--smoke" in sys.argv
DEV = "cpu" if SMOKE else "cuda"
M = 64 if SMOKE else 1 << 20     # "64M" is 4096 elements in smoke mode
D = 128 if SMOKE else 8192


def bench(fn, *args, reps: int = 15, inner: int = 10) -> float:
    """gpu_bench's CUDA-event median; in smoke mode (CPU) a wall-clock mean of `inner` calls."""
    if not SMOKE:
        return gpu_bench.bench(fn, *args, reps=reps, inner=inner)
    for _ in range(3):
        fn(*args)
    t = time.perf_counter()
    for _ in range(inner):
        fn(*args)
    return (time.perf_counter() - t) / inner * 1e3


def rnd(*shape, dtype=torch.float32):
    return torch.randn(*shape, device=DEV, dtype=dtype)


def workloads():
    """(name, shape label, dtype, fn, make args, bytes moved, which new path)."""
    out = []
    for dt in (torch.float32, torch.bfloat16):
        e = torch.finfo(dt).bits // 8
        out.append(("sum", "64M", dt, lambda x: x.sum(), lambda dt=dt: (rnd(64 * M, dtype=dt),), 64 * M * e, "split"))
        out.append(("amax", "64M", dt, lambda x: x.amax(), lambda dt=dt: (rnd(64 * M, dtype=dt),), 64 * M * e, "split"))
    out.append(("mean", "64M", torch.float32, lambda x: x.mean(), lambda: (rnd(64 * M),), 64 * M * 4, "split"))
    out.append(("dot (x*y).sum", "64M", torch.float32, lambda x, y: (x * y).sum(),
                lambda: (rnd(64 * M), rnd(64 * M)), 2 * 64 * M * 4, "split"))
    out.append(("row sum dim 1", "8x8M", torch.float32, lambda x: x.sum(1), lambda: (rnd(8, 8 * M),), 64 * M * 4, "split"))
    out.append(("col sum dim 0", "8Mx8", torch.float32, lambda x: x.sum(0), lambda: (rnd(8 * M, 8),), 64 * M * 4, "split"))
    for dt in (torch.float32, torch.bfloat16):
        e = torch.finfo(dt).bits // 8
        out.append(("transpose+add", "8192x8192", dt, lambda x: x.t().contiguous() + 1,
                    lambda dt=dt: (rnd(D, D, dtype=dt),), 2 * D * D * e, "tile"))
    out.append(("transpose+add", "4099x8191", torch.float32, lambda x: x.t().contiguous() + 1,
                lambda: (rnd(D // 2 + 3, D - 1),), 2 * (D // 2 + 3) * (D - 1) * 4, "tile"))
    out.append(("permute(0,2,1)+y", "64x1024x1000", torch.float32, lambda x, y: x.permute(0, 2, 1) + y,
                lambda: (rnd(4, D, D - 24), rnd(4, D - 24, D)) if SMOKE else (rnd(64, 1024, 1000), rnd(64, 1000, 1024)),
                3 * 64 * 1024 * 1000 * 4, "tile"))
    return out


class _NoTiles:
    """Context: the old flat 1-D pointwise kernels (tile_dims always says no)."""

    def __enter__(self):
        self.saved = tgen.tile_dims
        tgen.tile_dims = lambda plan: None

    def __exit__(self, *exc):
        tgen.tile_dims = self.saved


def main() -> None:
    out_dir = os.environ.get("OUT")
    copy_src = rnd(64 * M)
    copy_dst = torch.empty_like(copy_src)
    copy_gbs = 2 * copy_src.numel() * 4 / bench(lambda: copy_dst.copy_(copy_src)) / 1e6
    copy_src = copy_dst = None     # free them for the workloads
    device_name = "cpu (smoke)" if SMOKE else torch.cuda.get_device_name()
    print(f"{device_name}, torch {torch.__version__}, copy {copy_gbs:.0f} GB/s", flush=True)
    head = ["workload", "shape", "dtype", "eager ms", "inductor ms", "torchfuse ms", "tf old ms",
            "eager GB/s", "inductor GB/s", "torchfuse GB/s", "tf old GB/s", "tf kernels", "max |tf-eager|"]
    rows, details, errors = [], [], []
    t_start = time.time()
    for name, shape, dt, fn, make, moved, path in workloads():
        args = make()
        expected = fn(*args)
        res: dict[str, float] = {}
        kernels, diff = "", float("nan")
        for label in ("eager", "inductor", "torchfuse", "tf old"):
            torch._dynamo.reset()
            try:
                if label == "eager":
                    f = fn
                elif label == "inductor":
                    f = torch.compile(fn)
                elif label == "torchfuse":
                    f = torch.compile(fn, backend="torchfuse")
                    exp = torchfuse.explain(fn, *args)
                    kernels = " ".join(k.name + ("[tiled]" if "_tiled(" in k.source else "") for k in exp.kernels)
                    got = exp.output
                    diff = float((got.float() - expected.float()).abs().max())
                    details.append({"workload": f"{name} {shape} {dt}", "kernels": [
                        {"name": k.name, "kind": k.kind, "source": k.source} for k in exp.kernels]})
                else:
                    opts = {"split_reductions": False}
                    f = torch.compile(fn, backend="torchfuse", options=opts)
                if label == "tf old" and path == "tile":
                    with _NoTiles():
                        f(*args)          # compiles now, with flat kernels
                        res[label] = bench(f, *args)
                else:
                    res[label] = bench(f, *args)
            except Exception as e:  # keep the table going
                import traceback
                res[label] = float("nan")
                errors.append(f"## {name} {shape} {dt} {label}\n{traceback.format_exc()[-3000:]}")
                print(f"  {label} failed: {type(e).__name__}: {str(e)[:200]}", flush=True)
        torch._dynamo.reset()
        gbs = {k: moved / v / 1e6 if v == v and v > 0 else float("nan") for k, v in res.items()}
        rows.append([name, shape, str(dt).replace("torch.", ""),
                     *(f"{res[k]:.3f}" for k in ("eager", "inductor", "torchfuse", "tf old")),
                     *(f"{gbs[k]:.0f}" for k in ("eager", "inductor", "torchfuse", "tf old")), kernels, f"{diff:.3g}"])
        print(" | ".join(rows[-1]), flush=True)
        del args, expected
        if not SMOKE:
            torch.cuda.empty_cache()
    table = [f"{device_name}, torch {torch.__version__}, copy bandwidth {copy_gbs:.0f} GB/s, "
             f"{time.time() - t_start:.0f} s", "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    table += ["| " + " | ".join(r) + " |" for r in rows]
    text = "\n".join(table)
    print(text)
    if errors:
        print("\n".join(errors))
    if out_dir:
        os.makedirs(out_dir, exist_ok=True)
        with open(os.path.join(out_dir, "split_tile_probe.md"), "w") as f:
            f.write(text + "\n")
        with open(os.path.join(out_dir, "split_tile_probe.json"), "w") as f:
            json.dump({"head": head, "rows": rows, "copy_gbs": copy_gbs, "kernels": details, "errors": errors}, f, indent=1)


if __name__ == "__main__":
    main()
