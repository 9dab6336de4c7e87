"""torchfuse.lazy on CUDA (Triton kernels through compile_graph); skipped without a GPU."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import torchfuse
from torchfuse import counters

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def test_cuda_fusions_match_eager():
    x, w = torch.randn(64, 128, device="cuda"), torch.randn(128, device="cuda")
    fns = [
        lambda t: ((t * 1.25 + 0.5).relu() - 0.125).exp().sigmoid(),
        lambda t: torch.softmax(t * 2, -1),
        lambda t: F.layer_norm(t, (128,), w, w) + t.t().sum(0)[:, None],
        lambda t: (t.half() * 2).float().amax(1),
        lambda t: torch.where(t > 0, t, 0.0) + torch.tensor(3.0, device="cuda"),
    ]
    for fn in fns:
        before = counters["eager_fallbacks"]
        with torchfuse.lazy(options={"strict": True}) as ctx:
            out = fn(x)
        assert counters["eager_fallbacks"] == before
        assert ctx.kernels >= 1 and all(k.backend == "triton" for k in ctx.report.kernels)
        torch.testing.assert_close(out, fn(x), atol=1e-4, rtol=1e-4)


def test_cuda_semantics():
    x = torch.randn(8, 8, device="cuda")
    x0 = x.clone()
    with torchfuse.lazy() as ctx:
        y = x * 2
        v = y[1:3]
        x.add_(1)
        v.mul_(3)
        s = (y.sum() * 1).item()
        m = y @ x
        z = x.cpu() * 2                      # device change: eager
    ref = x0 * 2
    ref[1:3] *= 3
    torch.testing.assert_close(y, ref)
    assert s == pytest.approx(ref.sum().item(), rel=1e-5, abs=1e-4)
    torch.testing.assert_close(m, ref @ (x0 + 1))
    torch.testing.assert_close(z, (x0 + 1).cpu() * 2)
    assert ctx.flushes


def test_cuda_gpt2():
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=500, n_positions=64)
    model = transformers.GPT2LMHeadModel(cfg).eval().cuda()
    ids = torch.randint(0, 500, (2, 16), device="cuda")
    with torch.no_grad():
        ref = model(ids).logits
        with torchfuse.lazy() as ctx:
            out = model(ids).logits
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)
    assert ctx.kernels >= 4


def _layers(x: torch.Tensor, ws: list) -> torch.Tensor:
    for w in ws:                                      # 5 recorded ops a layer
        x = x + F.gelu(F.layer_norm(x, (x.shape[-1],)) @ w) * 0.5
    return x.sum(-1)


def test_cuda_pipelining_turns_on_for_large_work_and_stays_on():
    torch.manual_seed(0)
    ws = [torch.randn(256, 256, device="cuda") / 16 for _ in range(60)]
    ctx = torchfuse.lazy()                            # default: pipelining where the work is large
    small, large = torch.randn(4, 256, device="cuda"), torch.randn(32768, 256, device="cuda")

    def reasons(x: torch.Tensor) -> list[str]:
        n = len(ctx.flushes)
        with ctx:
            y = _layers(x, ws)
        torch.testing.assert_close(y, _layers(x, ws), atol=2e-3, rtol=2e-3)
        return [f.reason for f in ctx.flushes[n:]]

    assert "pipeline" not in reasons(small)            # 300 ops writing ~0.3M elements
    on = reasons(large)                                # ~2.5G elements: cut every 128 ops
    assert on.count("pipeline") >= 2, on
    assert reasons(small) == on                        # stays on: the same cuts for every size
    before = counters["lazy_compiles"]
    assert reasons(torch.randn(9, 256, device="cuda")) == on
    assert counters["lazy_compiles"] == before         # a new size reuses every part


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_cuda_attention_training_is_one_graph_per_pass(dtype):
    """bf16 attention runs as flash or cuDNN attention (flash's outputs include ints), fp32 as
    efficient attention; all are recorded, forward and backward."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 4, 64, 32, device="cuda", dtype=dtype, requires_grad=True) for _ in range(3))
    w = torch.randn(32, device="cuda", dtype=dtype)

    def step(q, k, v):
        out = F.scaled_dot_product_attention(q * 0.5, k, v, is_causal=True)
        loss = (F.gelu(out) * w).float().square().mean()
        loss.backward()
        return loss.detach()

    with torchfuse.lazy(options={"strict": True}) as ctx:
        loss = step(q, k, v)
        value = loss.item()
    grads = [t.grad.clone() for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    ref = step(q, k, v)
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-4
    assert value == pytest.approx(ref.item(), rel=tol)
    for g, t in zip(grads, (q, k, v)):
        torch.testing.assert_close(g, t.grad, atol=tol, rtol=tol)
    # bf16: one flush as the backward pass ends; fp32: the efficient-attention backward writes
    # its result with an eager copy_, which flushes once before it
    # (which kernel -- flash, cuDNN, efficient -- depends on the GPU and the torch build)
    ops = {name for f in ctx.flushes for name in f.op_names}
    assert any(n.startswith("aten._scaled_dot_product_") and n.endswith("attention.default") for n in ops), \
        ctx.explain()
    assert any(n.endswith("attention_backward.default") for n in ops), ctx.explain()
    assert len(ctx.flushes) <= (1 if dtype == torch.bfloat16 else 2), ctx.explain()


def test_cuda_captured_gpt2_training_steps_match_eager():
    """The model's calls compiled from the second step (lazy/capture.py): its backward runs on
    autograd's CUDA device thread, outside the lazy mode, and the optimizer's foreach update is
    recorded; the losses and parameters equal eager's."""
    import copy
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=500, n_positions=64,
                                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    model = transformers.GPT2LMHeadModel(cfg).cuda()
    ref = copy.deepcopy(model)
    opt, ref_opt = (torch.optim.AdamW(m.parameters(), lr=1e-3) for m in (model, ref))
    ctx = torchfuse.lazy(options={"strict": True})
    for batch in [2, 2, 3, 2]:
        ids = torch.randint(0, 500, (batch, 16), device="cuda")
        with ctx:
            loss = model(ids, labels=ids).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
        ref_loss = ref(ids, labels=ids).loss
        ref_loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        torch.testing.assert_close(loss.detach(), ref_loss.detach(), atol=1e-4, rtol=1e-4)
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, atol=1e-4, rtol=1e-4)
    assert [f.reason for f in ctx.flushes].count("compiled GPT2LMHeadModel call") == 3, ctx.explain()
