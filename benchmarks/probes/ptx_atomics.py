"""Which PTX forms do torchfuse's Triton scatter kernels compile to for an H100/H200 (sm_90)?

Builds GNN-style gather-scatter graphs through torchfuse's Triton backend and compiles every
scatter kernel for an sm_90 target with the ptxas Triton bundles (no GPU needed):

    gcn   out.index_add(0, dst, x[src] * w[:, None])                 index_add, sum
    gin   out.scatter_add(0, dst[:, None].expand(-1, F), relu(x)[src]) + x   scatter, sum
    sage  out.index_put((dst,), x[src], accumulate=True)            index_put, sum (fp32 buffer for 16-bit)
    max   x.scatter_reduce(0, idx, x[src], "amax", include_self=False)   store, then amax
    copy  x.index_put((dst,), x[src] * 2)                           index_put, store

for fp32, bf16 and fp16 and feature widths 256, 128, 47 (odd) and 64 (1000 nodes, 5000 edges).

Prints one row per scatter kernel: graph, dtype, width, kernel name, and the PTX instruction
forms with their counts, of its atomics (`red.` / `atom.`), its global stores and loads.  A
vectorized atomic reads `red.global.gpu.relaxed.add.v4.f32` (fp32) or `...noftz.v8.bf16`; a
scalar one `red.global.gpu.relaxed.add.f32`.  (Inductor's GIN kernel on sm_90, for reference:
`red.global.gpu.relaxed.add.noftz.v8.bf16`.)

The code is generated as for a CUDA device of capability 9.0: the 16-bit atomic adds that
`half_atomic_adds` admits there, GPU-form source (not the interpreter's), the block sizes the
launcher picks and the specialization a launch gives (16-byte-aligned pointers, ints divisible
by 16, ints equal to 1 as constants).  Generation runs in a child process under Triton's
interpreter with every launch intercepted (nothing runs), the compile in this process without it.

    PYTHONPATH=src python benchmarks/probes/ptx_atomics.py [--graphs gin,gcn] [--dtypes bf16]
        [--widths 256] [--kernels all]
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import re
import subprocess
import sys
import tempfile

DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
TRITON_TYPES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16", "float64": "fp64", "int64": "i64",
                "int32": "i32", "int16": "i16", "int8": "i8", "uint8": "u8", "bool": "i1"}
N, E = 1000, 5000
ATOMICS, STORES, LOADS = r"\b(?:red|atom)\.[\w.]+", r"\bst\.global[\w.]*", r"\bld\.global[\w.]*"


def _graphs():
    import torch

    def gcn(x, ei, w):
        return torch.zeros_like(x).index_add(0, ei[1], x[ei[0]] * w[:, None])

    def gin(x, ei, w):
        f = x.shape[1]
        return torch.zeros_like(x).scatter_add(0, ei[1].view(-1, 1).expand(-1, f), torch.relu(x)[ei[0]]) + x

    def sage(x, ei, w):
        return torch.zeros_like(x).index_put((ei[1],), x[ei[0]], accumulate=True)

    def amax(x, ei, w):
        f = x.shape[1]
        return x.scatter_reduce(0, ei[1].view(-1, 1).expand(-1, f), x[ei[0]], "amax", include_self=False)

    def copy(x, ei, w):
        return x.index_put((ei[1],), x[ei[0]] * 2)
    return {"gcn": gcn, "gin": gin, "sage": sage, "max": amax, "copy": copy}


def _as_cuda_sm90() -> None:
    """Generate as for a CUDA device of capability 9.0 (this process launches nothing)."""
    import torch
    from torchfuse.backends import triton as tb
    from torchfuse.backends.triton import emitter

    real = tb.half_atomic_adds

    def half_atomic_adds(device_type: str) -> frozenset:
        saved = torch.cuda.is_available, torch.cuda.get_device_capability
        torch.cuda.is_available, torch.cuda.get_device_capability = (lambda: True), (lambda *a: (9, 0))
        try:
            return real("cuda")
        finally:
            torch.cuda.is_available, torch.cuda.get_device_capability = saved
    tb.half_atomic_adds = half_atomic_adds
    emitter._interpreting = lambda: False     # GPU-form source (kernels never run here)


def dump(args: argparse.Namespace, path: str) -> None:
    """Child process: generate the kernels of every case and write their sources and launches."""
    import torch
    import torchfuse
    from torchfuse.backends.triton import launch
    _as_cuda_sm90()
    graphs = _graphs()
    out = []
    for g in args.graphs.split(","):
        for d in args.dtypes.split(","):
            for f in map(int, args.widths.split(",")):
                dtype = getattr(torch, DTYPES[d])
                gen = torch.Generator().manual_seed(0)
                x = torch.randn(N, f, generator=gen).to(dtype)
                ei = torch.randint(0, N, (2, E), generator=gen)
                w = torch.rand(E, generator=gen).to(dtype)
                seen: list[tuple] = []

                def record(kernel, grid, a, constexprs, warps, names, seen=seen):
                    spec = [("*", TRITON_TYPES[str(v.dtype).replace("torch.", "")]) if isinstance(v, torch.Tensor)
                            else ("int", int(v)) for v in a]
                    seen.append((getattr(kernel, "fn", kernel).__name__, spec, dict(zip(names, constexprs)), warps))
                torch._dynamo.reset()
                with launch.launch_hook(record):
                    rep = torchfuse.explain(graphs[g], x, ei, w,
                                            options={"cpu_backend": "triton", "first_calls": "wait"})
                sources = {k.name: k.source for k in rep.kernels}
                for name, spec, constexprs, warps in seen:
                    if name in sources:
                        out.append({"graph": g, "dtype": d, "width": f, "name": name, "source": sources[name],
                                    "args": spec, "constexprs": constexprs, "warps": warps})
    with open(path, "w") as fh:
        json.dump(out, fh)


def _forms(ptx: str, pattern: str) -> str:
    counts = collections.Counter(re.findall(pattern, ptx))
    return " ".join(f"{k}({n})" for k, n in sorted(counts.items())) or "-"


def compile_ptx(case: dict, folder: str) -> str:
    """The sm_90 PTX of one recorded kernel, specialized as its launch would be."""
    import importlib.util
    import inspect

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from torchfuse.backends.triton.module import module_source
    path = os.path.join(folder, f"{case['name']}_{case['graph']}_{case['dtype']}_{case['width']}.py")
    with open(path, "w") as fh:
        fh.write(module_source([case["source"]], interpreter=False))
    spec = importlib.util.spec_from_file_location(os.path.basename(path)[:-3], path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    fn = getattr(mod, case["name"])
    params = list(inspect.signature(fn.fn).parameters)
    sig, constexprs, attrs = {}, dict(case["constexprs"]), {}
    for i, (p, (kind, v)) in enumerate(zip(params, case["args"])):
        if kind == "*":
            sig[p] = "*" + v
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif v == 1 and p not in fn.do_not_specialize and i not in fn.do_not_specialize:
            sig[p] = "constexpr"
            constexprs[p] = 1
        else:
            sig[p] = "i32" if -2 ** 31 <= v < 2 ** 31 else "i64"
            if v % 16 == 0 and p not in fn.do_not_specialize and i not in fn.do_not_specialize:
                attrs[(i,)] = [["tt.divisibility", 16]]
    for p in params[len(case["args"]):]:
        sig[p] = "constexpr"
    compiled = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=constexprs, attrs=attrs),
                              target=GPUTarget("cuda", 90, 32), options={"num_warps": case["warps"]})
    return compiled.asm["ptx"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--graphs", default="gcn,gin,sage,max,copy")
    ap.add_argument("--dtypes", default="fp32,bf16,fp16")
    ap.add_argument("--widths", default="256,128,47,64")
    ap.add_argument("--kernels", default="scatter", choices=["scatter", "all"],
                    help="scatter: only kernels with an atomic or a scatter/index in their name")
    ap.add_argument("--dump", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.dump:
        return dump(args, args.dump)
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "cases.json")
        env = dict(os.environ, TRITON_INTERPRET="1", TORCHFUSE_CACHE_DIR=os.path.join(folder, "cache"))
        subprocess.run([sys.executable, __file__, "--dump", path, "--graphs", args.graphs, "--dtypes", args.dtypes,
                        "--widths", args.widths], check=True, env=env)
        with open(path) as fh:
            cases = json.load(fh)
        os.environ.pop("TRITON_INTERPRET", None)
        print(f"{'graph':5} {'dtype':5} {'F':>4}  {'kernel':44} atomics | stores | loads (sm_90 PTX)")
        for case in cases:
            if args.kernels == "scatter" and "tl.atomic_" not in case["source"] and \
                    not any(w in case["name"] for w in ("scatter", "index")):
                continue
            ptx = compile_ptx(case, folder)
            forms = " | ".join(_forms(ptx, p) for p in (ATOMICS, STORES, LOADS))
            print(f"{case['graph']:5} {case['dtype']:5} {case['width']:>4}  {case['name']:44} {forms}", flush=True)


if __name__ == "__main__":
    main()
