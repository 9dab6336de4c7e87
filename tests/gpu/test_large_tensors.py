"""Tensors past 2**31 elements: offsets that overflow int32 make the Triton kernels switch their
index arithmetic to int64 (the launch's BIG flag, runtime/compiled_graph._needs_64bit_expr), as
Inductor does.  A pointwise, a reduction and a gather kernel over a > 2**31-element tensor;
int8/bool/fp16 keep each test within ~15 GB of an 80 GB GPU.  Skipped without CUDA; run on the
lent H100 with `python -m pytest tests/gpu/test_large_tensors.py`."""
import pytest
import torch

import torchfuse

pytestmark = pytest.mark.skipif(not torch.cuda.is_available() or
                                torch.cuda.get_device_properties(0).total_memory < 60 * 2 ** 30,
                                reason="needs a CUDA GPU with 60+ GB")

N = 2 ** 31 + 4099          # elements: past int32, not a multiple of any block size


@pytest.fixture(autouse=True)
def _reset():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()
    torch.cuda.empty_cache()


def test_pointwise_past_int32():
    x = torch.randint(-100, 100, (N,), dtype=torch.int8, device="cuda")
    f = torchfuse.compile(lambda x: (x * 3 + 1).relu())
    out = f(x)
    ref = (x * 3 + 1).relu()
    assert torch.equal(out[-4096:], ref[-4096:]) and torch.equal(out, ref)
    assert torchfuse.explain(lambda x: (x * 3 + 1).relu(), x).kernels


def test_reduction_past_int32():
    x = torch.rand(N, device="cuda") < 0.3                  # bool
    x2 = x.view(1, -1)
    f = torchfuse.compile(lambda x: (x.sum(-1), x.to(torch.int32).amax(-1)))
    s, m = f(x2)
    assert s.item() == x.sum().item() and m.item() == 1
    rows = torch.randint(-5, 5, (3, N // 3), dtype=torch.int8, device="cuda")
    g = torchfuse.compile(lambda r: r.to(torch.int64).sum(-1))
    assert torch.equal(g(rows), rows.to(torch.int64).sum(-1))


def test_gather_past_int32():
    w = torch.randn(N // 64 + 1, 64, dtype=torch.float16, device="cuda")      # > 2**31 elements
    ids = torch.tensor([0, w.shape[0] - 1, w.shape[0] // 2, -1, 12345], device="cuda").repeat(97)
    f = torchfuse.compile(lambda w, i: (w[i] * 2).float().sum(-1))
    torch.testing.assert_close(f(w, ids), (w[ids] * 2).float().sum(-1), atol=1e-1, rtol=1e-2)
    # on the GPU a failed check is reported without a host sync: by the next call, or at once
    # by check_kernel_errors() (runtime/kernel_errors.py); strict mode raises at the call
    with pytest.raises(IndexError):
        f(w, torch.tensor([w.shape[0]], device="cuda"))
        torchfuse.check_kernel_errors()
    strict = torchfuse.compile(lambda w, i: (w[i] * 2).float().sum(-1), options={"strict": True})
    with pytest.raises(IndexError):
        strict(w, torch.tensor([w.shape[0]], device="cuda"))
