"""The libraries' own models for the zoo: timm, torchvision, torchaudio, transformers and
torch_geometric, built by the libraries themselves with random weights (nothing downloaded) and
called as their users call them (NCHW images, positional tensors), each at three sizes:

  "tiny"  CI (tests/models/test_library_zoo.py): a shallower model where the library takes depth
          arguments, 64 pixel images, batch 4
  "cpu"   the library's architecture at a small resolution and batch (benchmarks/zoo.py --device cpu)
  "gpu"   the architecture at its usual resolution and a batch for one H100 (32 images, 8x512 tokens)

    python benchmarks/zoo.py --zoo library --device cpu --only timm_resnet50 --infer
    from zoo_library import LIBRARY_MODELS, LIBRARY_BY_NAME

A library that is not installed drops its rows (`missing()` says which and why).  On a CPU-only
torch, PyPI's torchvision and torchaudio wheels are CUDA builds whose C++ ops do not load;
`import_torchvision` / `import_torchaudio` then register what their Python code needs so that
the model code (which never calls those ops, detection's NMS aside) imports and runs.
torch_geometric is only looked up here, and imported when a graph model is built: importing it
patches torch.index_select for the whole process (tests/models/test_library_zoo.py runs its
models in a child process).
"""
from __future__ import annotations

import functools
import importlib.util
import sys
import types
from typing import Any, Callable

import torch
import torch.nn as nn

import zoo_transformers as hf
from zoo_models import Builder, Inputs, ZooModel, class_loss, lm_loss, pixel_loss

_MISSING: dict[str, str] = {}


def missing() -> dict[str, str]:
    """Libraries whose rows are left out: name -> why."""
    return dict(_MISSING)


def _nms_cpu(boxes: torch.Tensor, scores: torch.Tensor, iou_threshold: float) -> torch.Tensor:
    """Greedy non-maximum suppression (torchvision::nms's semantics), for a CPU-only torch whose
    torchvision C++ ops did not load."""
    order = scores.argsort(descending=True)
    boxes = boxes[order]
    x1, y1, x2, y2 = boxes.unbind(1)
    area = (x2 - x1).clamp(min=0) * (y2 - y1).clamp(min=0)
    alive = torch.ones(len(order), dtype=torch.bool)
    for i in range(len(order)):
        if not alive[i]:
            continue
        w = (torch.minimum(x2[i], x2) - torch.maximum(x1[i], x1)).clamp(min=0)
        h = (torch.minimum(y2[i], y2) - torch.maximum(y1[i], y1)).clamp(min=0)
        inter = w * h
        iou = inter / (area[i] + area - inter)
        suppress = iou > iou_threshold
        suppress[: i + 1] = False
        alive &= ~suppress
    return order[alive]


_SHIM_LIBS: list[Any] = []   # torch.library handles: the registrations last while they live


