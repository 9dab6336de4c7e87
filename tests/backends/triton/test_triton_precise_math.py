"""On a GPU, fp32 exp and sqrt are emitted as eager's CUDA kernels round them (and as Inductor
emits them): libdevice's expf and IEEE sqrt (`tl.sqrt_rn`), not Triton's fast `tl.exp` (ex2.approx
of x * log2(e), ~20 ulps at a softmax's |x| ~ 20) and `tl.sqrt` (sqrt.approx); the online
softmax's rescaling too.  The GPU form is generated here with launches intercepted (nothing
runs) and compiled for sm_90 in a child process without the interpreter, where this Triton can.
"""
import json
import os
import re
import subprocess
import sys

import pytest
import torch

os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

import torchfuse  # noqa: E402
from torchfuse.backends.triton import emitter, launch  # noqa: E402

_COMPILE = r'''
import json, sys, importlib.util, inspect
try:
    import triton
    from triton import knobs
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    assert knobs.nvidia.ptxas.path
except Exception as e:
    print(f"SKIP: no CUDA compiler in this Triton: {type(e).__name__}: {e}")
    sys.exit(0)
from torchfuse.backends.triton.module import module_source
case = json.load(open(sys.argv[1]))
path = sys.argv[1][:-5] + "_kernel.py"
open(path, "w").write(module_source([case["source"]], interpreter=False))
spec = importlib.util.spec_from_file_location("math_kernel", path)
mod = importlib.util.module_from_spec(spec)
spec.loader.exec_module(mod)
fn = getattr(mod, case["name"])
params = list(inspect.signature(fn.fn).parameters)
sig = {p: ty for p, ty in zip(params, case["types"])}
sig.update({p: "constexpr" for p in params[len(case["types"]):]})
c = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=case["constexprs"]),
                   target=GPUTarget("cuda", 90, 32), options={"num_warps": case["warps"]})
print("sqrt.rn" if "sqrt.rn.f32" in c.asm["ptx"] else "no sqrt.rn")
'''


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
    path = tmp_path / "case.json"
    path.write_text(json.dumps({"name": name, "source": sources[sqrt_kernel], "types": types,
                                "constexprs": constexprs, "warps": warps}))
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([os.path.dirname(torchfuse.__path__[0])] +
                                        ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    run = subprocess.run([sys.executable, "-c", _COMPILE, str(path)], capture_output=True, text=True, env=env,
                         timeout=120)
    assert run.returncode == 0, run.stderr[-3000:]
    out = run.stdout.strip()
    if out.startswith("SKIP:"):
        pytest.skip(out[5:].strip())
    assert out == "sqrt.rn", out
