"""Triton index checks on a GPU (runtime/kernel_errors.py): calls do not synchronize the host
with the device for them, and a bad index raises eager's IndexError at a later call, at
torchfuse.check_kernel_errors(), or (strict) at the call itself.  Skipped without CUDA."""
import pytest
import torch
import torch.nn.functional as F

import torchfuse

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _fn(table, ids):
    return F.gelu(F.embedding(ids, table))


@pytest.fixture(autouse=True)
def _reset():
    torch._dynamo.reset()
    yield
    torch.cuda.set_sync_debug_mode(0)
    torch._dynamo.reset()


def test_no_sync_per_call_and_bad_index_raises_later():
    table = torch.randn(1000, 96, device="cuda")
    ids = torch.randint(0, 1000, (4, 37), device="cuda")
    f = torch.compile(_fn, backend="torchfuse")
    torch.testing.assert_close(f(table, ids), _fn(table, ids))
    f(table, ids)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")       # a synchronizing call raises
    for _ in range(20):
        f(table, ids)
    torch.cuda.set_sync_debug_mode(0)
    bad = ids.clone()
    bad[1, 5] = 1000
    with pytest.raises(IndexError):
        _fn(table.cpu(), bad.cpu())
    f(table, bad)                                 # the call that meets it returns
    with pytest.raises(IndexError, match="index 1000 is out of bounds for dimension 0 with size 1000"):
        for _ in range(50):
            f(table, ids)
        torchfuse.check_kernel_errors()
    torchfuse.check_kernel_errors()               # raised once
    torch.testing.assert_close(f(table, ids), _fn(table, ids))


def test_strict_raises_at_the_call():
    table = torch.randn(1000, 96, device="cuda")
    ids = torch.randint(0, 1000, (4, 37), device="cuda")
    f = torch.compile(_fn, backend="torchfuse", options={"strict": True})
    torch.testing.assert_close(f(table, ids), _fn(table, ids))
    bad = ids.clone()
    bad[3, 36] = -1
    with pytest.raises(IndexError, match="index -1 "):
        f(table, bad)
    torch.testing.assert_close(f(table, ids), _fn(table, ids))
