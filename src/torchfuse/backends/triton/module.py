"""The prologue of every generated Triton module (on a GPU: libdevice; under the interpreter:
stand-ins built from the ops it runs) and the module around a graph's kernels."""
from __future__ import annotations

HEADER_GPU = '''import triton
import triton.language as tl
try:
    from triton.language.extra import libdevice
except ImportError:  # older Triton
    from triton.language.extra.cuda import libdevice


@triton.jit
def _to_bf16(x):
    return x.to(tl.bfloat16)
'''

# Triton's interpreter (CPU, used by CI) cannot call libdevice; these stand-ins are built from
# the core ops it does run.  They are only as accurate as a correctness check needs.
HEADER_INTERPRETER = '''import triton
import triton.language as tl


@triton.jit
def _to_bf16(x):
    # the interpreter truncates float32 -> bfloat16; round the bits to nearest even first (a carry
    # into the exponent is right: the largest values round to inf), then the truncation is exact
    b = x.to(tl.float32).to(tl.uint32, bitcast=True)
    b = (b + (0x7FFF + ((b >> 16) & 1))) & 0xFFFF0000
    return tl.where(x != x, x, b.to(tl.float32, bitcast=True)).to(tl.bfloat16)


@triton.jit
def _tanh(x):
    e = tl.exp(-2.0 * tl.abs(x))
    t = (1.0 - e) / (1.0 + e)
    return tl.where(x < 0, -t, t)


@triton.jit
def _expm1(x):
    return tl.where(tl.abs(x) < 1e-5, x + 0.5 * x * x, tl.exp(x) - 1.0)


@triton.jit
def _log1p(x):
    return tl.where(tl.abs(x) < 1e-4, x - 0.5 * x * x + x * x * x / 3.0, tl.log(1.0 + x))


@triton.jit
def _trunc(x):
    return tl.where(x < 0, tl.ceil(x), tl.floor(x))


@triton.jit
def _nearbyint(x):
    r = tl.floor(x + 0.5)
    tie = (r - x) == 0.5
    odd = (r - 2.0 * tl.floor(r * 0.5)) != 0
    return tl.where(tie & odd, r - 1.0, r)


@triton.jit
def _fmod(a, b):
    q = a / b
    q = tl.where(q < 0, tl.ceil(q), tl.floor(q))
    return a - q * b


@triton.jit
def _pow(a, b):
    mag = tl.exp2(b * tl.log2(tl.abs(a)))
    b_int = tl.floor(b) == b
    b_odd = b_int & ((b - 2.0 * tl.floor(b * 0.5)) != 0)
    r = tl.where((a < 0) & b_odd, -mag, mag)
    r = tl.where((a < 0) & (~b_int), mag - mag + (tl.full([1], 1e999, tl.float32) - tl.full([1], 1e999, tl.float32)), r)
    return tl.where(b == 0, 1.0, r)


class libdevice:
    tanh = _tanh
    expm1 = _expm1
    log1p = _log1p
    trunc = _trunc
    nearbyint = _nearbyint
    fmod = _fmod
    pow = _pow
'''

HEADER_COMMON = '''



@triton.jit
def _max_nan(a, b):
    return tl.where((a != a) | (a > b), a, tl.where(b != b, b, b))


@triton.jit
def _min_nan(a, b):
    return tl.where((a != a) | (a < b), a, tl.where(b != b, b, b))
'''


def module_source(kernel_sources: list[str], interpreter: bool = False) -> str:
    mul = '''

@triton.jit
def _mul_combine(a, b):
    return a * b
'''
    header = (HEADER_INTERPRETER if interpreter else HEADER_GPU) + HEADER_COMMON
    return header + mul + "\n\n" + "\n\n\n".join(kernel_sources) + "\n"
