"""Host microseconds of one launch by each path (GPU probe): Triton's `kernel[grid]`, the
compiled binary's launchers (Triton's Python `run`, its C `launch`, torchfuse's verified
binding), torch's static CUDA launcher (Inductor's) on the same binary, and the ATen matmul
call forms a wrapper can use (`torch.mm`, with out=, the OpOverload).

    python benchmarks/probes/launch_micro.py [--n 5000]
"""
from __future__ import annotations

import argparse
import time

import torch
import triton
import triton.language as tl


@triton.jit
def _add_one(x_ptr, y_ptr, n, XBLOCK: tl.constexpr):
    offs = tl.program_id(0) * XBLOCK + tl.arange(0, XBLOCK)
    m = offs < n
    tl.store(y_ptr + offs, tl.load(x_ptr + offs, mask=m) + 1.0, mask=m)


def _time(fn, n: int) -> float:
    for _ in range(50):
        fn()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(3):
        t = time.perf_counter()
        for _ in range(n):
            fn()
        best = min(best, time.perf_counter() - t)
        torch.cuda.synchronize()
    return best / n * 1e6


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=5000)
    n = ap.parse_args().n
    from torchfuse.backends.triton import launch as tlaunch
    rows = []
    x = torch.randn(2048, device="cuda")
    y = torch.empty_like(x)
    size = x.numel()
    grid = (2, 1, 1)
    binary = _add_one[grid](x, y, size, XBLOCK=1024)
    torch.cuda.synchronize()
    rows.append(("triton kernel[grid](...)", _time(lambda: _add_one[grid](x, y, size, XBLOCK=1024), n)))
    stream = torch._C._cuda_getCurrentRawStream
    px, py = x.data_ptr(), y.data_ptr()
    run = binary.run
    meta = binary.packed_metadata
    for extra in ((1024,), ()):
        try:
            rows.append((f"binary.run (Triton's Python launcher){'' if extra else ', no constexprs'}",
                         _time(lambda: run(2, 1, 1, stream(0), binary.function, meta, None, None, None, px, py, size,
                                           *extra), n)))
            break
        except Exception:       # noqa: BLE001  (the other convention)
            continue
    before = tlaunch._snapshot((x, y, size))
    tlaunch._make_fast(binary, (x, y, size), (1024,), grid, before)
    trusted = set().union(*tlaunch._trusted.values()) if tlaunch._trusted else set()
    rows.append((f"torchfuse verified conventions: {sorted(trusted)}", float("nan")))
    for name, bind in tlaunch._conventions(binary, (1024,), 0):
        if bind is not None and name in trusted:
            go = bind(grid, (size,), 2)
            rows.append((f"torchfuse bound launcher go(p0, p1), {name}", _time(lambda go=go: go(px, py), n)))
    try:
        try:
            from torch._inductor.runtime.static_triton_launcher import StaticallyLaunchedCudaKernel
        except ImportError:      # (torch <= 2.12)
            from torch._inductor.runtime.static_cuda_launcher import StaticallyLaunchedCudaKernel
        binary._cubin_path = None
        s = StaticallyLaunchedCudaKernel(binary)
        s.function = binary.function
        y.zero_()
        s.run(2, 1, 1, stream(0), px, py, size)
        torch.cuda.synchronize()
        assert torch.equal(y, x + 1), "static launcher result"
        rows.append(("inductor StaticallyLaunchedCudaKernel.run", _time(lambda: s.run(2, 1, 1, stream(0), px, py, size), n)))
        tys = s.arg_tys + "O" * (s.has_global_scratch + s.has_profile_scratch)
        extra = (None,) * (s.has_global_scratch + s.has_profile_scratch)
        args = (px, py, size, *extra)
        launch = s.C_impl._launch_kernel
        f, w, sh = binary.function, s.num_warps, s.shared
        rows.append(("torch._C._StaticCudaLauncher._launch_kernel", _time(lambda: launch(f, 2, 1, 1, w, sh, tys, args, stream(0)), n)))
        rows.append(("  same, tensors as pointers", _time(lambda: launch(f, 2, 1, 1, w, sh, tys, (x, y, size, *extra), stream(0)), n)))
    except Exception as e:      # noqa: BLE001  (a probe: report and go on)
        rows.append((f"static launcher: {type(e).__name__}: {e}"[:80], float("nan")))
    rows.append(("torch._C._cuda_getCurrentRawStream(0)", _time(lambda: stream(0), n)))
    rows.append(("3 x tensor.data_ptr()", _time(lambda: (x.data_ptr(), y.data_ptr(), x.data_ptr()), n)))

    a = torch.randn(32, 64, device="cuda")
    w = torch.nn.Parameter(torch.randn(64, 64, device="cuda"))
    c = torch.empty(32, 64, device="cuda")
    from torch._C._dynamo.guards import _empty_strided_cuda
    with torch.no_grad():
        rows.append(("torch.mm(a, w)", _time(lambda: torch.mm(a, w), n)))
        rows.append(("torch.mm(a, w, out=c)", _time(lambda: torch.mm(a, w, out=c), n)))
        rows.append(("torch.mm(a, w, out=_empty_strided_cuda(...))",
                     _time(lambda: torch.mm(a, w, out=_empty_strided_cuda((32, 64), (64, 1), torch.float32)), n)))
        rows.append(("aten.mm.default(a, w)", _time(lambda: torch.ops.aten.mm.default(a, w), n)))
        rows.append(("aten.mm.out(a, w, out=c)", _time(lambda: torch.ops.aten.mm.out(a, w, out=c), n)))
        wd = w.detach()
        rows.append(("torch.mm(a, w.detach())", _time(lambda: torch.mm(a, wd), n)))
        rows.append(("torch.tanh(a) (one eager pointwise)", _time(lambda: torch.tanh(a), n)))
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}")
    for name, us in rows:
        print(f"{name:55} {us:7.2f} us")


if __name__ == "__main__":
    main()
