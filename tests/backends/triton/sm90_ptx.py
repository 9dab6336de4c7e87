"""Compiles one generated Triton kernel for a CUDA sm_90 target, with no GPU: in a child process
without Triton's interpreter, with the ptxas Triton bundles.  Shared by the tests that check
what a kernel's GPU form compiles to (test_triton_scatter_ptx.py, test_triton_precise_math.py)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import torchfuse

# compiles the kernel in argv[1] (JSON: source, name, argument types, constexprs, warps) and
# writes its PTX beside it; "SKIP: why" where this Triton has no CUDA compiler
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
spec = importlib.util.spec_from_file_location("sm90_kernel", path)
mod = importlib.util.module_from_spec(spec)
spec.loader.exec_module(mod)
fn = getattr(mod, case["name"])
params = list(inspect.signature(fn.fn).parameters)
sig, attrs = {}, {}
for i, (p, ty) in enumerate(zip(params, case["types"])):
    sig[p] = ty
    if ty.startswith("*"):
        attrs[(i,)] = [["tt.divisibility", 16]]      # (a launch's 16-byte-aligned tensors)
for p in params[len(case["types"]):]:
    sig[p] = "constexpr"
c = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=case["constexprs"], attrs=attrs),
                   target=GPUTarget("cuda", 90, 32), options={"num_warps": case["warps"]})
open(sys.argv[1][:-5] + ".ptx", "w").write(c.asm["ptx"])
'''


def sm90_ptx(tmp_path: Path, name: str, source: str, types: list[str], constexprs: dict, warps: int) -> str:
    """The PTX of kernel `name` in `source` for sm_90 (`types`: Triton's argument types, "*fp32",
    "i32", ...; pointers 16-byte aligned, as a launch's tensors are).  Skips the test where this
    Triton cannot compile for CUDA."""
    case = tmp_path / "case.json"
    case.write_text(json.dumps({"name": name, "source": source, "types": types, "constexprs": constexprs,
                                "warps": warps}))
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([os.path.dirname(torchfuse.__path__[0])] +
                                        ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    run = subprocess.run([sys.executable, "-c", _COMPILE, str(case)], capture_output=True, text=True, env=env,
                         timeout=120)
    assert run.returncode == 0, run.stderr[-3000:]
    if run.stdout.startswith("SKIP:"):
        pytest.skip(run.stdout[5:].strip())
    return (tmp_path / "case.ptx").read_text()
