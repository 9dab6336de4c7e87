"""Whole models through torchfuse against eager PyTorch: small GPT-2 and BERT (HuggingFace
transformers, built from a config with random weights; skipped without transformers) and a small
inline ResNet-style CNN.  Inference outputs, one training step's gradients, and a second batch
size that must not trigger a new kernel build."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from torchfuse import counters

BUILD_KEYS = ("graphs_compiled", "kernels_generated", "kernel_builds", "cache_hits_disk",
              "cache_hits_memory", "eager_fallbacks")


def snapshot() -> dict[str, int]:
    return {k: counters[k] for k in BUILD_KEYS}


def delta(before: dict[str, int]) -> dict[str, int]:
    return {k: counters[k] - before[k] for k in BUILD_KEYS}


def compare_grads(model: nn.Module, ref: nn.Module, rtol: float = 1e-3, atol: float = 1e-5) -> int:
    """Every parameter's gradient equals eager's; returns how many were compared."""
    ref_params = dict(ref.named_parameters())
    n = 0
    for name, p in model.named_parameters():
        r = ref_params[name]
        assert (p.grad is None) == (r.grad is None), f"{name}: grad presence differs"
        if r.grad is None:
            continue
        torch.testing.assert_close(p.grad, r.grad, rtol=rtol, atol=atol, msg=lambda m: f"{name}: {m}")
        n += 1
    assert n == len(ref_params), f"only {n} of {len(ref_params)} parameters got gradients"
    return n


# ------------------------------------------------------------------------------------------
# HuggingFace transformers
# ------------------------------------------------------------------------------------------

def _transformers():
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    return transformers


def _gpt2(transformers):
    cfg = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=500, n_positions=64,
                                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                  bos_token_id=0, eos_token_id=0)
    return transformers.GPT2LMHeadModel(cfg)


def _bert(transformers):
    cfg = transformers.BertConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                  intermediate_size=128, vocab_size=500, max_position_embeddings=64,
                                  hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, num_labels=3)
    return transformers.BertForSequenceClassification(cfg)


def _bert_inputs(batch: int, seq: int) -> dict[str, torch.Tensor]:
    mask = torch.ones(batch, seq, dtype=torch.long)
    mask[0, seq - 3:] = 0                        # one padded sequence exercises the attention mask
    return {"input_ids": torch.randint(0, 500, (batch, seq)), "attention_mask": mask,
            "token_type_ids": torch.randint(0, 2, (batch, seq))}


def test_gpt2_inference_and_second_batch_size():
    model = _gpt2(_transformers()).eval()
    compiled = torch.compile(model, backend="torchfuse")
    ids = torch.randint(0, 500, (2, 16))
    torch._dynamo.mark_dynamic(ids, 0)
    start = snapshot()
    with torch.no_grad():
        out = compiled(ids).logits
        expected = model(ids).logits
    torch.testing.assert_close(out, expected, atol=1e-4, rtol=1e-4)
    first = delta(start)
    assert first["graphs_compiled"] >= 1 and first["kernels_generated"] >= 1 and first["eager_fallbacks"] == 0

    ids3 = torch.randint(0, 500, (3, 16))
    with torch.no_grad():
        out3 = compiled(ids3).logits
        expected3 = model(ids3).logits
    torch.testing.assert_close(out3, expected3, atol=1e-4, rtol=1e-4)
    second = delta(start)
    assert second["kernel_builds"] == first["kernel_builds"], "a new batch size rebuilt kernels"
    assert second["graphs_compiled"] == first["graphs_compiled"], "a new batch size recompiled"


def test_gpt2_training_step_grads():
    ref = _gpt2(_transformers()).train()
    model = copy.deepcopy(ref)
    compiled = torch.compile(model, backend="torchfuse")
    ids = torch.randint(0, 500, (2, 16))
    start = snapshot()
    loss = compiled(ids, labels=ids).loss
    loss.backward()
    loss_ref = ref(ids, labels=ids).loss
    loss_ref.backward()
    d = delta(start)
    assert d["graphs_compiled"] >= 2 and d["eager_fallbacks"] == 0
    torch.testing.assert_close(loss, loss_ref, atol=1e-5, rtol=1e-5)
    compare_grads(model, ref)


def test_bert_inference_and_second_batch_size():
    model = _bert(_transformers()).eval()
    compiled = torch.compile(model, backend="torchfuse")
    inputs = _bert_inputs(2, 12)
    for v in inputs.values():
        torch._dynamo.mark_dynamic(v, 0)
    start = snapshot()
    with torch.no_grad():
        out = compiled(**inputs).logits
        expected = model(**inputs).logits
    torch.testing.assert_close(out, expected, atol=1e-4, rtol=1e-4)
    first = delta(start)
    assert first["graphs_compiled"] >= 1 and first["kernels_generated"] >= 1 and first["eager_fallbacks"] == 0

    inputs3 = _bert_inputs(3, 12)
    with torch.no_grad():
        out3 = compiled(**inputs3).logits
        expected3 = model(**inputs3).logits
    torch.testing.assert_close(out3, expected3, atol=1e-4, rtol=1e-4)
    second = delta(start)
    assert second["kernel_builds"] == first["kernel_builds"], "a new batch size rebuilt kernels"
    assert second["graphs_compiled"] == first["graphs_compiled"], "a new batch size recompiled"


def test_bert_training_step_grads():
    ref = _bert(_transformers()).train()
    model = copy.deepcopy(ref)
    compiled = torch.compile(model, backend="torchfuse")
    inputs = _bert_inputs(2, 12)
    labels = torch.tensor([0, 2])
    start = snapshot()
    out = compiled(**inputs, labels=labels)
    out.loss.backward()
    out_ref = ref(**inputs, labels=labels)
    out_ref.loss.backward()
    d = delta(start)
    assert d["graphs_compiled"] >= 2 and d["eager_fallbacks"] == 0
    torch.testing.assert_close(out.logits, out_ref.logits, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(out.loss, out_ref.loss, atol=1e-5, rtol=1e-5)
    compare_grads(model, ref)


def _moe(transformers, name: str):
    common = dict(vocab_size=64, hidden_size=32, intermediate_size=32, num_hidden_layers=1, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=64)
    if name == "mixtral":
        return transformers.MixtralForCausalLM(transformers.MixtralConfig(num_local_experts=4, num_experts_per_tok=2,
                                                                          **common))
    cfg = transformers.Qwen2MoeConfig(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                                      shared_expert_intermediate_size=16, **common)
    return transformers.Qwen2MoeForCausalLM(cfg)


@pytest.mark.parametrize("backend", ["cpp", "triton"])
@pytest.mark.parametrize("name", ["mixtral", "qwen2_moe"])
def test_moe_decoder_inference(name, backend):
    """Two MoE decoders (top-2 routing, two routing implementations) in strict mode: their
    routing stores int64 constants, which once made a Triton kernel that did not parse, and the
    graph ran eagerly (the Triton variant runs under Triton's interpreter)."""
    options = {"strict": True}
    if backend == "triton":
        pytest.importorskip("triton")
        options["cpu_backend"] = "triton"
    model = _moe(_transformers(), name).eval()
    compiled = torch.compile(model, backend="torchfuse", options=options)
    ids = torch.randint(0, 64, (2, 9))
    start = snapshot()
    with torch.no_grad():
        out = compiled(ids).logits
        expected = model(ids).logits
    torch.testing.assert_close(out, expected, atol=1e-4, rtol=1e-4)
    d = delta(start)
    assert d["graphs_compiled"] >= 1 and d["kernels_generated"] >= 1 and d["eager_fallbacks"] == 0


def _llama(transformers):
    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    cfg._attn_implementation = "sdpa"
    model = transformers.LlamaForCausalLM(cfg).eval()
    model.generation_config.eos_token_id = None       # decode exactly the tokens asked for
    model.generation_config.pad_token_id = 0
    return model


@pytest.mark.parametrize("backend", ["cpp", "triton"])
def test_generate_with_a_static_cache(backend):
    """transformers' `generate(cache_implementation="static")` with the forward compiled, as
    users decode: the same tokens as eager, no graph run eagerly, and the cache's keys and values
    written in place by generated kernels: no ATen call (index_copy_, a copy-back) takes a whole
    cache tensor, as eager's do, and the cache holds eager's values after the call."""
    transformers = _transformers()
    from torchfuse.config import Config
    from torchfuse.frontend.dynamo import TorchfuseBackend
    from torchfuse.report import Explanation
    options = {"strict": True, "first_calls": "wait"}
    if backend == "triton":
        pytest.importorskip("triton")
        options["cpu_backend"] = "triton"
    torch.manual_seed(0)
    model = _llama(transformers)
    ids = torch.randint(1, 128, (2, 7))

    def generate(n: int):
        kwargs = dict(max_new_tokens=n, min_new_tokens=n, do_sample=False, cache_implementation="static",
                      return_dict_in_generate=True)
        try:
            return model.generate(ids, attention_mask=torch.ones_like(ids), disable_compile=True, **kwargs)
        except (TypeError, ValueError):           # transformers without `disable_compile`
            return model.generate(ids, attention_mask=torch.ones_like(ids), **kwargs)

    def cache_tensors(cache) -> list[torch.Tensor]:
        if hasattr(cache, "layers"):                      # transformers 5
            return [t for layer in cache.layers for t in (layer.keys, layer.values)]
        return list(cache.key_cache) + list(cache.value_cache)

    def cache_writes_through_aten() -> int:
        """ATen calls during a 3-token generate whose first operand is a whole cache tensor."""
        from torch.profiler import ProfilerActivity, profile
        with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
            out = generate(3)
        shape = list(cache_tensors(out.past_key_values)[0].shape)
        return sum(1 for e in prof.events() if e.name in ("aten::index_copy_", "aten::index_put_", "aten::copy_",
                                                         "aten::_index_put_impl_", "aten::index_copy")
                   and e.input_shapes and list(e.input_shapes[0]) == shape)

    with torch.no_grad():
        expected = generate(5)
        eager_cache = [t.clone() for t in cache_tensors(expected.past_key_values)]
        assert cache_writes_through_aten() > 0        # eager writes the cache with index_copy_
        report = Explanation()
        torch._dynamo.reset()
        start = snapshot()
        model.forward = torch.compile(model.forward, backend=TorchfuseBackend(Config.from_options(options),
                                                                              report=report))
        got = generate(5)
        d = delta(start)
        assert cache_writes_through_aten() == 0
    assert torch.equal(got.sequences, expected.sequences)
    assert d["graphs_compiled"] == 2 and d["eager_fallbacks"] == 0, d       # prefill and one decode step
    fallback_ops = {f.op.split(".")[1] for f in report.fallbacks}
    assert not fallback_ops & {"index_copy", "index_copy_", "index_put", "index_put_", "copy_", "copy"}, \
        fallback_ops
    assert any("index_copy" in " ".join(k.nodes) for k in report.kernels), [k.name for k in report.kernels]
    for t, e in zip(cache_tensors(got.past_key_values), eager_cache):
        torch.testing.assert_close(t, e, atol=1e-5, rtol=1e-4)


# ------------------------------------------------------------------------------------------
# a small ResNet-style CNN
# ------------------------------------------------------------------------------------------

class Block(nn.Module):
    def __init__(self, c_in: int, c_out: int, stride: int):
        super().__init__()
        self.conv1 = nn.Conv2d(c_in, c_out, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(c_out)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(c_out)
        self.down = None
        if stride != 1 or c_in != c_out:
            self.down = nn.Sequential(nn.Conv2d(c_in, c_out, 1, stride, bias=False), nn.BatchNorm2d(c_out))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.relu(self.bn1(self.conv1(x)))
        h = self.bn2(self.conv2(h))
        return F.relu(h + (x if self.down is None else self.down(x)))


class TinyResNet(nn.Module):
    def __init__(self, classes: int = 10):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 8, 3, 1, 1, bias=False), nn.BatchNorm2d(8), nn.ReLU())
        self.layers = nn.Sequential(Block(8, 8, 1), Block(8, 16, 2))
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(16, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.flatten(self.pool(self.layers(self.stem(x))), 1))


