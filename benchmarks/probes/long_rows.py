"""Long rows (layer norm, softmax over rows that do not fit a persistent kernel) and bf16
transposes: launch shapes and cache hints against Inductor (GPU probe, ~3 min).

    python benchmarks/probes/long_rows.py [--only ln,softmax,permute]

A looped row kernel reads each row twice (statistics, then the output).  With one program per
row, ~4 resident programs per SM keep ~500 rows of 200 KB in flight: far more than the 50 MB L2,
so the second read comes from HBM.  Each variant here is a hand-written kernel shaped like
torchfuse's looped variant, launched as
  grid:   `rows` (one program per row, as now) or `sm*k` (k programs per SM, each walking rows
          pid, pid + grid, ...: few rows in flight, so a row's second read can hit L2),
  RBLOCK / warps,
  evict:  first-pass loads `evict_last`, last-pass loads `evict_first` (Inductor's hints).
GPU microseconds per call (CUDA-graph replay) and Inductor's time over the variant's.
The permute rows force (XBLOCK, YBLOCK, warps) of torchfuse's tiled kernel for `x.permute(0, 2, 1) + y`.
Inductor's kernels for the first shape of each workload are written to $OUT/inductor_kernels.txt.
"""
from __future__ import annotations

import argparse
import glob
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import gpu_bench  # noqa: E402  (fresh caches, set before torch is imported)
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from torchfuse.backends.triton import launch as triton_launch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from pointwise_config import inductor_config  # noqa: E402


LAST, FIRST = tl.constexpr(1), tl.constexpr(2)   # _load POLICY: 0 no hint, else evict_last / evict_first


@triton.jit
def _load(ptrs, mask, other, POLICY: tl.constexpr):
    if POLICY == 1:
        v = tl.load(ptrs, mask=mask, other=other, eviction_policy="evict_last")
    elif POLICY == 2:
        v = tl.load(ptrs, mask=mask, other=other, eviction_policy="evict_first")
    else:
        v = tl.load(ptrs, mask=mask, other=other)
    return v.to(tl.float32)


@triton.jit
def _welford_combine(m1, q1, w1, m2, q2, w2):
    w = w1 + w2
    delta = m2 - m1
    frac = tl.where(w == 0.0, 0.0, w2 / w)
    return m1 + delta * frac, q1 + q2 + delta * delta * w1 * frac, w


