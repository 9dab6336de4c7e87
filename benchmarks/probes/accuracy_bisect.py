"""Which submodule of a library model loses accuracy under torchfuse: every submodule under a
prefix is compiled alone on its own captured input, in bf16, and judged against itself in fp32
(torchfuse.tools.accuracy), next to eager bf16.

    python benchmarks/probes/accuracy_bisect.py timm_mobilevitv2_100 gpu cuda stages.2.1
    python benchmarks/probes/accuracy_bisect.py timm_mobilevitv2_100 tiny cpu stages.2.1 triton   # interpreter
    python benchmarks/probes/accuracy_bisect.py timm_mobilevitv2_100 gpu cpu stages.2.1.transformer.0 \
        triton gpu-split stale

A submodule that fails while its children pass points at a fusion across the children.  Under
the interpreter, `gpu-split` splits reductions as on an H100 (132 SMs) and `stale` makes a
kernel's loads of another lane's store read 0.0, as a GPU may (tools/cross_lane.py): together
they showed mobilevitv2's GPU-only failure on a CPU.
"""
from __future__ import annotations

import contextlib
import copy
import os
import sys
import warnings

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from zoo_library import LIBRARY_BY_NAME  # noqa: E402

from torchfuse.tools.accuracy import judge  # noqa: E402


def main(name: str, size: str, device: str, prefix: str, triton_on_cpu: bool, gpu_split: bool = False,
         stale: bool = False) -> None:
    warnings.filterwarnings("ignore")
    if gpu_split:
        from torchfuse import backends
        from torchfuse.backends.triton import gpu_split_params
        backends.split_params = lambda device, config: gpu_split_params(132, config.split_min_chunk)
    keep = contextlib.ExitStack()       # (held until main returns: its exit undoes the emulation)
    opts_extra = {}
    if stale:
        from torchfuse.tools.cross_lane import stale_cross_lane_loads
        keep.enter_context(stale_cross_lane_loads(0.0))
        opts_extra = {"graph_cache": False}          # (a cached graph would not be generated again)
    opts = {"strict": True, **({"cpu_backend": "triton"} if triton_on_cpu else {}), **opts_extra}
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
    main(sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4], "triton" in sys.argv[5:], "gpu-split" in sys.argv[5:],
         "stale" in sys.argv[5:])
