"""Which tensors of a zoo row's training step sit furthest from fp64, per backend: the forward's
outputs and every parameter gradient of one step, as RMSE against the fp64 step, shown as
multiples of eager's (same device) error, next to eager on the CPU (another valid fp32
evaluation: PyTorch's CPU kernels sum in other orders).

    python benchmarks/probes/train_accuracy.py hf_t5 [--device cuda] [--top 8]

A tensor on which eager on the CPU is as far off as a compiler is ill-conditioned (a ReLU within
rounding of zero flips between valid evaluations); one where the compilers alone are off is a
lead.  The zoo's check (benchmarks/zoo_judge.py Judge) judges the same tensors.
"""
from __future__ import annotations

import argparse
import copy
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from zoo import compile_with, reference_run  # noqa: E402
from zoo_library import LIBRARY_BY_NAME  # noqa: E402
from zoo_models import BY_NAME  # noqa: E402

from torchfuse.tools.accuracy import rmse, to_reference  # noqa: E402


class _Compiled(torch.nn.Module):
    """`model` (a submodule: same parameter names) called through `forward`."""

    def __init__(self, model: torch.nn.Module, forward) -> None:
        super().__init__()
        self.model, self._forward = model, forward

    def forward(self, *args):
        return self._forward(*args)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("name")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--size", default=None, help="zoo size (default: gpu on cuda, cpu on cpu)")
    ap.add_argument("--top", type=int, default=8)
    a = ap.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False      # as the zoo runs fp32 rows
    torch.backends.cudnn.allow_tf32 = False
    zm = BY_NAME[a.name] if a.name in BY_NAME else LIBRARY_BY_NAME[a.name]
    model, inputs = zm.make(a.size or ("gpu" if a.device == "cuda" else "cpu"), a.device, torch.float32)
    model.train()
    params = [n for n, p in model.named_parameters() if p.requires_grad]
    ref = reference_run(to_reference(copy.deepcopy(model), torch.float64), to_reference(inputs, torch.float64), zm.loss)
    names = [f"output {i}" for i in range(len(ref) - len(params))] + params
    runs = {"eager": reference_run(copy.deepcopy(model), inputs, zm.loss)}
    if a.device != "cpu":
        runs["eager on the CPU"] = reference_run(copy.deepcopy(model).cpu(), tuple(
            x.cpu() if isinstance(x, torch.Tensor) else x for x in inputs), zm.loss)
    for backend in ("torchfuse", "inductor"):
        torch._dynamo.reset()
        m = copy.deepcopy(model)
        runs[backend] = reference_run(_Compiled(m, compile_with(backend, m)), inputs, zm.loss)
    errs = {k: [rmse(t, r) for t, r in zip(v, ref)] for k, v in runs.items()}
    eager = [max(e, 1e-30) for e in errs["eager"]]
    worst = sorted(range(len(names)), key=lambda i: -errs["torchfuse"][i] / eager[i])[:a.top]
    others = [k for k in runs if k != "eager"]
    print(f"| tensor | eager RMSE vs fp64 | {' | '.join(others)} |  (x eager's error)")
    print("|---|---|" + "---|" * len(others))
    for i in worst:
        print(f"| {names[i]} | {errs['eager'][i]:.3e} | " + " | ".join(f"{errs[k][i] / eager[i]:.2f}x" for k in others)
              + " |")


if __name__ == "__main__":
    main()
