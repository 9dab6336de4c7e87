"""GPU benchmark: eager vs Inductor vs torchfuse side by side in one process (CUDA events, medians).

    python benchmarks/gpu_bench.py [--quick] [--models] [--out results.md]

Kernel rows time the GPU alone (20 calls captured in a CUDA graph and replayed) for the ms,
%copy and ratio columns, and back-to-back calls (host path included) in the `loop ms` column;
blocks and models are timed back-to-back only (the host path is part of what they measure).

Memory-bound kernels report achieved GB/s (bytes each input read once + each output written
once) against a measured device-to-device copy.  Compile time is the first call with fresh
Inductor, Triton and torchfuse caches (set up before torch/triton are imported).
"""
from __future__ import annotations

import argparse
import os
import tempfile
import time

_tmp = tempfile.mkdtemp(prefix="tf-gpubench-")
os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(_tmp, "inductor")
os.environ["TRITON_CACHE_DIR"] = os.path.join(_tmp, "triton")
os.environ["TORCHFUSE_CACHE_DIR"] = os.path.join(_tmp, "torchfuse")

os.environ.setdefault("TORCHFUSE_FIRST_CALLS", "wait")   # timings are of compiled graphs, not the ATen tier
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import torchfuse  # noqa: E402,F401  (registers the "torchfuse" backend)


