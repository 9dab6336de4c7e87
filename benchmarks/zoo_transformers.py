"""HuggingFace transformers models for the model zoo (see zoo_models.py), built from their
Config classes with random weights: nothing is downloaded.

Every model is wrapped in `HFOutput`, an nn.Module whose forward takes positional tensors and
returns one plain tensor (last_hidden_state or logits), so that eager, Inductor and torchfuse
all compile and compare the same thing.  Dropout probabilities are 0 (a training step is then
deterministic and comparable across backends) and attention runs through SDPA.

Each builder takes a size ("tiny", "cpu" or "gpu") and a device and returns the wrapped model
and its example inputs (fp32; zoo_models.ZooModel.make casts them).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn as nn


@dataclass(frozen=True)
class Dims:
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    ffn: int
    vocab: int
    batch: int
    seq: int


# tiny: a full eager forward + backward in milliseconds (CI); cpu: seconds to compile on 2 cores.
SMALL = {"tiny": Dims(32, 2, 4, 2, 64, 128, 2, 8), "cpu": Dims(128, 2, 4, 2, 512, 1000, 2, 64)}
BERT_BASE = Dims(768, 12, 12, 12, 3072, 30522, 8, 512)


def dims(size: str, gpu: Dims) -> Dims:
    return gpu if size == "gpu" else SMALL[size]


class HFOutput(nn.Module):
    """Positional tensors in (named `arg_names` for the wrapped model), one output field out."""

    def __init__(self, model: nn.Module, arg_names: tuple[str, ...], field: str, **call_kwargs: Any):
        super().__init__()
        self.model, self.arg_names, self.field, self.call_kwargs = model, arg_names, field, call_kwargs

    def forward(self, *args: torch.Tensor) -> torch.Tensor:
        out = self.model(**dict(zip(self.arg_names, args)), **self.call_kwargs)
        return getattr(out, self.field)


def _transformers():
    import transformers
    transformers.logging.set_verbosity_error()
    return transformers


def _model(cls_name: str, config: Any, device: torch.device | str, **init_kwargs: Any) -> nn.Module:
    # Built directly on the device: a billion random parameters initialise in a moment on a GPU.
    with torch.device(device):
        return getattr(_transformers(), cls_name)._from_config(config, attn_implementation="sdpa", **init_kwargs)


def _ids(d: Dims, device: torch.device | str, low: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    return torch.randint(low, d.vocab, (d.batch, d.seq), generator=g).to(device)


def _padding_mask(d: Dims, device: torch.device | str) -> torch.Tensor:
    """All ones except the last quarter of the first sequence: the padded path of the attention mask."""
    mask = torch.ones(d.batch, d.seq, dtype=torch.long)
    mask[0, d.seq - max(1, d.seq // 4):] = 0
    return mask.to(device)


def _pixels(batch: int, image: int, device: torch.device | str) -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    return torch.randn(batch, 3, image, image, generator=g).to(device)


Built = tuple[nn.Module, tuple[torch.Tensor, ...]]


# ----------------------------------------------------------------------------------------------
# vision transformers: (hidden, layers, heads, ffn, image, patch, batch) per size
# ----------------------------------------------------------------------------------------------
VIT = {"tiny": (32, 2, 4, 64, 32, 8, 2), "cpu": (128, 2, 4, 512, 64, 8, 2), "gpu": (768, 12, 12, 3072, 224, 16, 32)}
DEIT = {**VIT, "gpu": (384, 12, 6, 1536, 224, 16, 64)}   # DeiT-S/16


def _vit_like(cls_name: str, config_name: str, table: dict, size: str, device: torch.device | str) -> Built:
    hidden, layers, heads, ffn, image, patch, batch = table[size]
    cfg = getattr(_transformers(), config_name)(
        hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads, intermediate_size=ffn,
        image_size=image, patch_size=patch, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    model = _model(cls_name, cfg, device, add_pooling_layer=False)
    return HFOutput(model, ("pixel_values",), "last_hidden_state"), (_pixels(batch, image, device),)


def vit(size: str, device: torch.device | str) -> Built:
    return _vit_like("ViTModel", "ViTConfig", VIT, size, device)


def deit(size: str, device: torch.device | str) -> Built:
    return _vit_like("DeiTModel", "DeiTConfig", DEIT, size, device)


# embed dim, depths, heads, window, image, batch (gpu: swin-tiny)
SWIN = {"tiny": (16, (2, 2), (2, 2), 4, 32, 2), "cpu": (32, (2, 2, 2), (2, 4, 8), 4, 64, 2),
        "gpu": (96, (2, 2, 6, 2), (3, 6, 12, 24), 7, 224, 32)}


def swin(size: str, device: torch.device | str) -> Built:
    embed, depths, heads, window, image, batch = SWIN[size]
    cfg = _transformers().SwinConfig(image_size=image, patch_size=4, embed_dim=embed, depths=list(depths),
                                     num_heads=list(heads), window_size=window, drop_path_rate=0.0,
                                     hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    model = _model("SwinModel", cfg, device, add_pooling_layer=False)
    return HFOutput(model, ("pixel_values",), "last_hidden_state"), (_pixels(batch, image, device),)


# ----------------------------------------------------------------------------------------------
# encoders (padded attention masks)
# ----------------------------------------------------------------------------------------------
def _encoder(cls_name: str, cfg: Any, d: Dims, device: torch.device | str, low_id: int = 0,
             **init_kwargs: Any) -> Built:
    model = _model(cls_name, cfg, device, **init_kwargs)
    return (HFOutput(model, ("input_ids", "attention_mask"), "last_hidden_state"),
            (_ids(d, device, low_id), _padding_mask(d, device)))


def _bert_like_kwargs(d: Dims) -> dict[str, Any]:
    return dict(hidden_size=d.hidden, num_hidden_layers=d.layers, num_attention_heads=d.heads,
                intermediate_size=d.ffn, vocab_size=d.vocab, max_position_embeddings=max(512, d.seq + 2),
                hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)


def bert(size: str, device: torch.device | str) -> Built:
    d = dims(size, BERT_BASE)
    return _encoder("BertModel", _transformers().BertConfig(**_bert_like_kwargs(d)), d, device,
                    add_pooling_layer=False)


def roberta(size: str, device: torch.device | str) -> Built:
    d = dims(size, BERT_BASE)
    cfg = _transformers().RobertaConfig(**_bert_like_kwargs(d), pad_token_id=1)
    # ids from 2 up: RoBERTa derives position ids from which tokens are padding (id 1)
    return _encoder("RobertaModel", cfg, d, device, low_id=2, add_pooling_layer=False)


def albert(size: str, device: torch.device | str) -> Built:
    d = dims(size, BERT_BASE)   # albert-base: 128-wide embeddings projected to 768, one shared layer
    cfg = _transformers().AlbertConfig(**_bert_like_kwargs(d), embedding_size=128 if size == "gpu" else d.hidden // 2)
    return _encoder("AlbertModel", cfg, d, device, add_pooling_layer=False)


def electra(size: str, device: torch.device | str) -> Built:
    # electra-small discriminator on the GPU (embeddings narrower than the hidden size), batch 32
    d = dims(size, Dims(256, 12, 4, 4, 1024, 30522, 32, 512))
    cfg = _transformers().ElectraConfig(**_bert_like_kwargs(d), embedding_size=128 if size == "gpu" else d.hidden // 2)
    return _encoder("ElectraModel", cfg, d, device)


def distilbert(size: str, device: torch.device | str) -> Built:
    d = dims(size, Dims(768, 6, 12, 12, 3072, 30522, 8, 512))
    cfg = _transformers().DistilBertConfig(dim=d.hidden, n_layers=d.layers, n_heads=d.heads, hidden_dim=d.ffn,
                                           vocab_size=d.vocab, max_position_embeddings=max(512, d.seq),
                                           dropout=0.0, attention_dropout=0.0)
    return _encoder("DistilBertModel", cfg, d, device)


def t5(size: str, device: torch.device | str) -> Built:
    d = dims(size, Dims(768, 12, 12, 12, 3072, 32128, 8, 512))   # t5-base encoder
    cfg = _transformers().T5Config(d_model=d.hidden, d_kv=d.hidden // d.heads, d_ff=d.ffn, num_layers=d.layers,
                                   num_heads=d.heads, vocab_size=d.vocab, dropout_rate=0.0,
                                   feed_forward_proj="relu", use_cache=False)
    return _encoder("T5EncoderModel", cfg, d, device)


# ----------------------------------------------------------------------------------------------
# causal language models (logits; no KV cache)
# ----------------------------------------------------------------------------------------------
def _causal(cls_name: str, cfg: Any, d: Dims, device: torch.device | str) -> Built:
    cfg.use_cache = False
    model = _model(cls_name, cfg, device)
    return HFOutput(model, ("input_ids",), "logits", use_cache=False), (_ids(d, device),)


def _llama_like_kwargs(d: Dims) -> dict[str, Any]:
    return dict(hidden_size=d.hidden, intermediate_size=d.ffn, num_hidden_layers=d.layers,
                num_attention_heads=d.heads, num_key_value_heads=d.kv_heads, vocab_size=d.vocab,
                max_position_embeddings=max(2048, d.seq), attention_dropout=0.0)


def gpt2(size: str, device: torch.device | str) -> Built:
    d = dims(size, Dims(768, 12, 12, 12, 3072, 50257, 8, 512))
    cfg = _transformers().GPT2Config(n_embd=d.hidden, n_layer=d.layers, n_head=d.heads, n_inner=d.ffn,
                                     vocab_size=d.vocab, n_positions=max(1024, d.seq), resid_pdrop=0.0,
                                     embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    return _causal("GPT2LMHeadModel", cfg, d, device)


def gpt_neox(size: str, device: torch.device | str) -> Built:
    d = dims(size, Dims(1024, 24, 16, 16, 4096, 50304, 4, 1024))   # pythia-410m
    cfg = _transformers().GPTNeoXConfig(hidden_size=d.hidden, num_hidden_layers=d.layers, num_attention_heads=d.heads,
                                        intermediate_size=d.ffn, vocab_size=d.vocab, rotary_pct=0.25,
                                        max_position_embeddings=max(2048, d.seq), attention_dropout=0.0,
                                        hidden_dropout=0.0, bos_token_id=0, eos_token_id=0)
    return _causal("GPTNeoXForCausalLM", cfg, d, device)


def opt(size: str, device: torch.device | str) -> Built:
    d = dims(size, Dims(768, 12, 12, 12, 3072, 50272, 8, 512))   # opt-125m
    cfg = _transformers().OPTConfig(hidden_size=d.hidden, num_hidden_layers=d.layers, num_attention_heads=d.heads,
                                    ffn_dim=d.ffn, vocab_size=d.vocab, word_embed_proj_dim=d.hidden,
                                    max_position_embeddings=max(2048, d.seq), dropout=0.0, attention_dropout=0.0,
                                    activation_dropout=0.0, layerdrop=0.0, pad_token_id=1, bos_token_id=2,
                                    eos_token_id=2)
    return _causal("OPTForCausalLM", cfg, d, device)


def llama(size: str, device: torch.device | str) -> Built:
    d = dims(size, Dims(2048, 22, 32, 4, 5632, 32000, 4, 1024))   # TinyLlama-1.1B: GQA 32 / 4
    return _causal("LlamaForCausalLM", _transformers().LlamaConfig(**_llama_like_kwargs(d)), d, device)


def mistral(size: str, device: torch.device | str) -> Built:
    # Mistral-7B's layer shapes (GQA 32 / 8, SwiGLU 14336) with 8 of its 32 layers.  The sliding
    # window is half the sequence so that the windowed causal mask is exercised.
    d = dims(size, Dims(4096, 8, 32, 8, 14336, 32000, 2, 2048))
    cfg = _transformers().MistralConfig(**_llama_like_kwargs(d), sliding_window=d.seq // 2)
    return _causal("MistralForCausalLM", cfg, d, device)


def qwen2(size: str, device: torch.device | str) -> Built:
    d = dims(size, Dims(896, 24, 14, 2, 4864, 151936, 4, 1024))   # Qwen2-0.5B: q/k/v biases, tied embeddings
    cfg = _transformers().Qwen2Config(**_llama_like_kwargs(d), tie_word_embeddings=True)
    return _causal("Qwen2ForCausalLM", cfg, d, device)


def gemma(size: str, device: torch.device | str) -> Built:
    # gemma-2b: multi-query attention, head_dim 256, GELU-tanh gating, a 256k vocabulary
    d = dims(size, Dims(2048, 18, 8, 1, 16384, 256000, 2, 1024))
    cfg = _transformers().GemmaConfig(**_llama_like_kwargs(d), head_dim=256 if size == "gpu" else d.hidden // d.heads,
                                      hidden_activation="gelu_pytorch_tanh")
    return _causal("GemmaForCausalLM", cfg, d, device)


def phi(size: str, device: torch.device | str) -> Built:
    # phi-1.5: parallel attention and MLP off one LayerNorm, rotary on half of each head
    d = dims(size, Dims(2048, 24, 32, 32, 8192, 51200, 4, 1024))
    cfg = _transformers().PhiConfig(hidden_size=d.hidden, intermediate_size=d.ffn, num_hidden_layers=d.layers,
                                    num_attention_heads=d.heads, vocab_size=d.vocab, partial_rotary_factor=0.5,
                                    max_position_embeddings=max(2048, d.seq), resid_pdrop=0.0, embd_pdrop=0.0,
                                    attention_dropout=0.0)
    return _causal("PhiForCausalLM", cfg, d, device)


BUILDERS: dict[str, tuple[str, Callable[[str, torch.device | str], Built]]] = {
    # name: (family, builder)
    "vit": ("vit", vit), "deit": ("vit", deit), "swin": ("vit", swin),
    "bert": ("encoder", bert), "albert": ("encoder", albert), "electra": ("encoder", electra),
    "distilbert": ("encoder", distilbert), "roberta": ("encoder", roberta),
    "t5": ("t5", t5),
    "gpt2": ("decoder", gpt2), "gpt_neox": ("decoder", gpt_neox), "opt": ("decoder", opt), "llama": ("decoder", llama),
    "mistral": ("decoder", mistral), "qwen2": ("decoder", qwen2), "gemma": ("decoder", gemma), "phi": ("decoder", phi),
}