@functools.cache
def import_torchvision() -> types.ModuleType:
    try:
        import torchvision
        return torchvision
    except RuntimeError as e:   # "operator torchvision::nms does not exist": a CUDA build on a CPU torch
        if "torchvision::" not in str(e):
            raise
    for name in [n for n in sys.modules if n == "torchvision" or n.startswith("torchvision.")]:
        del sys.modules[name]
    lib = torch.library.Library("torchvision", "DEF")
    for op in ("nms", "qnms"):
        lib.define(f"{op}(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
    lib.impl("nms", _nms_cpu, "CPU")
    _SHIM_LIBS.append(lib)
    import torchvision
    import torchvision.ops.boxes
    torchvision.ops.boxes._assert_has_ops = lambda: None   # nms: the CPU kernel above
    return torchvision


@functools.cache
def import_torchaudio() -> types.ModuleType:
    try:
        import torchaudio
        return torchaudio
    except OSError:   # its extension is a CUDA build: the models are plain PyTorch, run without it
        pass
    for name in [n for n in sys.modules if n == "torchaudio" or n.startswith("torchaudio.")]:
        del sys.modules[name]
    stub = types.ModuleType("torchaudio._extension")
    stub._IS_TORCHAUDIO_EXT_AVAILABLE = False
    stub._IS_ALIGN_AVAILABLE = False
    stub.fail_if_no_align = lambda f: f
    stub._load_lib = lambda lib: False
    sys.modules["torchaudio._extension"] = stub
    import torchaudio
    return torchaudio


def _timm() -> types.ModuleType:
    import_torchvision()   # timm imports torchvision
    import timm
    return timm


# ----------------------------------------------------------------------------------------------
# wrappers: one or a few plain tensors out
# ----------------------------------------------------------------------------------------------
class Select(nn.Module):
    """Calls `model` with the positional inputs (and fixed keyword arguments) and returns
    `pick(output)`: the segmentation map of a dict, the last flow of RAFT's list, ..."""

    def __init__(self, model: nn.Module, pick: Callable[[Any], Any], **kwargs: Any):
        super().__init__()
        self.model, self.pick, self.kwargs = model, pick, kwargs

    def forward(self, *args: torch.Tensor) -> Any:
        return self.pick(self.model(*args, **self.kwargs))


class Detection(nn.Module):
    """A torchvision detector called as users call it (a list of images), returning its first
    image's boxes and scores."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, images: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        out = self.model(list(images.unbind(0)))[0]
        # Detections of equal score (many, in fp32) come in either order, a rounding apart:
        # ordered by their left edges, then top edges, the same detections compare row by row.
        boxes, scores = out["boxes"], out["scores"]
        by_top = boxes[:, 1].argsort(stable=True)
        order = by_top[boxes[by_top, 0].argsort(stable=True)]
        return boxes[order], scores[order]


def projection_weights(numel: int, device: torch.device | str) -> torch.Tensor:
    """`numel` fixed weights in [-3, 3), fp32, spread evenly by a multiplicative hash of the
    position: as many distinct values as fp32 gives, no period.  Weights of a few distinct values
    (the earlier `arange % 7 - 3`) make a few distinct gradient values, and the rounding of sums
    of a few distinct values is biased, not random: a layer norm's bias gradient (the gradient's
    sum over 16000 rows in 5120 partial sums) then gathered every partial sum's rounding in one
    direction, 7e-11 off where continuous values are 3e-12 off, and which order of additions
    happens to be lucky decided the accuracy check (Conformer's last norm: eager 2e-12, torchfuse
    9e-11, Inductor 2e-11)."""
    index = torch.arange(numel, device=device, dtype=torch.int64)
    return ((index * 2654435761) % 4294967296).to(torch.float32) * (6 / 4294967296) - 3


def projection_loss(out: Any, inputs: Inputs) -> torch.Tensor:
    """A scalar whose gradient reaches every output value: the outputs' sum weighted by fixed
    weights (projection_weights; the mean or sum of a normalised output is constant; this is not)."""
    from torchfuse.tools.accuracy import flatten
    total = 0.0
    for t in flatten(out):
        if t.is_floating_point():
            x = t.double() if t.dtype == torch.float64 else t.float()
            total = total + x.mul(projection_weights(t.numel(), t.device).to(x.dtype).reshape(t.shape)).mean()
    return total


# ----------------------------------------------------------------------------------------------
# images: (kwargs, batch, resolution) per size
# ----------------------------------------------------------------------------------------------
Spec = dict[str, tuple[dict[str, Any], int, int]]
CLASSES = {"tiny": 10, "cpu": 100, "gpu": 1000}


def image_spec(tiny: dict[str, Any] | None = None, res: tuple[int, int, int] = (64, 64, 224),
               batch: tuple[int, int, int] = (4, 4, 32), cpu: dict[str, Any] | None = None) -> Spec:
    # Small sizes keep the last feature maps at 2x2 or more and the batch at 4, as zoo_models.py
    # does: at 32 pixels and batch 2 a random ResNet's logits are rounding noise (eager bf16 120%
    # off the fp32 reference, fp32 3e-4 off fp64), and nothing can be judged against them.
    return {"tiny": (tiny or {}, batch[0], res[0]), "cpu": (cpu or {}, batch[1], res[1]), "gpu": ({}, batch[2], res[2])}


def _pixels(batch: int, res: int, device: torch.device | str, channels: int = 3) -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    return torch.randn(batch, channels, res, res, generator=g).to(device)


def timm_builder(arch: str, spec: Spec, res_kwarg: bool = False) -> Builder:
    def build(size: str, device: torch.device | str) -> tuple[nn.Module, Inputs]:
        kwargs, batch, res = spec[size]
        if res_kwarg:
            kwargs = {"img_size": res, **kwargs}
        with torch.device(device):
            model = _timm().create_model(arch, pretrained=False, num_classes=CLASSES[size], **kwargs)
        return model, (_pixels(batch, res, device),)
    return build


def tv_builder(factory: str, spec: Spec, pick: Callable[[Any], Any] | None = None, **fixed: Any) -> Builder:
    """torchvision.models.<factory>(weights=None, ...), its output through `pick`."""
    def build(size: str, device: torch.device | str) -> tuple[nn.Module, Inputs]:
        kwargs, batch, res = spec[size]
        tv = import_torchvision()
        fn = functools.reduce(getattr, factory.split("."), tv.models)
        if pick is None:   # a classifier
            kwargs = {"num_classes": CLASSES[size], **kwargs}
        with torch.device(device):
            model = fn(weights=None, **fixed, **kwargs)
        if pick is not None:
            model = Select(model, pick)
        return model, (_pixels(batch, res, device),)
    return build


def _seg_out(out: dict[str, torch.Tensor]) -> torch.Tensor:
    return out["out"]


def _last(out: list[torch.Tensor]) -> torch.Tensor:
    return out[-1]


def raft_builder(size: str, device: torch.device | str) -> tuple[nn.Module, Inputs]:
    batch, res, updates = {"tiny": (1, 128, 2), "cpu": (1, 128, 6), "gpu": (8, 368, 6)}[size]
    tv = import_torchvision()
    with torch.device(device):
        model = tv.models.optical_flow.raft_small(weights=None)
    g = torch.Generator().manual_seed(1)
    frames = [torch.randn(batch, 3, res, res + 128 * (size == "gpu"), generator=g).to(device) for _ in range(2)]
    return Select(model, _last, num_flow_updates=updates), tuple(frames)


def detection_builder(factory: str) -> Builder:
    def build(size: str, device: torch.device | str) -> tuple[nn.Module, Inputs]:
        batch, res = {"tiny": (1, 64), "cpu": (1, 128), "gpu": (4, 320)}[size]
        tv = import_torchvision()
        with torch.device(device):
            model = getattr(tv.models.detection, factory)(weights=None, weights_backbone=None, num_classes=CLASSES[size])
        with torch.no_grad():
            # At random weights every class scores below the detector's 0.05 threshold: no boxes,
            # nothing to compare.  A classifier that favours one class yields up to 100.
            model.roi_heads.box_predictor.cls_score.bias[1] += 8.0
        g = torch.Generator().manual_seed(1)
        return Detection(model), (torch.rand(batch, 3, res, res, generator=g).to(device),)
    return build


# ----------------------------------------------------------------------------------------------
# audio (torchaudio) and graphs (torch_geometric)
# ----------------------------------------------------------------------------------------------
def wav2vec2_builder(size: str, device: torch.device | str) -> tuple[nn.Module, Inputs]:
    batch, samples, layers = {"tiny": (2, 4000, 2), "cpu": (2, 16000, 12), "gpu": (8, 16000 * 10, 12)}[size]
    ta = import_torchaudio()
    with torch.device(device):
        model = ta.models.wav2vec2_model(
            extractor_mode="group_norm", extractor_conv_layer_config=None, extractor_conv_bias=False,
            encoder_embed_dim=768, encoder_projection_dropout=0.0, encoder_pos_conv_kernel=128,
            encoder_pos_conv_groups=16, encoder_num_layers=layers, encoder_num_heads=12,
            encoder_attention_dropout=0.0, encoder_ff_interm_features=3072, encoder_ff_interm_dropout=0.0,
            encoder_dropout=0.0, encoder_layer_norm_first=False, encoder_layer_drop=0.0, aux_num_out=None)
    g = torch.Generator().manual_seed(1)
    return Select(model, lambda out: out[0]), (torch.randn(batch, samples, generator=g).to(device),)


def conformer_builder(size: str, device: torch.device | str) -> tuple[nn.Module, Inputs]:
    # dim, heads, ffn, layers, batch, frames
    dim, heads, ffn, layers, batch, frames = {"tiny": (32, 2, 64, 2, 2, 20), "cpu": (144, 4, 576, 4, 2, 200),
                                              "gpu": (256, 4, 1024, 16, 16, 1000)}[size]
    ta = import_torchaudio()
    with torch.device(device):
        model = ta.models.Conformer(input_dim=dim, num_heads=heads, ffn_dim=ffn, num_layers=layers,
                                    depthwise_conv_kernel_size=31, dropout=0.0)
    g = torch.Generator().manual_seed(1)
    lengths = torch.full((batch,), frames, dtype=torch.long)
    lengths[0] = frames - frames // 4   # a padded sequence: the attention mask's other path
    return Select(model, lambda out: out[0]), (torch.randn(batch, frames, dim, generator=g).to(device),
                                               lengths.to(device))


def gnn_builder(cls: str, **extra: Any) -> Builder:
    def build(size: str, device: torch.device | str) -> tuple[nn.Module, Inputs]:
        # nodes, edges, features, hidden, layers, classes
        n, e, f, h, layers, c = {"tiny": (50, 200, 16, 32, 2, 7), "cpu": (2000, 10000, 128, 128, 3, 40),
                                 "gpu": (100000, 1000000, 128, 256, 3, 47)}[size]
        from torch_geometric.nn import models as pyg
        with torch.device(device):
            model = getattr(pyg, cls)(in_channels=f, hidden_channels=h, num_layers=layers, out_channels=c,
                                      dropout=0.0, **extra)
        g = torch.Generator().manual_seed(1)
        x = torch.randn(n, f, generator=g)
        edges = torch.randint(0, n, (2, e), generator=g)
        return model, (x.to(device), edges.to(device))
    return build


# ----------------------------------------------------------------------------------------------
# transformers beyond zoo_transformers.py: encoder-decoders, speech, mixture of experts
# ----------------------------------------------------------------------------------------------
def bart(size: str, device: torch.device | str) -> tuple[nn.Module, Inputs]:
    d = hf.dims(size, hf.Dims(768, 6, 12, 12, 3072, 50265, 8, 512))   # bart-base
    cfg = hf._transformers().BartConfig(
        d_model=d.hidden, encoder_layers=d.layers, decoder_layers=d.layers, encoder_attention_heads=d.heads,
        decoder_attention_heads=d.heads, encoder_ffn_dim=d.ffn, decoder_ffn_dim=d.ffn, vocab_size=d.vocab,
        max_position_embeddings=max(1024, d.seq), dropout=0.0, attention_dropout=0.0, activation_dropout=0.0,
        use_cache=False)
    model = hf._model("BartModel", cfg, device)
    return hf.HFOutput(model, ("input_ids", "attention_mask"), "last_hidden_state", use_cache=False), \
        (hf._ids(d, device, 3), hf._padding_mask(d, device))


def whisper(size: str, device: torch.device | str) -> tuple[nn.Module, Inputs]:
    # whisper-tiny on the GPU: 30 s of 80 log-mel bins (3000 frames), 4 layers of 384
    hidden, layers, heads, frames, batch, dec = {"tiny": (32, 1, 2, 64, 2, 8), "cpu": (384, 2, 6, 600, 2, 32),
                                                 "gpu": (384, 4, 6, 3000, 16, 128)}[size]
    cfg = hf._transformers().WhisperConfig(
        d_model=hidden, encoder_layers=layers, decoder_layers=layers, encoder_attention_heads=heads,
        decoder_attention_heads=heads, encoder_ffn_dim=4 * hidden, decoder_ffn_dim=4 * hidden,
        max_source_positions=frames // 2, num_mel_bins=80, vocab_size=51865, dropout=0.0, attention_dropout=0.0,
        activation_dropout=0.0, use_cache=False)
    model = hf._model("WhisperModel", cfg, device)
    g = torch.Generator().manual_seed(1)
    feats = torch.randn(batch, 80, frames, generator=g).to(device)
    ids = torch.randint(0, 51865, (batch, dec), generator=g).to(device)
    return hf.HFOutput(model, ("input_features", "decoder_input_ids"), "last_hidden_state", use_cache=False), \
        (feats, ids)


def _moe(cls_name: str, config_name: str, gpu: hf.Dims, experts: int, top_k: int, **extra: Any) -> Builder:
    def build(size: str, device: torch.device | str) -> tuple[nn.Module, Inputs]:
        d = hf.dims(size, gpu)
        cfg = getattr(hf._transformers(), config_name)(**hf._llama_like_kwargs(d), num_experts_per_tok=top_k,
                                                       **{k: v(d) if callable(v) else v for k, v in extra.items()})
        if hasattr(cfg, "num_local_experts"):
            cfg.num_local_experts = experts
        else:
            cfg.num_experts = experts
        return hf._causal(cls_name, cfg, d, device)
    return build


# ----------------------------------------------------------------------------------------------
# the rows
# ----------------------------------------------------------------------------------------------
_CNN = image_spec()
_RES = dict(tiny=dict(layers=[1, 1, 1, 1]))
_VIT_TINY = dict(depth=2, embed_dim=64, num_heads=2)

# name: (library, family, builder, trainable, loss)
_ROWS: dict[str, tuple[str, str, Builder, bool, Callable]] = {
    # timm: classification, NCHW
    "timm_resnet50": ("timm", "resnet", timm_builder("resnet50", image_spec(**_RES)), True, class_loss),
    "timm_resnet18": ("timm", "resnet", timm_builder("resnet18", image_spec(**_RES)), False, class_loss),
    "timm_resnext50_32x4d": ("timm", "grouped", timm_builder("resnext50_32x4d", image_spec(**_RES)), True, class_loss),
    "timm_seresnext26d_32x4d": ("timm", "grouped", timm_builder("seresnext26d_32x4d", image_spec(**_RES)), False,
                                class_loss),
    "timm_efficientnet_b0": ("timm", "mobile", timm_builder("efficientnet_b0", _CNN), True, class_loss),
    "timm_mobilenetv3_large_100": ("timm", "mobile", timm_builder("mobilenetv3_large_100", _CNN), True, class_loss),
    "timm_mobilevitv2_100": ("timm", "mobile", timm_builder("mobilevitv2_100", image_spec(res=(64, 64, 256))), True,
                             class_loss),
    "timm_ghostnet_100": ("timm", "mobile", timm_builder("ghostnet_100", _CNN), False, class_loss),
    "timm_convnext_tiny": ("timm", "convnext", timm_builder("convnext_tiny", image_spec(
        tiny=dict(depths=(1, 1, 1, 1), dims=(16, 32, 64, 128)))), True, class_loss),
    "timm_convnextv2_nano": ("timm", "convnext", timm_builder("convnextv2_nano", _CNN), False, class_loss),
    "timm_regnety_016": ("timm", "regnet", timm_builder("regnety_016", _CNN), True, class_loss),
    "timm_regnetx_016": ("timm", "regnet", timm_builder("regnetx_016", _CNN), False, class_loss),
    "timm_inception_v3": ("timm", "concat", timm_builder("inception_v3", image_spec(res=(107, 107, 299))), True,
                          class_loss),
    "timm_densenet121": ("timm", "concat", timm_builder("densenet121", _CNN), False, class_loss),
    "timm_dla34": ("timm", "concat", timm_builder("dla34", _CNN), False, class_loss),
    "timm_swin_tiny_patch4_window7_224": ("timm", "vit", timm_builder(
        "swin_tiny_patch4_window7_224", image_spec(tiny=dict(depths=(1, 1, 1, 1), window_size=4),
                                                   cpu=dict(window_size=4)), res_kwarg=True), True, class_loss),
    "timm_vit_small_patch16_224": ("timm", "vit", timm_builder("vit_small_patch16_224", image_spec(tiny=_VIT_TINY),
                                                               res_kwarg=True), True, class_loss),
    "timm_deit_tiny_patch16_224": ("timm", "vit", timm_builder("deit_tiny_patch16_224", image_spec(tiny=_VIT_TINY),
                                                               res_kwarg=True), False, class_loss),
    "timm_beit_base_patch16_224": ("timm", "vit", timm_builder("beit_base_patch16_224", image_spec(tiny=_VIT_TINY),
                                                               res_kwarg=True), False, class_loss),
    "timm_mixer_b16_224": ("timm", "mixer", timm_builder("mixer_b16_224", _CNN, res_kwarg=True), True, class_loss),
    "timm_levit_128": ("timm", "vit", timm_builder("levit_128", image_spec(res=(224, 224, 224), batch=(1, 2, 64)),
                                                   res_kwarg=True), False, class_loss),
    "timm_repvgg_a2": ("timm", "resnet", timm_builder("repvgg_a2", _CNN), False, class_loss),
    "timm_coat_lite_mini": ("timm", "vit", timm_builder("coat_lite_mini", image_spec(res=(64, 64, 224)),
                                                        res_kwarg=True), False, class_loss),
    # torchvision: classification, segmentation, optical flow, detection
    "tv_resnet18": ("torchvision", "resnet", tv_builder("resnet18", _CNN), True, class_loss),
    "tv_resnet50": ("torchvision", "resnet", tv_builder("resnet50", _CNN), False, class_loss),
    "tv_wide_resnet50_2": ("torchvision", "resnet", tv_builder("wide_resnet50_2", _CNN), False, class_loss),
    "tv_mobilenet_v2": ("torchvision", "mobile", tv_builder("mobilenet_v2", _CNN), True, class_loss),
    "tv_mobilenet_v3_large": ("torchvision", "mobile", tv_builder("mobilenet_v3_large", _CNN), False, class_loss),
    "tv_shufflenet_v2_x1_0": ("torchvision", "mobile", tv_builder("shufflenet_v2_x1_0", _CNN), False, class_loss),
    "tv_squeezenet1_1": ("torchvision", "concat", tv_builder("squeezenet1_1", _CNN), False, class_loss),
    "tv_densenet121": ("torchvision", "concat", tv_builder("densenet121", _CNN), True, class_loss),
    "tv_googlenet": ("torchvision", "concat", tv_builder("googlenet", _CNN, aux_logits=False, init_weights=True),
                     False, class_loss),
    "tv_efficientnet_v2_s": ("torchvision", "mobile", tv_builder("efficientnet_v2_s", _CNN), False, class_loss),
    "tv_regnet_y_1_6gf": ("torchvision", "regnet", tv_builder("regnet_y_1_6gf", _CNN), False, class_loss),
    "tv_convnext_tiny": ("torchvision", "convnext", tv_builder("convnext_tiny", _CNN), False, class_loss),
    "tv_vit_b_16": ("torchvision", "vit", tv_builder("vit_b_16", image_spec(res=(224, 224, 224), batch=(2, 2, 32))),
                    False, class_loss),
    "tv_swin_t": ("torchvision", "vit", tv_builder("swin_t", _CNN), False, class_loss),
    "tv_fcn_resnet50": ("torchvision", "segmentation", tv_builder(
        "segmentation.fcn_resnet50", image_spec(batch=(2, 2, 8), res=(64, 96, 512)), _seg_out, num_classes=21, weights_backbone=None,
        aux_loss=False), False, pixel_loss),
    "tv_deeplabv3_mobilenet_v3_large": ("torchvision", "segmentation", tv_builder(
        "segmentation.deeplabv3_mobilenet_v3_large", image_spec(res=(64, 64, 512), batch=(2, 2, 8)), _seg_out,
        num_classes=21, weights_backbone=None, aux_loss=False), True, pixel_loss),
    "tv_lraspp_mobilenet_v3_large": ("torchvision", "segmentation", tv_builder(
        "segmentation.lraspp_mobilenet_v3_large", image_spec(res=(64, 64, 512), batch=(2, 2, 8)), _seg_out,
        num_classes=21, weights_backbone=None), False, pixel_loss),
    "tv_raft_small": ("torchvision", "flow", raft_builder, False, projection_loss),
    "tv_fasterrcnn_mobilenet_v3_large_320_fpn": ("torchvision", "detection",
                                                 detection_builder("fasterrcnn_mobilenet_v3_large_320_fpn"), False,
                                                 projection_loss),
    # torchaudio
    "ta_wav2vec2_base": ("torchaudio", "audio", wav2vec2_builder, True, projection_loss),
    "ta_conformer": ("torchaudio", "audio", conformer_builder, True, projection_loss),
    # torch_geometric
    "pyg_gcn": ("torch_geometric", "graph", gnn_builder("GCN"), True, class_loss),
    "pyg_gat": ("torch_geometric", "graph", gnn_builder("GAT", heads=4), True, class_loss),
    "pyg_graphsage": ("torch_geometric", "graph", gnn_builder("GraphSAGE"), True, class_loss),
    "pyg_gin": ("torch_geometric", "graph", gnn_builder("GIN"), True, class_loss),
    # transformers: new architectures
    "hf_bart": ("transformers", "t5", bart, True, class_loss),
    "hf_whisper_tiny": ("transformers", "audio", whisper, False, class_loss),
    "hf_mixtral": ("transformers", "moe", _moe("MixtralForCausalLM", "MixtralConfig",
                                                hf.Dims(1024, 8, 16, 4, 2816, 32000, 4, 1024), 8, 2), True, lm_loss),
    "hf_qwen2_moe": ("transformers", "moe", _moe("Qwen2MoeForCausalLM", "Qwen2MoeConfig",
                                                  hf.Dims(1024, 8, 16, 4, 2816, 32000, 4, 1024), 8, 2,
                                                  moe_intermediate_size=lambda d: d.ffn // 2,
                                                  shared_expert_intermediate_size=lambda d: d.ffn), False, lm_loss),
}
# transformers: every model of zoo_transformers.py (already the library's own classes)
_HF_TRAINABLE = {"vit", "swin", "bert", "distilbert", "t5", "gpt2", "opt", "llama", "qwen2"}
for _name, (_family, _build) in hf.BUILDERS.items():
    _ROWS[f"hf_{_name}"] = ("transformers", _family, _build, _name in _HF_TRAINABLE,
                            lm_loss if _family == "decoder" else class_loss)

LIBRARY_FAMILIES = tuple(dict.fromkeys(family for _, family, *_ in _ROWS.values()))


def _find_torch_geometric() -> None:
    """Only looks torch_geometric up (gnn_builder imports it): importing it replaces
    torch.index_select with a Python wrapper for the whole process (torch_geometric/hash_tensor.py),
    which rejects 0-d inputs and which AOTAutograd's cache refuses, so importing this module (as
    the tests do when they are collected) must not change what every other program runs."""
    if importlib.util.find_spec("torch_geometric") is None:
        raise ModuleNotFoundError("No module named 'torch_geometric'")


_IMPORTS: dict[str, Callable[[], Any]] = {
    "timm": _timm, "torchvision": import_torchvision, "torchaudio": import_torchaudio,
    "transformers": hf._transformers, "torch_geometric": _find_torch_geometric,
}


def _available(library: str) -> bool:
    if library not in _MISSING:
        try:
            _IMPORTS[library]()
        except Exception as e:   # not installed, or installed for another torch
            _MISSING[library] = f"{type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''}"
            return False
        _MISSING.setdefault(library, "")
    return not _MISSING[library]


def library_of(name: str) -> str:
    return _ROWS[name][0]


ALL_NAMES = tuple(_ROWS)
# eager itself fails in bf16: RAFT mixes in an fp32 coordinate grid, torchvision's NMS has no bf16 kernel
_FP32_ONLY = {"tv_raft_small", "tv_fasterrcnn_mobilenet_v3_large_320_fpn"}
LIBRARY_MODELS: list[ZooModel] = [ZooModel(name, family, build, trainable, loss, bf16=name not in _FP32_ONLY)
                                  for name, (lib, family, build, trainable, loss) in _ROWS.items() if _available(lib)]
LIBRARY_BY_NAME: dict[str, ZooModel] = {m.name: m for m in LIBRARY_MODELS}