def _resnet() -> TinyResNet:
    m = TinyResNet()
    with torch.no_grad():
        for mod in m.modules():
            if isinstance(mod, nn.BatchNorm2d):
                mod.weight.uniform_(0.5, 1.5)
                mod.bias.uniform_(-0.3, 0.3)
                mod.running_mean.uniform_(-0.3, 0.3)
                mod.running_var.uniform_(0.5, 1.5)
    return m


def test_resnet_eval():
    model = _resnet().eval()
    x = torch.randn(2, 3, 16, 16)
    start = snapshot()
    with torch.no_grad():
        out = torch.compile(model, backend="torchfuse")(x)
        expected = model(x)
    torch.testing.assert_close(out, expected, atol=1e-4, rtol=1e-4)
    d = delta(start)
    assert d["kernels_generated"] >= 1 and d["eager_fallbacks"] == 0


def test_resnet_train():
    ref = _resnet().train()
    model = copy.deepcopy(ref)
    compiled = torch.compile(model, backend="torchfuse")
    start = snapshot()
    for step in range(2):
        x = torch.randn(4, 3, 16, 16)
        target = torch.randint(0, 10, (4,))
        out, out_ref = compiled(x), ref(x)
        torch.testing.assert_close(out, out_ref, atol=1e-4, rtol=1e-4)
        F.cross_entropy(out, target).backward()
        F.cross_entropy(out_ref, target).backward()
    assert delta(start)["eager_fallbacks"] == 0
    compare_grads(model, ref, rtol=1e-3, atol=1e-5)
    ref_buffers = dict(ref.named_buffers())
    for name, b in model.named_buffers():
        torch.testing.assert_close(b, ref_buffers[name], atol=1e-5, rtol=1e-5, msg=lambda m: f"{name}: {m}")
