"""Which 16-bit atomic adds the Triton backend claims per device (backends/triton/__init__.py
`half_atomic_adds`, Features.half_atomic_add), and that Triton's interpreter does what the claim
for CPU tensors says.  The lowering's use of it is tested in tests/lowering/test_scatter_precision.py.
"""
import os

import pytest
import torch

os.environ.setdefault("TRITON_INTERPRET", "1")
triton = pytest.importorskip("triton")
tl = pytest.importorskip("triton.language")

from torchfuse.backends.triton import half_atomic_adds  # noqa: E402

F16, BF16 = torch.float16, torch.bfloat16


@pytest.mark.parametrize("capability,expected", [((6, 1), set()), ((7, 0), {F16}), ((8, 0), {F16}),
                                                 ((9, 0), {F16, BF16}), ((10, 0), {F16, BF16})])
def test_half_atomic_adds_follow_the_capability(monkeypatch, capability, expected):
    """fp16 atomic adds from sm_70, bf16 from sm_90 (vector adds there); none on ROCm or without a GPU."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: capability)
    monkeypatch.setattr(torch.version, "hip", None)
    assert half_atomic_adds("cuda") == expected
    monkeypatch.setattr(torch.version, "hip", "6.2")
    assert half_atomic_adds("cuda") == set()
    monkeypatch.setattr(torch.version, "hip", None)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert half_atomic_adds("cuda") == set()


@triton.jit
def _add_at(out, idx, val, n, BLOCK: tl.constexpr):
    o = tl.arange(0, BLOCK)
    m = o < n
    tl.atomic_add(out + tl.load(idx + o, m), tl.load(val + o, m), m, sem="relaxed")


@pytest.mark.skipif(torch.cuda.is_available(), reason="Triton's interpreter: CPU tensors only")
@pytest.mark.parametrize("dtype", [F16, BF16])
def test_interpreter_half_atomic_adds_as_claimed(dtype):
    """The interpreter adds fp16 atomically (as eager's index_add, here with colliding indices)
    and fails bf16 ("Unsupported data type"): the claim for CPU tensors is fp16 alone."""
    assert (dtype in half_atomic_adds("cpu")) == (dtype == F16)
    idx = torch.randint(0, 7, (101,))
    val = torch.randn(101).to(dtype)
    out = torch.randn(7).to(dtype)
    expected = out.clone().index_add_(0, idx, val)
    if dtype in half_atomic_adds("cpu"):
        _add_at[(1,)](out, idx, val, 101, BLOCK=128)
        torch.testing.assert_close(out, expected, atol=2e-2, rtol=1e-2)
    else:
        with pytest.raises(Exception, match="Unsupported data type"):
            _add_at[(1,)](out, idx, val, 101, BLOCK=128)
