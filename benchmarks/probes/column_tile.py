"""Column sums (x.sum(0)) with other column-tile widths, against Inductor (GPU probe, ~2 min).

    python benchmarks/probes/column_tile.py

A column sum's looped kernel reads tiles of XBLOCK adjacent columns (triton_launch.py:
COLUMN_XBLOCK, at least COLUMN_MIN_XBLOCK), and the split pass counts its programs in tiles of
the same width (SplitParams.column_tile).  32 columns are 128 bytes of fp32 but 64 bytes of
bf16.  Each row of the table forces one (XBLOCK cap, XBLOCK floor, split tile) and gives GPU
microseconds per call (CUDA-graph replay) and Inductor's time over torchfuse's.  Measured:
64 columns won over 32 (bf16 [8192, 2304] 0.82 -> 0.96x), and more elements per step were
tried for tall inputs ([32768, 768]: 0.54x in bf16).
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import gpu_bench  # noqa: E402  (fresh caches, set before torch is imported)
import torch  # noqa: E402

from torchfuse.backends.triton import launch as triton_launch  # noqa: E402
from torchfuse.backends.triton import TritonBackend  # noqa: E402

SHAPES = [(8192, 2304), (2048, 768), (2048, 3072), (2047, 1000), (32768, 768), (8 << 20, 8), (4096, 50257)]
# (XBLOCK cap, XBLOCK floor, split tile, elements per step, warps); the first is the default
VARIANTS = [(64, 16, 64, 2048, 8), (64, 16, 64, 4096, 8), (64, 16, 64, 8192, 8), (64, 16, 64, 8192, 16),
            (32, 16, 32, 2048, 8)]


_BASE = TritonBackend.split_params


def _force(cap: int, floor: int, tile: int, elements: int, warps: int) -> None:
    import dataclasses
    triton_launch.COLUMN_XBLOCK, triton_launch.COLUMN_MIN_XBLOCK = cap, floor
    triton_launch.COLUMN_ELEMENTS, triton_launch.COLUMN_WARPS = elements, warps
    triton_launch._modules.clear()      # launch plans are cached on the kernels: new modules

    def split_params(self, num_threads, min_chunk=0):
        params = _BASE(self, num_threads, min_chunk)
        return dataclasses.replace(params, column_tile=tile) if self.device_type == "cuda" else params
    TritonBackend.split_params = split_params


def main() -> None:
    fn = lambda x: x.sum(0)  # noqa: E731
    print("| shape | dtype | inductor us | " + " | ".join("/".join(map(str, v)) for v in VARIANTS) + " |")
    for dtype in (torch.float32, torch.bfloat16):
        for shape in SHAPES:
            x = torch.randn(*shape, device="cuda", dtype=dtype)
            torch._dynamo.reset()
            ind = gpu_bench.bench_graph(torch.compile(fn), x) * 1e3
            cells = []
            for variant in VARIANTS:
                _force(*variant)
                torch._dynamo.reset()
                f = torch.compile(fn, backend="torchfuse")
                out = f(x)
                err = float((out.float() - fn(x).float()).abs().max())
                us = gpu_bench.bench_graph(f, x) * 1e3
                cells.append(f"{us:.1f} ({ind / us:.2f}x{'' if err < 1 else ' ERR'})")
            print(f"| {shape[0]}x{shape[1]} | {str(dtype)[6:]} | {ind:.1f} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
