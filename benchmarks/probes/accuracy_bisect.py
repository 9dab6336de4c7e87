"""Which submodule of a library model loses accuracy under torchfuse: every submodule under a
prefix is compiled alone on its own captured input, in bf16, and judged against itself in fp32
(torchfuse.tools.accuracy), next to eager bf16.

    python benchmarks/probes/accuracy_bisect.py timm_mobilevitv2_100 gpu cuda stages.2.1
    python benchmarks/probes/accuracy_bisect.py timm_mobilevitv2_100 tiny cpu stages.2.1 triton   # interpreter

A submodule that fails while its children pass points at a fusion across the children.
"""
from __future__ import annotations

import copy
import os
import sys
import warnings

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from zoo_library import LIBRARY_BY_NAME  # noqa: E402

from torchfuse.tools.accuracy import judge  # noqa: E402


def main(name: str, size: str, device: str, prefix: str, triton_on_cpu: bool) -> None:
    warnings.filterwarnings("ignore")
    opts = {"strict": True, **({"cpu_backend": "triton"} if triton_on_cpu else {})}
    m32, inputs = LIBRARY_BY_NAME[name].make(size, device, torch.float32)
    captured: dict[str, tuple[torch.Tensor, ...]] = {}
    handles = []
    for n, mod in m32.named_modules():
        if n.startswith(prefix):
            def pre(mod: torch.nn.Module, args: tuple, n: str = n) -> None:
                captured.setdefault(n, tuple(a.detach().clone() for a in args if isinstance(a, torch.Tensor)))
            handles.append(mod.register_forward_pre_hook(pre))
    with torch.no_grad():
        m32(*inputs)
    for h in handles:
        h.remove()
    modules = dict(m32.named_modules())
    for n, args in captured.items():
        mod32 = modules[n]
        args16 = tuple(a.bfloat16() for a in args)
        mod16 = copy.deepcopy(mod32).bfloat16()
        with torch.no_grad():
            ref, eager = mod32(*(a.float() for a in args16)), mod16(*args16)
            torch._dynamo.reset()
            try:
                out = torch.compile(mod16, backend="torchfuse", options=opts)(*args16)
            except Exception as e:
                print(f"{n:40s} ERROR {str(e)[:200]}", flush=True)
                continue
        if isinstance(ref, tuple):
            ref, eager, out = ref[0], eager[0], out[0]
        v = judge(out, eager, ref)
        print(f"{n:40s} {type(mod32).__name__:24s} x{v.error / max(v.eager_error, 1e-30):6.2f} {v}", flush=True)


if __name__ == "__main__":
    if len(sys.argv) < 5:
        raise SystemExit(__doc__)
    main(sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4], "triton" in sys.argv[5:])
