"""What one FSDP2 x tensor-parallel Llama block's compiled graphs run, Inductor next to torchfuse.

    python benchmarks/probes/tp_block_counts.py [--cpu-backend triton]

One process on the CPU, a fake process group of 4 ranks (torch's `FakeStore`: collectives run
nowhere, so the graphs are those of rank 0 of a 2 x 2 (dp, tp) mesh), the model of
`fsdp_tp_llama.py` with one block (dim 256, 8 heads, SwiGLU 704, 64 tokens, bf16 parameters:
the GPU size's ratios), `block.compile` per backend and one training step.  Per graph
(forward, backward): the generated kernels, the ATen calls by op (matmuls, attention,
collective starts and waits, anything else, which would be copies) and the activations the
forward saves for the backward.  Read from the code each compiler wrote: torchfuse's debug
folder (its wrapper and fusion stages), Inductor's output code (`PyCodeCache`).  Graph-level
differences show here; the kernels' speed does not (C++ on the CPU; `--cpu-backend triton`
writes torchfuse's Triton kernels, run under TRITON_INTERPRET=1, slow)."""
from __future__ import annotations

import argparse
import os
import re
import sys
import tempfile
from collections import Counter
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import fsdp_tp_llama as L  # noqa: E402

CFG = L.LlamaConfig(dim=256, layers=1, heads=8, hidden=704, vocab=128, seq=64, batch=4)


def _step(backend: str, mesh, options: dict) -> None:
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = L.Llama(CFG)
    L.parallelize(model, mesh, mixed_precision=True)
    kwargs = {"options": options} if backend == "torchfuse" else {}
    for block in model.layers:
        block.compile(backend=backend, dynamic=False, **kwargs)
    cos, sin = L.rotary(CFG, torch.device("cpu"))
    tokens, labels = L._batch(CFG, 0, torch.device("cpu"))
    rows = CFG.batch // mesh["dp"].size()
    logits = model(tokens[:rows], cos, sin)
    F.cross_entropy(logits.float().flatten(0, 1), labels[:rows].flatten()).backward()


def _aten_kind(op: str) -> str:
    """`aten.mm` / `mm` -> "mm"; a collective -> "start <name>" or "wait"."""
    name = op.split(".")[-1]
    if "_c10d_functional" in op:
        return "wait" if name == "wait_tensor" else f"start {name}"
    return name


def torchfuse_counts(debug_dir: Path) -> dict[str, tuple[int, Counter]]:
    out = {}
    for graph in sorted(p for p in debug_dir.iterdir() if p.is_dir()):
        wrapper = (graph / "06_wrapper.py").read_text().split("\ndef call_profiled")[0]
        kernels = re.findall(r"^    (?:\w+ = )?((?:poi|red)_fused_\w+)\(", wrapper, re.M)
        fusion = (graph / "03_fusion.txt").read_text()
        ops = Counter(_aten_kind(m.replace(".default", "")) for m in
                      re.findall(r"^ATen: [\w, ]+ = ([\w.]+)\(", fusion, re.M))
        out[graph.name.split("_", 1)[1]] = (len(kernels), ops)
    return out


def inductor_counts(modules: list) -> dict[str, tuple[int, Counter]]:
    out = {}
    for kind, mod in zip(("forward", "backward"), modules):
        src = Path(mod.__file__).read_text()
        body = src[re.search(r"def call\((?:self, )?args\):", src).end():]
        body = body[:re.search(r"\n\s+return \(", body).start()]
        kernels = re.findall(r"^\s+((?:cpp_fused|triton_)\w+)(?:\.run)?\(", body, re.M)
        ops = Counter([_aten_kind(m) for m in re.findall(r"extern_kernels\.(\w+)\(", body)] +
                      [_aten_kind(m) for m in re.findall(r"torch\.ops\.([\w.]+)\.default\(", body)])
        out[kind] = (len(kernels), ops)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cpu-backend", default="cpp", choices=("cpp", "triton"))
    args = ap.parse_args()
    from torch.testing._internal.distributed.fake_pg import FakeStore
    torch.set_num_threads(1)
    dist.init_process_group("fake", rank=0, world_size=4, store=FakeStore())
    try:
        import torchfuse  # noqa: F401  (registers the backend)
        from torch.distributed.device_mesh import init_device_mesh
        from torch._inductor.codecache import PyCodeCache
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        before = set(id(m) for m in PyCodeCache.modules)
        _step("inductor", mesh, {})
        ind = inductor_counts([m for m in PyCodeCache.modules if id(m) not in before and "def call(" in
                               Path(m.__file__).read_text()])
        with tempfile.TemporaryDirectory() as d:
            _step("torchfuse", mesh, {"debug": True, "debug_dir": d, "cpu_backend": args.cpu_backend})
            tf = torchfuse_counts(Path(d))
    finally:
        dist.destroy_process_group()
    print("| graph | compiler | kernels | ATen calls |")
    print("|---|---|---|---|")
    for kind in ("forward", "backward"):
        for name, counts in (("Inductor", ind), ("torchfuse", tf)):
            k, ops = counts.get(kind, (0, Counter()))
            print(f"| {kind} | {name} | {k} | {', '.join(f'{o} {c}' for o, c in sorted(ops.items()))} |")


if __name__ == "__main__":
    main()
