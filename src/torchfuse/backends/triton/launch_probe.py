"""A small Triton kernel that verifies the direct launcher's calling convention
(triton_launch.py) when a model's own kernels are too large to verify on.

A convention is trusted only after it reproduced a launch bit for bit, which needs copies of the
kernel's arguments.  A kernel whose arguments exceed the copy budget is not verified on; if every
kernel of a model is that large (a ViT at batch 64), no convention was ever trusted and every
launch took Triton's slow Python path (~25 us more each: the H200 host spent 5.5 ms per DeiT call
where eager took 3.9).  This kernel is verified instead, once per process.

This file imports only Triton: compile workers (compile_workers.py) import it by path.
"""
import triton
import triton.language as tl


@triton.jit
def probe(x, y, n, step, XBLOCK: tl.constexpr, BIG: tl.constexpr):
    offs = tl.program_id(0) * XBLOCK + tl.arange(0, XBLOCK)
    mask = offs < n
    tl.store(y + offs, tl.load(x + offs, mask) * 2.0 + (offs // step).to(tl.float32), mask)


ARGS_N, ARGS_STEP, XBLOCK, BIG = 1000, 48, 1024, False