def bench(fn, *args, reps: int = 30, inner: int = 10) -> float:
    """Median milliseconds per call by CUDA events; `inner` back-to-back calls per sample so the
    GPU stays busy and host-side launch overhead overlaps (as in a real training loop)."""
    for _ in range(3):
        fn(*args)
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        for _ in range(inner):
            fn(*args)
        e.record()
        torch.cuda.synchronize()
        times.append(s.elapsed_time(e) / inner)
    times.sort()
    return times[len(times) // 2]


def bench_graph(fn, *args, calls: int = 20, reps: int = 15) -> float:
    """Median GPU milliseconds per call with the host path taken out: `calls` calls captured in
    one CUDA graph and replayed.  (Kernels of 10-40 us are shorter than any compiled call's host
    path, so back-to-back calls time the host there, not the kernel.)  NaN if capture fails."""
    try:
        for _ in range(3):
            fn(*args)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(calls):
                fn(*args)
        times = []
        for _ in range(reps):
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            graph.replay()
            e.record()
            e.synchronize()
            times.append(s.elapsed_time(e) / calls)
        del graph
    except Exception as e:
        _log_error("CUDA graph capture", e)
        return float("nan")
    times.sort()
    return times[len(times) // 2]


def first_call(fn, *args) -> tuple[callable, float]:
    torch.cuda.synchronize()
    t = time.perf_counter()
    fn(*args)
    torch.cuda.synchronize()
    return fn, time.perf_counter() - t


ERRORS: list[str] = []
TF_MODE: str | None = None


def _log_error(what: str, e: BaseException) -> None:
    import traceback
    ERRORS.append(f"## {what}\n{''.join(traceback.format_exception(e))[-4000:]}")
    print(f"{what}: {type(e).__name__}: {str(e)[:200]}")


def launch_overhead(rows) -> None:
    """Per-call host overhead on a tiny tensor: the GPU finishes instantly, so time = host path."""
    import triton
    import triton.language as tl

    @triton.jit
    def add_one(x, o, n, BLOCK: tl.constexpr):
        i = tl.arange(0, BLOCK)
        tl.store(o + i, tl.load(x + i, mask=i < n) + 1, mask=i < n)

    x = torch.randn(1024, device="cuda")
    o = torch.empty_like(x)
    fn = lambda t: t + 1
    cases = {"eager": fn, "triton direct": lambda t: add_one[(1,)](t, o, 1024, BLOCK=1024)}
    torch._dynamo.reset()
    cases["inductor"] = torch.compile(fn)
    cases["torchfuse"] = torch.compile(fn, backend="torchfuse")
    for label, f in cases.items():
        for _ in range(20):
            f(x)
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(2000):
            f(x)
        torch.cuda.synchronize()
        us = (time.perf_counter() - t) / 2000 * 1e6
        rows.append([f"launch overhead: {label}", "1024", "float32", f"{us / 1e3:.4f}", "", "", "", "", "", "", "", ""])
        print(rows[-1], flush=True)
    torch._dynamo.reset()


def copy_bandwidth() -> float:
    x = torch.randn(256 * 1024 * 1024 // 4 * 4, device="cuda")
    y = torch.empty_like(x)
    ms = bench(lambda: y.copy_(x), reps=20)
    return 2 * x.numel() * 4 / ms / 1e6   # GB/s


def rms(x, w):
    return x * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6).to(x.dtype) * w


WORKLOADS = {
    # name: (fn, make args(shape, dtype), bytes moved(shape, elt))
    "chain": (lambda x, y: ((x * 1.5 + 0.3).relu() * y).sigmoid(),
              lambda s, d: (torch.randn(s, device="cuda", dtype=d), torch.randn(s, device="cuda", dtype=d)), 3),
    "gelu_tanh": (lambda x: F.gelu(x, approximate="tanh"), lambda s, d: (torch.randn(s, device="cuda", dtype=d),), 2),
    "gelu_erf": (lambda x: F.gelu(x), lambda s, d: (torch.randn(s, device="cuda", dtype=d),), 2),
    "softmax": (lambda x: torch.softmax(x, -1), lambda s, d: (torch.randn(s, device="cuda", dtype=d),), 2),
    "layer_norm": (lambda x, w, b: F.layer_norm(x, x.shape[-1:], w, b),
                   lambda s, d: (torch.randn(s, device="cuda", dtype=d), torch.randn(s[-1], device="cuda", dtype=d),
                                 torch.randn(s[-1], device="cuda", dtype=d)), 2),
    "rms_norm": (rms, lambda s, d: (torch.randn(s, device="cuda", dtype=d), torch.randn(s[-1], device="cuda", dtype=d)), 2),
    "cross_entropy": (lambda x, t: F.cross_entropy(x, t),
                      lambda s, d: (torch.randn(s, device="cuda", dtype=d), torch.randint(0, s[-1], (s[0],), device="cuda")), 1),
}
SHAPES = [(8192, 8192), (16384, 1000), (4096, 32768), (32768, 768)]

_rn = lambda *s, d: torch.randn(*s, device="cuda", dtype=d)  # noqa: E731
# Workloads with their own shapes (split reductions and 2-D tiled transposes, issue 3):
# name: (fn, shapes, make args(shape, dtype), bytes moved per element of the first shape's numel)
SHAPED = {
    "full_sum": (lambda x: x.sum(), [(64 << 20,)], lambda s, d: (_rn(*s, d=d),), 1),
    "full_amax": (lambda x: x.amax(), [(64 << 20,)], lambda s, d: (_rn(*s, d=d),), 1),
    "row_sum": (lambda x: x.sum(1), [(8, 8 << 20)], lambda s, d: (_rn(*s, d=d),), 1),
    # a few long columns (split), and the weight/bias gradients of a training step's layers
    "col_sum": (lambda x: x.sum(0), [(8 << 20, 8), (2048, 768), (2048, 3072), (8192, 2304), (2047, 1000)],
                lambda s, d: (_rn(*s, d=d),), 1),
    "transpose_add": (lambda x: x.t().contiguous() + 1, [(8192, 8192), (4099, 8191)],
                      lambda s, d: (_rn(*s, d=d),), 2),
    "permute_add": (lambda x, y: x.permute(0, 2, 1) + y, [(64, 1024, 1000)],
                    lambda s, d: (_rn(*s, d=d), _rn(s[0], s[2], s[1], d=d)), 3),
}


def run_kernels(shapes, dtypes, copy_gbs, rows, only=None):
    cases = [(name, fn, make, nbytes, shapes) for name, (fn, make, nbytes) in WORKLOADS.items()]
    cases += [(name, fn, make, nbytes, sh) for name, (fn, sh, make, nbytes) in SHAPED.items()]
    for name, fn, make, nbytes, case_shapes in cases:
        if only and name not in only:
            continue
        for dtype, shape in ((d, s) for d in dtypes for s in case_shapes):
            args = make(shape, dtype)
            elt = torch.finfo(dtype).bits // 8
            moved = nbytes * elt
            for n in shape:
                moved *= n
            torch._dynamo.reset()
            results = {}
            for label, make_fn in (("eager", lambda: fn),
                                   ("inductor", lambda: torch.compile(fn)),
                                   ("torchfuse", lambda: torch.compile(fn, backend="torchfuse", mode=TF_MODE))):
                try:
                    compiled, ctime = first_call(make_fn(), *args)
                    results[label] = (bench_graph(compiled, *args), ctime, bench(compiled, *args))
                except Exception as e:  # keep the table going; report the failure
                    results[label] = (float("nan"), float("nan"), float("nan"))
                    _log_error(f"{name} {shape} {dtype} {label}", e)
                torch._dynamo.reset()
            e_ms, i_ms, t_ms = results["eager"][0], results["inductor"][0], results["torchfuse"][0]
            rows.append([name, "x".join(map(str, shape)), str(dtype).replace("torch.", ""),
                         f"{e_ms:.3f}", f"{i_ms:.3f}", f"{t_ms:.3f}",
                         f"{moved / i_ms / 1e6 / copy_gbs * 100:.0f}%", f"{moved / t_ms / 1e6 / copy_gbs * 100:.0f}%",
                         f"{i_ms / t_ms:.2f}", f"{results['inductor'][1]:.2f}", f"{results['torchfuse'][1]:.2f}",
                         f"{results['inductor'][2]:.3f} / {results['torchfuse'][2]:.3f}"])
            print(" | ".join(rows[-1]), flush=True)


def add_compare_row(rows: list[list[str]], name: str, results: dict[str, tuple[float, float]]) -> None:
    """One table row from {"eager"|"inductor"|"torchfuse": (ms, first-call s)} (blocks, models)."""
    e_ms, i_ms, t_ms = (results[k][0] for k in ("eager", "inductor", "torchfuse"))
    rows.append([name, "", "", f"{e_ms:.2f}", f"{i_ms:.2f}", f"{t_ms:.2f}", "", "", f"{i_ms / t_ms:.2f}",
                 f"{results['inductor'][1]:.1f}", f"{results['torchfuse'][1]:.1f}", ""])
    print(" | ".join(rows[-1]), flush=True)


def run_models(rows):
    import transformers
    cases = []
    g = transformers.GPT2Config(resid_pdrop=0, embd_pdrop=0, attn_pdrop=0)
    cases.append(("gpt2-small fp32 b8 s512", lambda: transformers.GPT2LMHeadModel(g).cuda().eval(),
                  lambda: (torch.randint(0, 50257, (8, 512), device="cuda"),), torch.float32))
    cases.append(("gpt2-small bf16 b8 s512", lambda: transformers.GPT2LMHeadModel(g).cuda().eval().bfloat16(),
                  lambda: (torch.randint(0, 50257, (8, 512), device="cuda"),), torch.bfloat16))
    b = transformers.BertConfig()
    cases.append(("bert-base fp32 b8 s512", lambda: transformers.BertModel(b).cuda().eval(),
                  lambda: (torch.randint(0, 30000, (8, 512), device="cuda"),), torch.float32))
    try:
        import timm
        cases.append(("vit-b16 bf16 b32", lambda: timm.create_model("vit_base_patch16_224", pretrained=False).cuda().eval().bfloat16(),
                      lambda: (torch.randn(32, 3, 224, 224, device="cuda", dtype=torch.bfloat16),), torch.bfloat16))
        cases.append(("resnet50 cl bf16 b64", lambda: timm.create_model("resnet50", pretrained=False).cuda().eval().bfloat16()
                      .to(memory_format=torch.channels_last),
                      lambda: (torch.randn(64, 3, 224, 224, device="cuda", dtype=torch.bfloat16).to(memory_format=torch.channels_last),),
                      torch.bfloat16))
    except ImportError:
        pass
    for name, make_model, make_args, _ in cases:
        model, args = make_model(), make_args()
        results = {}
        with torch.no_grad():
            for label, wrap in (("eager", lambda m: m), ("inductor", lambda m: torch.compile(m)),
                                ("torchfuse", lambda m: torch.compile(m, backend="torchfuse"))):
                torch._dynamo.reset()
                try:
                    compiled, ctime = first_call(wrap(model), *args)
                    results[label] = (bench(compiled, *args, reps=10, inner=3), ctime)
                except Exception as e:
                    results[label] = (float("nan"), float("nan"))
                    _log_error(f"{name} {label}", e)
        add_compare_row(rows, name, results)
        del model


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--models", action="store_true")
    ap.add_argument("--blocks", action="store_true", help="attention by hand, transformer block, GPT-2 train step")
    ap.add_argument("--no-kernels", action="store_true")
    ap.add_argument("--only", help="comma-separated workload names")
    ap.add_argument("--shapes", help="rows x columns of the row workloads instead of SHAPES, e.g. 2048x50257,512x131072")
    ap.add_argument("--out")
    ap.add_argument("--torchfuse-mode", default=None, help="e.g. max-autotune-no-cudagraphs")
    a = ap.parse_args()
    global TF_MODE
    TF_MODE = a.torchfuse_mode
    copy_gbs = copy_bandwidth()
    print(f"device-to-device copy: {copy_gbs:.0f} GB/s on {torch.cuda.get_device_name()}")
    rows: list[list[str]] = []
    launch_overhead(rows)
    if not a.no_kernels:
        shapes = SHAPES[:2] if a.quick else SHAPES
        if a.shapes:
            shapes = [tuple(int(v) for v in s.split("x")) for s in a.shapes.split(",")]
        dtypes = [torch.float32, torch.bfloat16]
        run_kernels(shapes, dtypes, copy_gbs, rows, a.only.split(",") if a.only else None)
    if a.blocks:
        from gpu_blocks import run_blocks
        run_blocks(rows, bench, first_call, _log_error, TF_MODE)
    if a.models:
        run_models(rows)
    head = ["workload", "shape", "dtype", "eager ms", "inductor ms", "torchfuse ms", "inductor %copy",
            "torchfuse %copy", "inductor/torchfuse", "inductor compile s", "torchfuse compile s",
            "loop ms inductor / torchfuse"]
    table = [f"copy bandwidth: {copy_gbs:.0f} GB/s ({torch.cuda.get_device_name()}, torch {torch.__version__})", "",
             "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    table += ["| " + " | ".join(r) + " |" for r in rows]
    text = "\n".join(table)
    print(text)
    if a.out:
        with open(a.out, "w") as f:
            f.write(text + "\n")
        with open(os.path.splitext(a.out)[0] + "_errors.txt", "w") as f:
            f.write("\n\n".join(ERRORS) + "\n")
        from torchfuse.backends.triton import launch as triton_launch
        with open(os.path.splitext(a.out)[0] + "_tuned.txt", "w") as f:
            f.write("\n".join(f"{k} -> {v}" for k, v in sorted(triton_launch._tuned.items())) + "\n")


if __name__ == "__main__":
    main()
