"""A scatter kernel's atomics vectorize on sm_90 (backends/triton/codegen.py `_emit_scatter`):
its address is the bare contiguous offset and the index's validity a mask constant along the
features, which Triton needs to emit `red.global.add.v4.f32` rather than one add per element.

The kernel is generated here (under Triton's interpreter, launches intercepted) and compiled
for a CUDA sm_90 target in a child process without the interpreter, with the ptxas Triton
bundles: no GPU needed.  Skipped where Triton cannot compile for CUDA.
"""
import os
import re

import pytest
import torch

os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

import torchfuse  # noqa: E402
from sm90_ptx import sm90_ptx  # noqa: E402
from torchfuse.backends.triton import launch  # noqa: E402

_TYPES = {torch.float32: "fp32", torch.int64: "i64", torch.int32: "i32"}


def _scatter_kernel(fn, *args) -> dict:
    """The source and first launch of `fn`'s kernel that adds atomically (nothing runs)."""
    launches = []

    def record(kernel, grid, a, constexprs, warps, names):
        types = [("*" + _TYPES[v.dtype]) if isinstance(v, torch.Tensor) else "i32" for v in a]
        launches.append((getattr(kernel, "fn", kernel).__name__, types, dict(zip(names, constexprs)), warps))
    torch._dynamo.reset()
    with launch.launch_hook(record):
        rep = torchfuse.explain(fn, *args, options={"cpu_backend": "triton", "first_calls": "wait"})
    sources = {k.name: k.source for k in rep.kernels}
    # (a launch names the variant: <kernel>_tiled for a scatter's row tile)
    found = [(n, t, c, w) for n, t, c, w in launches if "tl.atomic_add" in sources.get(re.sub("_tiled$", "", n), "")]
    assert len(found) == 1, [n for n, *_ in launches]
    name, types, constexprs, warps = found[0]
    return {"name": name, "source": sources[re.sub("_tiled$", "", name)], "types": types, "constexprs": constexprs,
            "warps": warps}


def test_scatter_add_of_wide_rows_vectorizes_on_sm90(tmp_path):
    """A GIN layer's scatter_add of 256-wide fp32 rows: vector atomic adds (v4.f32) on sm_90."""
    def gin(x, ei):
        m = torch.relu(x)[ei[0]]
        return torch.zeros_like(x).scatter_add(0, ei[1].view(-1, 1).expand(-1, x.shape[1]), m) + x
    x = torch.randn(37, 256)
    ei = torch.randint(0, 37, (2, 101))
    case = _scatter_kernel(gin, x, ei)
    ptx = sm90_ptx(tmp_path, case["name"], case["source"], case["types"], case["constexprs"], case["warps"])
    forms = set(re.findall(r"\b(?:red|atom)\.[\w.]+", ptx))
    assert forms, f"no atomic in the kernel's PTX:\n{case['source']}"
    assert all(re.search(r"\.v[248]\.", f) for f in forms), f"scalar atomics {forms}:\n{case['source']}"
    # the row tile (codegen.scatter_tile): the edge index is read once per row, [YBLOCK, 1]
    assert case["name"].endswith("_tiled"), case["name"]
    assert re.search(r"tl\.load\(\w+ \+ \(x0\) \+ yzero, mask=ymask", case["source"]), case["source"]
