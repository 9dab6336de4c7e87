"""The model zoo: realistic models with random weights, built from code and configs (nothing
downloaded), each at three sizes:

  "tiny"  a full eager forward + backward in well under a second (CI tests, tests/models/test_zoo.py)
  "cpu"   compiles and runs in seconds on 2 CPU cores (benchmarks/zoo.py --device cpu)
  "gpu"   the realistic configuration and batch for one H100 (ResNet-50 at 64x3x224x224, BERT-base
          at 8x512, ...); CNN weights and inputs in channels-last

    from zoo_models import MODELS, BY_NAME
    model, inputs = BY_NAME["resnet50"].make("cpu", "cpu", torch.float32)   # eval mode
    loss = BY_NAME["resnet50"].loss(model.train()(*inputs), inputs)

CNNs, the recurrent nets and the MLP-Mixer are written by hand in zoo_cnn.py; the transformer
families are HuggingFace model classes (zoo_transformers.py).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

import zoo_cnn as cnn
import zoo_transformers as hf

SIZES = ("tiny", "cpu", "gpu")
FAMILIES = ("resnet", "grouped", "concat", "mobile", "regnet", "convnext", "vit", "encoder", "t5", "decoder",
            "rnn", "unet", "mixer")
Inputs = tuple[torch.Tensor, ...]
Builder = Callable[[str, "torch.device | str"], tuple[nn.Module, Inputs]]
Loss = Callable[[torch.Tensor, Inputs], torch.Tensor]


# ----------------------------------------------------------------------------------------------
# losses: a scalar from the model's output (and inputs), computed eagerly after the compiled model
# ----------------------------------------------------------------------------------------------
def _upcast(x: torch.Tensor) -> torch.Tensor:
    """fp32 for the loss of a bf16 or fp32 output; fp64 stays fp64 (zoo.py's fp64 references)."""
    return x if x.dtype == torch.float64 else x.float()


def _targets(rows: int, classes: int, device: torch.device) -> torch.Tensor:
    """Deterministic, well-spread class indices (no random state: every backend gets the same)."""
    return torch.arange(rows, device=device) * 7 % classes


def class_loss(out: torch.Tensor, inputs: Inputs) -> torch.Tensor:
    """Cross-entropy over the last dimension: class logits, or the features of an encoder's last
    hidden state (the mean or mean square of a layer-normed output is constant, so its gradient
    would vanish; cross-entropy over the features is not)."""
    flat = _upcast(out.flatten(0, -2))
    return F.cross_entropy(flat, _targets(flat.shape[0], flat.shape[1], out.device))


def pixel_loss(out: torch.Tensor, inputs: Inputs) -> torch.Tensor:
    """Per-pixel cross-entropy over the channels of [N, C, H, W] segmentation logits."""
    return class_loss(out.movedim(1, -1), inputs)


def lm_loss(out: torch.Tensor, inputs: Inputs) -> torch.Tensor:
    """Next-token cross-entropy of [B, S, V] logits against the input ids."""
    ids = inputs[0]
    return F.cross_entropy(_upcast(out[:, :-1].flatten(0, 1)), ids[:, 1:].flatten())


# ----------------------------------------------------------------------------------------------
# ZooModel
# ----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ZooModel:
    name: str
    family: str
    builder: Builder                  # (size, device) -> fp32 model, fp32 inputs
    trainable: bool                   # zoo.py runs a training step for it
    loss: Loss                        # scalar training loss from (output, inputs)
    channels_last: bool = False       # image CNN: weights and inputs channels-last at "gpu" size
    bf16: bool = True                 # runs in bf16 (torchvision's RAFT and detectors do not)

    def make(self, size: str, device: torch.device | str = "cpu",
             dtype: torch.dtype = torch.float32) -> tuple[nn.Module, Inputs]:
        """The model in eval mode (BatchNorm running statistics set from the example inputs) and its
        example inputs, floating-point parameters and inputs in `dtype`; same weights on every call."""
        if size not in SIZES:
            raise ValueError(f"size must be one of {SIZES}, got {size!r}")
        torch.manual_seed(0)
        model, inputs = self.builder(size, device)
        _randomize_zero_weights(model)
        _calibrate_batchnorm(model, inputs)
        # calibrating ran the model in fp32 and eval mode: models that cache derived tensors then
        # (timm's LeViT keeps its attention biases per device) drop them on entering train mode
        model.train()
        model.eval().to(dtype)
        inputs = tuple(x.to(dtype) if x.is_floating_point() else x for x in inputs)
        if self.channels_last and size == "gpu":
            model.to(memory_format=torch.channels_last)
            inputs = tuple(x.contiguous(memory_format=torch.channels_last) if x.dim() == 4 else x for x in inputs)
        return model, inputs


def _randomize_zero_weights(model: nn.Module) -> None:
    """Give every all-zero weight matrix or kernel random values (normal, 1/sqrt(fan-in)).
    Libraries zero-initialise some layers so that training starts from them (torchvision's ViT
    head, timm's MLP-Mixer head); with random weights and no training such a head makes the
    output a constant, identical under every backend, and an accuracy check of it cannot fail.
    Zero vectors (biases, norm scales of zero-initialised residual branches) are left alone: the
    output still depends on the input through the other paths."""
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2 and p.is_floating_point() and p.numel() and not p.any():
                fan_in = p[0].numel()
                p.copy_(torch.randn(p.shape, generator=g) * fan_in ** -0.5)


def _calibrate_batchnorm(model: nn.Module, inputs: Inputs) -> None:
    """Set every BatchNorm's running statistics from its input on `inputs`, in eval mode: the
    batch mean, and the mean square (not the variance) as the variance.  With the defaults (0, 1)
    eval-mode activations of a randomly initialised deep CNN drift by orders of magnitude over the
    layers; calibrated, they stay near unit scale as in a trained network.  The mean square keeps
    the normalisation well conditioned: a channel whose batch variance is ~0 (at 1x1 resolution
    and batch 2 some are) would otherwise divide rounding noise by sqrt(eps) at every such layer,
    and fp32 eager itself would be O(1) off an fp64 run.  One eval pass suffices: the pre-hooks run
    in execution order, so each norm sees the already calibrated layers before it."""
    def calibrate(m: nn.modules.batchnorm._BatchNorm, args: tuple[torch.Tensor, ...]) -> None:
        x = args[0].transpose(0, 1).flatten(1)   # channels x (batch * positions)
        m.running_mean.copy_(x.mean(1))
        m.running_var.copy_(x.pow(2).mean(1))

    handles = [m.register_forward_pre_hook(calibrate) for m in model.modules()
               if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    if not handles:
        return
    model.eval()
    with torch.no_grad():
        model(*inputs)
    for h in handles:
        h.remove()


# ----------------------------------------------------------------------------------------------
# hand-written models: constructor kwargs, batch and input resolution per size
# ----------------------------------------------------------------------------------------------
CLASSES = {"tiny": 10, "cpu": 100, "gpu": 1000}


def _image_builder(factory: Callable[..., nn.Module], sizes: dict[str, tuple[dict[str, Any], int, int]]) -> Builder:
    def build(size: str, device: torch.device | str) -> tuple[nn.Module, Inputs]:
        kwargs, batch, res = sizes[size]
        with torch.device(device):
            model = factory(**{"classes": CLASSES[size], **kwargs})
        g = torch.Generator().manual_seed(1)
        return model, (torch.randn(batch, 3, res, res, generator=g).to(device),)
    return build


def _sizes(tiny: dict[str, Any], cpu: dict[str, Any], gpu: dict[str, Any], res: tuple[int, int, int] = (64, 64, 224),
           batch: tuple[int, int, int] = (4, 4, 64)) -> dict[str, tuple[dict[str, Any], int, int]]:
    # Small sizes keep the last feature maps at 2x2 or more and the batch at 4: BatchNorm over the
    # 2 values per channel of a 1x1 map at batch 2 is degenerate (outputs exactly +-1, gradients
    # that amplify rounding by orders of magnitude), and fp32 eager itself would be far off fp64.
    return {"tiny": (tiny, batch[0], res[0]), "cpu": (cpu, batch[1], res[1]), "gpu": (gpu, batch[2], res[2])}


def _resnet(block: type[nn.Module]) -> Callable[..., nn.Module]:
    def factory(**kwargs: Any) -> nn.Module:
        return cnn.ResNet(block, **kwargs)
    return factory


def _unet(bilinear: bool) -> Callable[..., nn.Module]:
    def factory(**kwargs: Any) -> nn.Module:
        return cnn.UNet(bilinear=bilinear, **kwargs)
    return factory


def _recurrent(cell: str) -> Builder:
    # vocab, hidden, layers, batch, seq per size
    sizes = {"tiny": (64, 16, 1, 2, 6), "cpu": (1000, 128, 2, 4, 16), "gpu": (10000, 1024, 2, 64, 64)}

    def build(size: str, device: torch.device | str) -> tuple[nn.Module, Inputs]:
        vocab, hidden, layers, batch, seq = sizes[size]
        with torch.device(device):
            model = cnn.RecurrentLM(vocab, hidden, layers, cell)
        g = torch.Generator().manual_seed(1)
        return model, (torch.randint(0, vocab, (batch, seq), generator=g).to(device),)
    return build


_UNET_SIZES = _sizes(dict(base=4, depth=2, classes=4), dict(base=8, depth=3, classes=8),
                     dict(base=64, depth=4, classes=21),
                     res=(32, 64, 256), batch=(2, 4, 16))

_HAND_WRITTEN: list[tuple[str, str, Builder, Loss]] = [
    ("resnet18", "resnet", _image_builder(_resnet(cnn.BasicBlock), _sizes(
        dict(layers=(1, 1, 1, 1), base=8), dict(layers=(2, 2, 2, 2), base=32), dict(layers=(2, 2, 2, 2)))),
     class_loss),
    ("resnet50", "resnet", _image_builder(_resnet(cnn.Bottleneck), _sizes(
        dict(layers=(1, 1, 1, 1), base=8), dict(layers=(1, 2, 2, 1), base=32), dict(layers=(3, 4, 6, 3)))),
     class_loss),
    ("resnext50_32x4d", "grouped", _image_builder(_resnet(cnn.Bottleneck), _sizes(
        dict(layers=(1, 1, 1, 1), base=16, groups=4, width_per_group=16),
        dict(layers=(1, 2, 2, 1), base=32, groups=8, width_per_group=8),
        dict(layers=(3, 4, 6, 3), groups=32, width_per_group=4))), class_loss),
    ("inception", "concat", _image_builder(cnn.InceptionV3, _sizes(
        dict(width=0.125, repeats=(1, 1, 1)), dict(width=0.25, repeats=(1, 2, 1)), dict(),
        res=(107, 107, 299))), class_loss),
    ("densenet", "concat", _image_builder(cnn.DenseNet, _sizes(
        dict(growth=8, blocks=(2, 2), init_features=16), dict(growth=16, blocks=(3, 4, 4, 3), init_features=32),
        dict())), class_loss),
    ("squeezenet", "concat", _image_builder(cnn.SqueezeNet, _sizes(
        dict(width=0.25), dict(width=0.5), dict())), class_loss),
    ("mobilenet_v2", "mobile", _image_builder(cnn.MobileNetV2, _sizes(
        dict(width=0.25, max_repeats=1), dict(width=0.5, max_repeats=2), dict())), class_loss),
    ("mobilenet_v3", "mobile", _image_builder(cnn.MobileNetV3, _sizes(
        dict(width=0.25, rows=(0, 1, 3, 6, 10, 12)), dict(width=0.5), dict())), class_loss),
    ("efficientnet_b0", "mobile", _image_builder(cnn.EfficientNet, _sizes(
        dict(width=0.25, depth=0.3), dict(width=0.5, depth=0.5), dict())), class_loss),
    ("shufflenet_v2", "mobile", _image_builder(cnn.ShuffleNetV2, _sizes(
        dict(repeats=(1, 1, 1), channels=(8, 16, 32, 64, 128)),
        dict(repeats=(2, 2, 2), channels=(24, 48, 96, 192, 512)), dict())), class_loss),
    ("regnety", "regnet", _image_builder(cnn.RegNetY, _sizes(
        dict(widths=(8, 16, 32, 64), depths=(1, 1, 1, 1), stem=8),
        dict(widths=(48, 104, 208, 440), depths=(1, 1, 2, 2)),
        dict(widths=(48, 120, 336, 888), depths=(2, 4, 10, 2), group_width=24))), class_loss),   # regnet_y_1_6gf
    ("convnext", "convnext", _image_builder(cnn.ConvNeXt, _sizes(
        dict(dims=(8, 16, 32, 64), depths=(1, 1, 1, 1)), dict(dims=(32, 64, 128, 256), depths=(1, 1, 3, 1)),
        dict())), class_loss),
    ("unet", "unet", _image_builder(_unet(bilinear=True), _UNET_SIZES), pixel_loss),
    ("unet_convt", "unet", _image_builder(_unet(bilinear=False), _UNET_SIZES), pixel_loss),
    ("mlp_mixer", "mixer", _image_builder(cnn.MLPMixer, _sizes(
        dict(image=32, patch=8, dim=32, depth=2, token_mlp=16, channel_mlp=64),
        dict(image=64, patch=8, dim=128, depth=4, token_mlp=64, channel_mlp=512), dict(), res=(32, 64, 224))),
     class_loss),
]

# transformers models that zoo.py trains too (the others: inference only, to keep a full run short)
_HF_TRAINABLE = {"vit", "swin", "bert", "distilbert", "t5", "gpt2", "opt", "llama", "qwen2"}

MODELS: list[ZooModel] = (
    [ZooModel(name, family, build, True, loss, channels_last=True) for name, family, build, loss in _HAND_WRITTEN]
    + [ZooModel("lstm", "rnn", _recurrent("lstm"), True, lm_loss),
       ZooModel("gru", "rnn", _recurrent("gru"), True, lm_loss)]
    + [ZooModel(name, family, build, name in _HF_TRAINABLE, lm_loss if family == "decoder" else class_loss)
       for name, (family, build) in hf.BUILDERS.items()])
BY_NAME: dict[str, ZooModel] = {m.name: m for m in MODELS}
assert len(BY_NAME) == len(MODELS) and {m.family for m in MODELS} == set(FAMILIES)
