"""Training under torchfuse.lazy.  The lazy mode sits below autograd: the forward's ops and the
backward pass's ops are both recorded and fused, a backward pass ends with one flush of the
gradients it produced, and gradients, optimizer updates and batch-norm statistics equal eager's
-- across steps, new batch sizes and gradient accumulation.  The blocks record every op
(`capture_modules=False`): compiled module calls are tested in test_lazy_capture.py."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import torchfuse
from torchfuse import counters

ITEM = "value read by .item()/bool()/int()/float()"
BACKWARD = "end of a backward pass"


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(12, 32), nn.LayerNorm(32), nn.GELU(), nn.Linear(32, 4))


def cnn() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(8, 16, 3, padding=1, groups=2), nn.BatchNorm2d(16), nn.SiLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, 5)).train()


def assert_grads_equal(model: nn.Module, ref: nn.Module) -> None:
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert type(p.grad) is not type(None), name
        torch.testing.assert_close(p.grad, q.grad, atol=1e-5, rtol=1e-4, msg=lambda m: f"{name}: {m}")


def test_mlp_step_fuses_forward_and_backward():
    model = mlp()
    ref = copy.deepcopy(model)
    x, y = torch.randn(6, 12), torch.randn(6, 4)
    with torchfuse.lazy(capture_modules=False, options={"strict": True}) as ctx:
        loss = F.mse_loss(model(x), y)
        value = loss.item()
        loss.backward()
    ref_loss = F.mse_loss(ref(x), y)
    ref_loss.backward()
    assert value == pytest.approx(ref_loss.item(), rel=1e-6)
    assert_grads_equal(model, ref)
    # one graph for the forward (read by .item()), one for the whole backward pass
    assert [f.reason for f in ctx.flushes] == [ITEM, BACKWARD], ctx.explain()
    assert [f.kernels for f in ctx.flushes] == [3, 5], ctx.explain()
    assert {"aten.gelu_backward.default", "aten.native_layer_norm_backward.default"} <= \
        set(ctx.flushes[1].op_names)
    # gradients are computed once the block ends and read like plain tensors
    assert all(p.grad._lz_real is not None for p in model.parameters())
    torch.testing.assert_close(model[0].weight.grad.clone() * 2, ref[0].weight.grad * 2)


def test_gradient_accumulation_is_recorded_too():
    model = mlp()
    ref = copy.deepcopy(model)
    batches = [(torch.randn(5, 12), torch.randn(5, 4)) for _ in range(3)]
    with torchfuse.lazy(capture_modules=False, options={"strict": True}) as ctx:
        for x, y in batches:
            F.mse_loss(model(x), y).backward()       # `p.grad += g` from the second pass on
    for x, y in batches:
        F.mse_loss(ref(x), y).backward()
    assert_grads_equal(model, ref)
    # nothing forces a gradient out early: one flush per backward pass
    assert [f.reason for f in ctx.flushes] == [BACKWARD] * 3, ctx.explain()
    assert "aten.add.Tensor" in ctx.flushes[2].op_names


def test_accumulating_into_a_viewed_gradient_stays_eager():
    model = mlp()
    ref = copy.deepcopy(model)
    x, y = torch.randn(5, 12), torch.randn(5, 4)
    with torchfuse.lazy(capture_modules=False, options={"strict": True}):
        F.mse_loss(model(x), y).backward()
        row = model[0].weight.grad[0]                # a view: must see the next accumulation
        F.mse_loss(model(x), y).backward()
    for _ in range(2):
        F.mse_loss(ref(x), y).backward()
    assert_grads_equal(model, ref)
    torch.testing.assert_close(row, ref[0].weight.grad[0])


def test_cnn_step_with_batch_norm_matches_eager():
    model = cnn()
    ref = copy.deepcopy(model)
    for b in (4, 6):
        x, y = torch.randn(b, 3, 12, 12), torch.randint(0, 5, (b,))
        model.zero_grad()
        ref.zero_grad()
        with torchfuse.lazy(capture_modules=False, options={"strict": True}) as ctx:
            loss = F.cross_entropy(model(x), y)
            loss.backward()
        ref_loss = F.cross_entropy(ref(x), y)
        ref_loss.backward()
        torch.testing.assert_close(loss.detach(), ref_loss.detach())
        assert_grads_equal(model, ref)
        for (name, a), c in zip(model.named_buffers(), ref.buffers()):
            torch.testing.assert_close(a, c, msg=lambda m: f"{name}: {m}")
        # training batch norm runs eagerly (it writes its running statistics); the backward
        # pass -- convolution, pooling and batch-norm backward included -- is one graph (each
        # NCHW batch-norm input gradient in its per-channel sums' kernel)
        assert ctx.flushes[-1].reason == BACKWARD and sum(f.reason == BACKWARD for f in ctx.flushes) == 1
        assert ctx.flushes[-1].kernels == 10, ctx.explain()
        assert {"aten.convolution_backward.default", "aten.max_pool2d_with_indices_backward.default"} <= \
            set(ctx.flushes[-1].op_names)


def test_gpt2_training_steps_with_new_batch_sizes():
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=500, n_positions=64,
                                  attn_pdrop=0.0, resid_pdrop=0.0, embd_pdrop=0.0)
    cfg._attn_implementation = "sdpa"
    model = transformers.GPT2LMHeadModel(cfg).train()
    ref = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    graphs = []
    for b in (2, 3, 5):
        ids = torch.randint(0, 500, (b, 12))
        before = counters["graphs_compiled"]
        with torchfuse.lazy(capture_modules=False, options={"strict": True}) as ctx:
            loss = model(ids, labels=ids).loss
            value = loss.item()
            loss.backward()
            opt.step()
            opt.zero_grad()
        graphs.append(counters["graphs_compiled"] - before)
        ref_loss = ref(ids, labels=ids).loss
        ref_loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        assert value == pytest.approx(ref_loss.item(), rel=1e-5)
        assert [f.reason for f in ctx.flushes] == [ITEM, BACKWARD], ctx.explain()
        # compiled (0 kernels: eager) and fused, not run op by op (93 and 133 ops: 15 and 29 kernels)
        assert all(0 < f.kernels <= f.ops // 3 for f in ctx.flushes), ctx.explain()
    assert graphs[0] == 2 and graphs[1:] == [0, 0], graphs      # new batch sizes compile nothing
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, atol=1e-5, rtol=1e-4, msg=lambda m: f"{name}: {m}")


def test_fifty_steps_with_changing_batch_sizes_compile_a_bounded_number_of_graphs():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(10, 24), nn.LayerNorm(24), nn.Tanh(), nn.Linear(24, 3))
    ref = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9)
    sizes = [2 + (7 * i) % 11 for i in range(50)]             # 2..12, in a scrambled order
    assert len(set(sizes)) == 11
    before = counters["graphs_compiled"]
    compiled = []
    for b in sizes:
        x, y = torch.randn(b, 10), torch.randint(0, 3, (b,))
        with torchfuse.lazy(capture_modules=False, options={"strict": True}):
            F.cross_entropy(model(x), y).backward()
            opt.step()
            opt.zero_grad()
        compiled.append(counters["graphs_compiled"] - before)
        F.cross_entropy(ref(x), y).backward()
        ref_opt.step()
        ref_opt.zero_grad()
    # the first step compiles its graphs (symbolic sizes), the second the momentum buffers'
    # first update; no batch size after that compiles anything
    assert compiled[-1] == compiled[1] <= 4, compiled
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, atol=1e-5, rtol=1e-4)


def test_flush_log_prints_as_a_table():
    model = mlp()
    x, y = torch.randn(3, 12), torch.randn(3, 4)
    with torchfuse.lazy(capture_modules=False) as ctx:
        loss = F.mse_loss(model(x), y)
        value = loss.item()
        loss.backward()
    assert value == pytest.approx(F.mse_loss(mlp()(x), y).item(), rel=1e-6)
    text = str(ctx.flushes)
    lines = text.splitlines()
    assert lines[0].split() == ["#", "reason", "ops", "outputs", "kernels", "graph", "ms"]
    assert lines[1].startswith("0  " + ITEM) and lines[2].startswith("1  " + BACKWARD)
    total = lines[-1].split()
    assert total[0] == "total" and int(total[1]) == sum(f.ops for f in ctx.flushes)
    assert repr(ctx.flushes) == text and len(ctx.flushes) == 2


@pytest.mark.parametrize("pipeline_ops", [16, 64])
def test_training_with_flushes_cut_inside_forward_and_backward(pipeline_ops):
    """Pipelined flushes (every `pipeline_ops` recorded ops) cut the forward and the backward
    pass anywhere, views of computed values included; the step still equals eager's."""
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2)
    model = transformers.LlamaForCausalLM(cfg).train()
    ref = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, foreach=True)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, foreach=True)
    for b in (2, 3):
        ids = torch.randint(0, 300, (b, 10))
        with torchfuse.lazy(capture_modules=False, options={"strict": True}, pipeline_ops=pipeline_ops) as ctx:
            loss = model(ids, labels=ids).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
        ref_loss = ref(ids, labels=ids).loss
        ref_loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        torch.testing.assert_close(loss.detach(), ref_loss.detach())
        assert sum(f.reason == "pipeline" for f in ctx.flushes) >= 2, ctx.explain()
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, atol=1e-5, rtol=1e-4, msg=lambda m: f"{name}: {m}")
