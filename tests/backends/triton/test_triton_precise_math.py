"""On a GPU, fp32 exp and sqrt are emitted as eager's CUDA kernels round them (and as Inductor
emits them): libdevice's expf and IEEE sqrt (`tl.sqrt_rn`), not Triton's fast `tl.exp` (ex2.approx
of x * log2(e), ~20 ulps at a softmax's |x| ~ 20) and `tl.sqrt` (sqrt.approx); the online
softmax's rescaling too.  The GPU form is generated here with launches intercepted (nothing
runs) and compiled for sm_90 in a child process without the interpreter, where this Triton can.
"""
import os
import re

import pytest
import torch

os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

import torchfuse  # noqa: E402
from sm90_ptx import sm90_ptx  # noqa: E402
from torchfuse.backends.triton import emitter, launch  # noqa: E402


def _gpu_kernels(fn, *args) -> tuple[dict, list]:
    """The GPU form of `fn`'s kernels (sources by name) and their launches; nothing runs."""
    launches = []

    def record(kernel, grid, a, constexprs, warps, names):
        types = [("*fp32" if v.dtype == torch.float32 else "*i64") if isinstance(v, torch.Tensor) else "i32" for v in a]
        launches.append((getattr(kernel, "fn", kernel).__name__, types, dict(zip(names, constexprs)), warps))
    torch._dynamo.reset()
    real = emitter._interpreting
    emitter._interpreting = lambda: False
    try:
        with launch.launch_hook(record):
            rep = torchfuse.explain(fn, *args, options={"cpu_backend": "triton", "first_calls": "wait",
                                                        "graph_cache": False})
    finally:
        emitter._interpreting = real
    return {k.name: k.source for k in rep.kernels}, launches


def test_softmax_and_norm_use_eagers_exp_and_sqrt(tmp_path):
    def fn(x, y):
        return torch.softmax(x, -1), y / torch.sqrt((y * y).mean(-1, keepdim=True) + 1e-6)
    x = torch.randn(4, launch.PERSISTENT_LIMIT + 3001)        # past the persistent limit: online softmax
    sources, launches = _gpu_kernels(fn, x, torch.randn(8, 96))
    text = "\n".join(sources.values())
    assert "libdevice.exp(" in text and "tl.sqrt_rn(" in text, text
    assert not re.search(r"tl\.exp\(|tl\.sqrt\(", text), text
    sqrt_kernel = next(n for n, s in sources.items() if "tl.sqrt_rn(" in s)
    name, types, constexprs, warps = next(x for x in launches if x[0].startswith(sqrt_kernel))
    ptx = sm90_ptx(tmp_path, name, sources[sqrt_kernel], types, constexprs, warps)
    assert "sqrt.rn.f32" in ptx, ptx
