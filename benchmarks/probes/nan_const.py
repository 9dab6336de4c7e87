"""Probe: which ways of writing NaN/inf constants does this Triton accept on the GPU?"""
import torch, triton, triton.language as tl

INF = tl.constexpr(float("inf"))
NAN = tl.constexpr(float("nan"))

@triton.jit
def k_globals(x, o):
    i = tl.arange(0, 16)
    v = tl.load(x + i)
    tl.store(o + i, tl.where(v > 0, NAN, -INF))

@triton.jit
def k_literals(x, o):
    i = tl.arange(0, 16)
    v = tl.load(x + i)
    inf = tl.full([1], 1e999, tl.float32)
    nan = inf - inf
    tl.store(o + i, tl.where(v > 0, nan, -inf))

x = torch.randn(16, device="cuda"); o = torch.empty(16, device="cuda")
for k in (k_globals, k_literals):
    try:
        k[(1,)](x, o); torch.cuda.synchronize(); print(k.fn.__name__, "OK", o[:4].tolist())
    except Exception as e:
        print(k.fn.__name__, "FAIL", type(e).__name__, str(e)[:600])