@triton.jit
def _ln(x_ptr, w_ptr, b_ptr, o_ptr, xnumel, rnumel, RBLOCK: tl.constexpr, FORM: tl.constexpr,
        EVEN: tl.constexpr, EVICT: tl.constexpr):
    """Layer norm over rows pid, pid + grid, ...  FORM 0: shifted sums as torchfuse emitted them
    before the lean form (five accumulators); 1: lean shifted sums (k loaded up front, lane counts
    computed, the mean's sum from s1), as now; 2: Welford (Inductor's).  EVEN: no masks (a
    constant-true one).  EVICT: L2 hints."""
    rbase = tl.arange(0, RBLOCK)
    for row in range(tl.program_id(0), xnumel, tl.num_programs(0)):
        base = tl.cast(row, tl.int64) * rnumel
        if FORM == 1:
            k = _load(x_ptr + base + rbase, rbase < rnumel, 0, 0)
        else:
            k = tl.zeros([RBLOCK], tl.float32)
        s = tl.zeros([RBLOCK], tl.float32)
        s1 = tl.zeros([RBLOCK], tl.float32)
        s2 = tl.zeros([RBLOCK], tl.float32)
        n = tl.zeros([RBLOCK], tl.float32)
        for off in range(0, rnumel, RBLOCK):
            idx = off + rbase
            m = tl.full([RBLOCK], 1, tl.int1) if EVEN else idx < rnumel
            v = _load(x_ptr + base + idx, m, 0, LAST if EVICT else 0)
            if FORM == 0:
                s += tl.where(m, v, 0.0)
                k = tl.where(m & (n == 0), v, k)
                d = tl.where(m, v - k, 0.0)
                s1 += d
                s2 += d * d
                n += tl.where(m, 1.0, 0.0)
            elif FORM == 1:
                d = tl.where(m, v - k, 0.0)
                s1 += d
                s2 += d * d
            else:
                nn = n + 1.0
                delta = v - s1
                mean_new = s1 + delta / nn
                m2_new = s2 + delta * (v - mean_new)
                s1 = tl.where(m, mean_new, s1)
                s2 = tl.where(m, m2_new, s2)
                n = tl.where(m, nn, n)
        if FORM == 0:
            mean = tl.sum(s, 0) / rnumel
            c = k - mean
            var = tl.sum(tl.where(n > 0, s2 + c * (2.0 * s1 + n * c), 0.0), 0) / rnumel
        elif FORM == 1:
            n = tl.maximum((rnumel - rbase + RBLOCK - 1) // RBLOCK, 0).to(tl.float32)
            mean = tl.sum(k * n + s1, 0) / rnumel
            c = k - mean
            var = tl.sum(s2 + c * (2.0 * s1 + n * c), 0) / rnumel
        else:
            mean, m2, _ = tl.reduce((s1, s2, n), 0, _welford_combine)
            var = m2 / rnumel
        rstd = tl.rsqrt(var + 1e-5)
        for off in range(0, rnumel, RBLOCK):
            idx = off + rbase
            m = tl.full([RBLOCK], 1, tl.int1) if EVEN else idx < rnumel
            v = _load(x_ptr + base + idx, m, 0, FIRST if EVICT else 0)
            w = _load(w_ptr + idx, m, 0, LAST if EVICT else 0)
            b = _load(b_ptr + idx, m, 0, LAST if EVICT else 0)
            tl.store(o_ptr + base + idx, ((v - mean) * rstd * w + b).to(o_ptr.dtype.element_ty), mask=m)


@triton.jit
def _softmax(x_ptr, o_ptr, xnumel, rnumel, RBLOCK: tl.constexpr, EVICT: tl.constexpr):
    rbase = tl.arange(0, RBLOCK)
    for row in range(tl.program_id(0), xnumel, tl.num_programs(0)):
        base = tl.cast(row, tl.int64) * rnumel
        am = tl.full([RBLOCK], -float("inf"), tl.float32)
        acc = tl.zeros([RBLOCK], tl.float32)
        for off in range(0, rnumel, RBLOCK):
            idx = off + rbase
            v = _load(x_ptr + base + idx, idx < rnumel, -float("inf"), LAST if EVICT else 0)
            new = tl.maximum(am, v)
            scale = tl.where(new == am, 1.0, tl.exp(am - new))
            acc = acc * scale + tl.where(new == -float("inf"), 0.0, tl.exp(v - new))
            am = new
        mx = tl.max(am, 0)
        total = tl.sum(acc * tl.exp(am - mx), 0)
        inv = 1.0 / total
        for off in range(0, rnumel, RBLOCK):
            idx = off + rbase
            m = idx < rnumel
            v = _load(x_ptr + base + idx, m, 0, FIRST if EVICT else 0)
            tl.store(o_ptr + base + idx, (tl.exp(v - mx) * inv).to(o_ptr.dtype.element_ty), mask=m)


# round 2 (layer norm only, grid = rows, evict hints on): (FORM, RBLOCK, warps, EVEN when the
# row divides); the first is the pre-session-7 kernel with hints
FORMS = [(0, 2048, 16, 0), (0, 2048, 16, 1), (1, 2048, 16, 0), (1, 2048, 16, 1), (2, 2048, 16, 1), (1, 2048, 8, 1),
         (1, 4096, 16, 1), (1, 1024, 4, 1), (1, 4096, 8, 1), (2, 4096, 16, 1), (2, 1024, 4, 1), (1, 1024, 8, 1)]


# (grid, RBLOCK, warps, evict); grid "rows" or "sm*k".  The first is torchfuse's launch now.
VARIANTS = [("rows", 2048, 16, 0), ("rows", 2048, 16, 1), ("rows", 4096, 16, 1), ("rows", 2048, 8, 1),
            ("sm*1", 2048, 16, 0), ("sm*1", 2048, 16, 1), ("sm*2", 2048, 16, 1), ("sm*2", 2048, 8, 1),
            ("sm*4", 2048, 8, 1), ("sm*2", 4096, 16, 1), ("sm*1", 4096, 32, 1), ("sm*4", 1024, 4, 1)]
SHAPES = [(2048, 50257), (512, 131072), (4096, 32768), (256, 262144), (1000, 65537), (8192, 40000)]
TILES = [(64, 64, 4), (32, 32, 4), (64, 64, 8), (128, 32, 4), (32, 128, 4), (64, 32, 4), (128, 64, 8),
         (64, 128, 8), (256, 16, 4), (16, 256, 4)]


def _grid(kind: str, rows: int) -> int:
    return rows if kind == "rows" else min(rows, int(kind[3:]) * triton_launch._sm_count())


def rows_workloads(names, copy_gbs, out):
    sm = triton_launch._sm_count()
    head = "| workload | shape | dtype | inductor us (%copy) | torchfuse us | " + \
        " | ".join(f"{g}/{r}/{w}w/ev{e}" for g, r, w, e in VARIANTS) + " | best (inductor/best) |"
    out.append(f"SMs: {sm}; cells: us (inductor/variant)")
    out.append(head)
    out.append("|" + "---|" * (6 + len(VARIANTS)))
    for name in names:
        for dtype in (torch.float32, torch.bfloat16):
            for shape in SHAPES:
                rows, cols = shape
                x = torch.randn(rows, cols, device="cuda", dtype=dtype)
                if name == "ln":
                    w = torch.randn(cols, device="cuda", dtype=dtype)
                    b = torch.randn(cols, device="cuda", dtype=dtype)
                    fn = lambda x, w, b: F.layer_norm(x, (x.shape[-1],), w, b)  # noqa: E731
                    args = (x, w, b)
                else:
                    fn = lambda x: torch.softmax(x, -1)  # noqa: E731
                    args = (x,)
                ref = fn(*args).float()
                torch._dynamo.reset()
                ind = gpu_bench.bench_graph(torch.compile(fn), *args) * 1e3
                torch._dynamo.reset()
                tf = gpu_bench.bench_graph(torch.compile(fn, backend="torchfuse"), *args) * 1e3
                o = torch.empty_like(x)
                cells, best = [], (float("inf"), None)
                for g, rb, wp, ev in VARIANTS:
                    grid = (_grid(g, rows),)
                    if name == "ln":
                        go = lambda g=grid, rb=rb, wp=wp, ev=ev: _ln[g](x, w, b, o, rows, cols, RBLOCK=rb, FORM=0, EVEN=0, EVICT=ev,  # noqa: E731
                                                                        num_warps=wp)
                    else:
                        go = lambda g=grid, rb=rb, wp=wp, ev=ev: _softmax[g](x, o, rows, cols, RBLOCK=rb, EVICT=ev,  # noqa: E731
                                                                             num_warps=wp)
                    go()
                    err = float((o.float() - ref).abs().max())
                    us = gpu_bench.bench_graph(go) * 1e3
                    bad = "" if err < (0.1 if dtype == torch.bfloat16 else 1e-3) else " ERR"
                    cells.append(f"{us:.1f} ({ind / us:.2f}){bad}")
                    if us < best[0] and not bad:
                        best = (us, f"{g}/{rb}/{wp}w/ev{ev}")
                moved = 2 * x.numel() * x.element_size()
                pct = moved / (ind * 1e-6) / 1e9 / copy_gbs * 100
                line = (f"| {name} | {rows}x{cols} | {str(dtype)[6:]} | {ind:.1f} ({pct:.0f}%) | {tf:.1f} ({ind / tf:.2f}) | "
                        + " | ".join(cells) + (f" | {best[1]} ({ind / best[0]:.2f}, "
                        f"{moved / (best[0] * 1e-6) / 1e9 / copy_gbs * 100:.0f}%) |" if cells else
                        f" torchfuse {moved / (tf * 1e-6) / 1e9 / copy_gbs * 100:.0f}% |"))
                out.append(line)
                print(line, flush=True)


def form_rows(copy_gbs, out):
    fn = lambda x, w, b: F.layer_norm(x, (x.shape[-1],), w, b)  # noqa: E731
    out.append("")
    out.append("| ln form | shape | dtype | inductor us | inductor config | torchfuse us | "
               + " | ".join(f"f{f}/{r}/{w}w/e{e}" for f, r, w, e in FORMS) + " | best |")
    out.append("|" + "---|" * (7 + len(FORMS)))
    for dtype in (torch.float32, torch.bfloat16):
        for rows, cols in SHAPES:
            x = torch.randn(rows, cols, device="cuda", dtype=dtype) * 2 + 3
            w = torch.randn(cols, device="cuda", dtype=dtype)
            b = torch.randn(cols, device="cuda", dtype=dtype)
            ref = fn(x, w, b).float()
            torch._dynamo.reset()
            ind = gpu_bench.bench_graph(torch.compile(fn), x, w, b) * 1e3
            cfg = inductor_config(fn, x, w, b).replace("|", "/")
            torch._dynamo.reset()
            tf = gpu_bench.bench_graph(torch.compile(fn, backend="torchfuse"), x, w, b) * 1e3
            o = torch.empty_like(x)
            cells, best = [], (float("inf"), "")
            for form, rb, wp, even in FORMS:
                even = int(bool(even) and cols % rb == 0)
                go = lambda form=form, rb=rb, wp=wp, even=even: _ln[(rows,)](  # noqa: E731
                    x, w, b, o, rows, cols, RBLOCK=rb, FORM=form, EVEN=even, EVICT=1, num_warps=wp)
                go()
                err = float((o.float() - ref).abs().max())
                us = gpu_bench.bench_graph(go) * 1e3
                bad = "" if err < (0.1 if dtype == torch.bfloat16 else 1e-3) else f" ERR {err:.1e}"
                cells.append(f"{us:.1f} ({ind / us:.2f}){bad}")
                if us < best[0] and not bad:
                    best = (us, f"f{form}/{rb}/{wp}w/e{even} {ind / us:.2f}")
            line = (f"| ln | {rows}x{cols} | {str(dtype)[6:]} | {ind:.1f} | {cfg} | {tf:.1f} ({ind / tf:.2f}) | "
                    + " | ".join(cells) + f" | {best[1]} |")
            out.append(line)
            print(line, flush=True)


def mask_rows(out):
    """torchfuse with and without dropping the masks of static sizes that the block divides."""
    from torchfuse.backends.triton import codegen
    original = codegen._emit_mask

    def always(em, mask, index, numel, block, shape):
        em.line(f"{mask} = {index} < {numel}")
    cases = [("col_sum", lambda x: x.sum(0), (8192, 2304)), ("col_sum", lambda x: x.sum(0), (2048, 3072)),
             ("col_sum", lambda x: x.sum(0), (32768, 768)), ("row_sum", lambda x: x.sum(1), (4096, 4096)),
             ("softmax", lambda x: torch.softmax(x, -1), (8192, 8192)),
             ("ln", lambda x: F.layer_norm(x, x.shape[-1:]), (512, 131072)),
             ("ln", lambda x: F.layer_norm(x, x.shape[-1:]), (4096, 768))]
    out.append("")
    out.append("| masks | shape | dtype | inductor us | static masks dropped us | always masked us |")
    out.append("|---|---|---|---|---|---|")
    for name, fn, shape in cases:
        for dtype in (torch.float32, torch.bfloat16):
            x = torch.randn(*shape, device="cuda", dtype=dtype)
            torch._dynamo.reset()
            ind = gpu_bench.bench_graph(torch.compile(fn), x) * 1e3
            times = []
            for emit in (original, always):
                codegen._emit_mask = emit
                triton_launch._modules.clear()
                try:
                    torch._dynamo.reset()
                    f = torch.compile(fn, backend="torchfuse", options={"cache_dir": f"/tmp/tf-masks-{len(times)}"})
                    times.append(gpu_bench.bench_graph(f, x) * 1e3)
                finally:
                    codegen._emit_mask = original
            line = (f"| {name} | {'x'.join(map(str, shape))} | {str(dtype)[6:]} | {ind:.1f} | "
                    f"{times[0]:.1f} ({ind / times[0]:.2f}) | {times[1]:.1f} ({ind / times[1]:.2f}) |")
            out.append(line)
            print(line, flush=True)


def permute_rows(copy_gbs, out):
    fn = lambda x, y: x.permute(0, 2, 1) + y  # noqa: E731
    original = triton_launch.tile_blocks
    out.append("")
    out.append("| permute_add | dtype | inductor us | torchfuse us | " + " | ".join(f"{a}x{b}/{w}w" for a, b, w in TILES) + " |")
    out.append("|" + "---|" * (4 + len(TILES)))
    for shape in [(64, 1024, 1000), (32, 768, 3072), (128, 197, 768)]:
        for dtype in (torch.float32, torch.bfloat16):
            x = torch.randn(*shape, device="cuda", dtype=dtype)
            y = torch.randn(shape[0], shape[2], shape[1], device="cuda", dtype=dtype)
            torch._dynamo.reset()
            ind = gpu_bench.bench_graph(torch.compile(fn), x, y) * 1e3
            torch._dynamo.reset()
            tf = gpu_bench.bench_graph(torch.compile(fn, backend="torchfuse"), x, y) * 1e3
            cells = []
            for xb, yb, wp in TILES:
                triton_launch.tile_blocks = lambda xn, yn, size=4, xb=xb, yb=yb, wp=wp: (xb, yb, wp)
                triton_launch._modules.clear()
                try:
                    torch._dynamo.reset()
                    f = torch.compile(fn, backend="torchfuse")
                    err = float((f(x, y).float() - fn(x, y).float()).abs().max())
                    us = gpu_bench.bench_graph(f, x, y) * 1e3
                    cells.append(f"{us:.1f} ({ind / us:.2f}){'' if err < 0.1 else ' ERR'}")
                finally:
                    triton_launch.tile_blocks = original
                    triton_launch._modules.clear()
            line = f"| {'x'.join(map(str, shape))} | {str(dtype)[6:]} | {ind:.1f} | {tf:.1f} ({ind / tf:.2f}) | " + " | ".join(cells) + " |"
            out.append(line)
            print(line, flush=True)


def dump_inductor(path: str) -> None:
    cache = os.environ.get("TORCHINDUCTOR_CACHE_DIR", "")
    texts = []
    for f in sorted(glob.glob(os.path.join(cache, "**", "*.py"), recursive=True)):
        try:
            text = open(f).read()
        except OSError:
            continue
        if "@triton.jit" in text and "def triton_" in text:
            texts.append(f"# ===== {os.path.relpath(f, cache)}\n{text}")
    with open(path, "w") as fh:
        fh.write("\n\n".join(texts))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--only", default="ln,softmax,permute", help="any of ln,softmax,forms,masks,permute")
    ap.add_argument("--no-variants", action="store_true", help="ln/softmax: Inductor and torchfuse only")
    a = ap.parse_args()
    if a.no_variants:
        VARIANTS.clear()
    only = a.only.split(",")
    copy_gbs = gpu_bench.copy_bandwidth()
    out = [f"copy {copy_gbs:.0f} GB/s, {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}"]
    names = [n for n in ("ln", "softmax") if n in only]
    if names:
        rows_workloads(names, copy_gbs, out)
    if "forms" in only:
        form_rows(copy_gbs, out)
    if "masks" in only:
        mask_rows(out)
    if "permute" in only:
        permute_rows(copy_gbs, out)
    text = "\n".join(out)
    if os.environ.get("OUT"):
        open(os.path.join(os.environ["OUT"], "long_rows.md"), "w").write(text + "\n")
        dump_inductor(os.path.join(os.environ["OUT"], "inductor_kernels.txt"))
    print(text)


if __name__ == "__main__":
    main()
