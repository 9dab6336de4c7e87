"""A real model under torchfuse.lazy: HuggingFace GPT-2 (small config, random weights) in eval
mode under no_grad matches eager, with both attention implementations; a second forward pass
builds nothing; a training step (forward and backward recorded) gives eager's gradients.  Every
op is recorded (`capture_modules=False`): compiled module calls are tested in test_lazy_capture.py."""
from __future__ import annotations

import copy

import pytest
import torch

import torchfuse
from torchfuse import counters


def gpt2(attn: str = "sdpa") -> torch.nn.Module:
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=500, n_positions=64)
    cfg._attn_implementation = attn
    return transformers.GPT2LMHeadModel(cfg).eval()


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_gpt2_inference_matches_eager(attn):
    model = gpt2(attn)
    ids = torch.randint(0, 500, (2, 16))
    with torch.no_grad():
        ref = model(ids).logits
        with torchfuse.lazy(capture_modules=False, options={"strict": True}) as ctx:
            out = model(ids).logits
        torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)
        assert ctx.kernels >= 8, ctx.explain()
        fused = [f for f in ctx.flushes if f.ops >= 3]
        assert fused, ctx.explain()
        # A second pass is served from the cache: no graph compiled, no kernel built.
        builds, graphs = counters["kernel_builds"], counters["graphs_compiled"]
        with torchfuse.lazy(capture_modules=False, options={"strict": True}) as ctx2:
            out2 = model(ids).logits
        torch.testing.assert_close(out2, ref, atol=1e-4, rtol=1e-4)
        assert counters["kernel_builds"] == builds and counters["graphs_compiled"] == graphs
        assert all(f.cache_hit for f in ctx2.flushes) and len(ctx2.flushes) == len(ctx.flushes)


def test_gpt2_generate_loop_matches_eager():
    model = gpt2("sdpa")
    ids = torch.randint(0, 500, (1, 5))
    with torch.no_grad():
        ref = model.generate(ids, max_new_tokens=6, do_sample=False, pad_token_id=0)
        with torchfuse.lazy(capture_modules=False):
            out = model.generate(ids, max_new_tokens=6, do_sample=False, pad_token_id=0)
    assert torch.equal(out, ref)


def test_gpt2_training_step_grads_match():
    model = gpt2("eager").train()
    model.config.attn_pdrop = model.config.resid_pdrop = model.config.embd_pdrop = 0.0
    for m in model.modules():
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.0
    ref = copy.deepcopy(model)
    ids = torch.randint(0, 500, (2, 12))
    with torchfuse.lazy(capture_modules=False):
        loss = model(ids, labels=ids).loss
        loss.backward()
    ref_loss = ref(ids, labels=ids).loss
    ref_loss.backward()
    torch.testing.assert_close(loss.detach(), ref_loss.detach(), atol=1e-5, rtol=1e-5)
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, atol=1e-5, rtol=1e-4, msg=lambda m: f"{name}: {m}")
