"""Hand-written CNNs, recurrent nets and an MLP-Mixer for the model zoo (see zoo_models.py).

The CNNs follow torchvision's code (same blocks, same layer order, same initialisation), with
widths, depths and repeats as constructor arguments so that one class serves the realistic
configuration ("gpu" size) and the small ones for CPU runs and tests.  No torchvision import:
the zoo must not depend on it, and writing the blocks out keeps what is being compiled in view.
"""
from __future__ import annotations

import math
from typing import Callable, Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F

Act = Callable[..., nn.Module]


def make_divisible(v: float, divisor: int = 8) -> int:
    """torchvision's `_make_divisible`: round to a multiple of `divisor`, never down by > 10%."""
    new_v = max(divisor, int(v + divisor / 2) // divisor * divisor)
    return new_v + divisor if new_v < 0.9 * v else new_v


class ConvBNAct(nn.Sequential):
    """Conv2d (no bias) + BatchNorm2d + optional activation; 'same' padding for odd kernels."""

    def __init__(self, c_in: int, c_out: int, k: int | tuple[int, int] = 3, stride: int = 1, groups: int = 1,
                 act: Act | None = nn.ReLU, padding: int | tuple[int, int] | None = None, eps: float = 1e-5):
        if padding is None:
            padding = tuple((s - 1) // 2 for s in k) if isinstance(k, tuple) else (k - 1) // 2
        layers: list[nn.Module] = [nn.Conv2d(c_in, c_out, k, stride, padding, groups=groups, bias=False),
                                   nn.BatchNorm2d(c_out, eps=eps)]
        if act is not None:
            layers.append(act(inplace=True))
        super().__init__(*layers)


def init_cnn(model: nn.Module, linear_std: float = 0.01) -> nn.Module:
    """torchvision's initialisation: Kaiming (fan_out) convs, unit BatchNorm, small linear heads."""
    for m in model.modules():
        if isinstance(m, (nn.Conv2d, nn.ConvTranspose2d)):
            nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
            if m.bias is not None:
                nn.init.zeros_(m.bias)
        elif isinstance(m, (nn.BatchNorm2d, nn.LayerNorm)):
            nn.init.ones_(m.weight)
            nn.init.zeros_(m.bias)
        elif isinstance(m, nn.Linear):
            nn.init.normal_(m.weight, 0, linear_std)
            if m.bias is not None:
                nn.init.zeros_(m.bias)
    return model


class SqueezeExcite(nn.Module):
    """Global average pool, two 1x1 convs, a gate multiplied onto the input (MobileNetV3,
    EfficientNet and RegNetY differ only in the activations)."""

    def __init__(self, c: int, squeeze: int, act: Act = nn.ReLU, gate: Act = nn.Sigmoid):
        super().__init__()
        self.fc1, self.fc2 = nn.Conv2d(c, squeeze, 1), nn.Conv2d(squeeze, c, 1)
        self.act, self.gate = act(inplace=True), gate()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s = F.adaptive_avg_pool2d(x, 1)
        return x * self.gate(self.fc2(self.act(self.fc1(s))))


class ClassifierHead(nn.Sequential):
    def __init__(self, c: int, classes: int):
        super().__init__(nn.AdaptiveAvgPool2d(1), nn.Flatten(1), nn.Linear(c, classes))


class FeaturesHead(nn.Module):
    """A classifier made of `self.features` (set by the subclass) and `self.head`."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x))


# ----------------------------------------------------------------------------------------------
# ResNet / ResNeXt
# ----------------------------------------------------------------------------------------------
class BasicBlock(nn.Module):
    expansion = 1

    def __init__(self, c_in: int, planes: int, stride: int = 1, downsample: nn.Module | None = None,
                 groups: int = 1, base_width: int = 64):
        super().__init__()   # groups, base_width: Bottleneck's signature (ResNet passes them to either)
        self.conv1 = nn.Conv2d(c_in, planes, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(planes, planes, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.downsample = downsample

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        return self.relu(self.bn2(self.conv2(out)) + identity)


class Bottleneck(nn.Module):
    expansion = 4

    def __init__(self, c_in: int, planes: int, stride: int = 1, downsample: nn.Module | None = None,
                 groups: int = 1, base_width: int = 64):
        super().__init__()
        width = int(planes * (base_width / 64.0)) * groups
        self.conv1 = nn.Conv2d(c_in, width, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = nn.Conv2d(width, width, 3, stride, 1, groups=groups, bias=False)
        self.bn2 = nn.BatchNorm2d(width)
        self.conv3 = nn.Conv2d(width, planes * self.expansion, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(planes * self.expansion)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = downsample

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        return self.relu(self.bn3(self.conv3(out)) + identity)


class ResNet(nn.Module):
    def __init__(self, block: type[BasicBlock] | type[Bottleneck], layers: Sequence[int], classes: int = 1000,
                 groups: int = 1, width_per_group: int = 64, base: int = 64):
        super().__init__()
        self.c_in, self.groups, self.base_width = base, groups, width_per_group
        self.stem = nn.Sequential(nn.Conv2d(3, base, 7, 2, 3, bias=False), nn.BatchNorm2d(base),
                                  nn.ReLU(inplace=True), nn.MaxPool2d(3, 2, 1))
        self.layers = nn.Sequential(*(self._stage(block, base * 2 ** i, n, 1 if i == 0 else 2)
                                      for i, n in enumerate(layers)))
        self.head = ClassifierHead(self.c_in, classes)
        init_cnn(self)

    def _stage(self, block: type[BasicBlock] | type[Bottleneck], planes: int, blocks: int, stride: int) -> nn.Sequential:
        downsample = None
        if stride != 1 or self.c_in != planes * block.expansion:
            downsample = nn.Sequential(nn.Conv2d(self.c_in, planes * block.expansion, 1, stride, bias=False),
                                       nn.BatchNorm2d(planes * block.expansion))
        mods = [block(self.c_in, planes, stride, downsample, self.groups, self.base_width)]
        self.c_in = planes * block.expansion
        mods += [block(self.c_in, planes, groups=self.groups, base_width=self.base_width) for _ in range(1, blocks)]
        return nn.Sequential(*mods)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.layers(self.stem(x)))


# ----------------------------------------------------------------------------------------------
# Inception-v3 (torchvision's blocks; every width scaled by `w`)
# ----------------------------------------------------------------------------------------------
def _incep_conv(c_in: int, c_out: int, k: int | tuple[int, int], stride: int = 1,
                padding: int | tuple[int, int] = 0) -> ConvBNAct:
    return ConvBNAct(c_in, c_out, k, stride, padding=padding, eps=0.001)


class InceptionA(nn.Module):
    def __init__(self, c_in: int, pool_features: int, w: Callable[[int], int]):
        super().__init__()
        self.b1x1 = _incep_conv(c_in, w(64), 1)
        self.b5x5 = nn.Sequential(_incep_conv(c_in, w(48), 1), _incep_conv(w(48), w(64), 5, padding=2))
        self.b3x3dbl = nn.Sequential(_incep_conv(c_in, w(64), 1), _incep_conv(w(64), w(96), 3, padding=1),
                                     _incep_conv(w(96), w(96), 3, padding=1))
        self.bpool = _incep_conv(c_in, pool_features, 1)
        self.c_out = w(64) + w(64) + w(96) + pool_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        pool = self.bpool(F.avg_pool2d(x, 3, 1, 1))
        return torch.cat([self.b1x1(x), self.b5x5(x), self.b3x3dbl(x), pool], 1)


class InceptionB(nn.Module):
    """Grid reduction: stride-2 3x3 branches and a max pool, concatenated."""

    def __init__(self, c_in: int, w: Callable[[int], int]):
        super().__init__()
        self.b3x3 = _incep_conv(c_in, w(384), 3, stride=2)
        self.b3x3dbl = nn.Sequential(_incep_conv(c_in, w(64), 1), _incep_conv(w(64), w(96), 3, padding=1),
                                     _incep_conv(w(96), w(96), 3, stride=2))
        self.c_out = w(384) + w(96) + c_in

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([self.b3x3(x), self.b3x3dbl(x), F.max_pool2d(x, 3, 2)], 1)


class InceptionC(nn.Module):
    """Factorised 7x7 convolutions: 1x7 and 7x1 in sequence."""

    def __init__(self, c_in: int, c7: int, w: Callable[[int], int]):
        super().__init__()
        self.b1x1 = _incep_conv(c_in, w(192), 1)
        self.b7x7 = nn.Sequential(_incep_conv(c_in, c7, 1), _incep_conv(c7, c7, (1, 7), padding=(0, 3)),
                                  _incep_conv(c7, w(192), (7, 1), padding=(3, 0)))
        self.b7x7dbl = nn.Sequential(_incep_conv(c_in, c7, 1), _incep_conv(c7, c7, (7, 1), padding=(3, 0)),
                                     _incep_conv(c7, c7, (1, 7), padding=(0, 3)),
                                     _incep_conv(c7, c7, (7, 1), padding=(3, 0)),
                                     _incep_conv(c7, w(192), (1, 7), padding=(0, 3)))
        self.bpool = _incep_conv(c_in, w(192), 1)
        self.c_out = 4 * w(192)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        pool = self.bpool(F.avg_pool2d(x, 3, 1, 1))
        return torch.cat([self.b1x1(x), self.b7x7(x), self.b7x7dbl(x), pool], 1)


class InceptionD(nn.Module):
    def __init__(self, c_in: int, w: Callable[[int], int]):
        super().__init__()
        self.b3x3 = nn.Sequential(_incep_conv(c_in, w(192), 1), _incep_conv(w(192), w(320), 3, stride=2))
        self.b7x7x3 = nn.Sequential(_incep_conv(c_in, w(192), 1),
                                    _incep_conv(w(192), w(192), (1, 7), padding=(0, 3)),
                                    _incep_conv(w(192), w(192), (7, 1), padding=(3, 0)),
                                    _incep_conv(w(192), w(192), 3, stride=2))
        self.c_out = w(320) + w(192) + c_in

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([self.b3x3(x), self.b7x7x3(x), F.max_pool2d(x, 3, 2)], 1)


class InceptionE(nn.Module):
    """Branches that split into parallel 1x3 and 3x1 convolutions, concatenated twice over."""

    def __init__(self, c_in: int, w: Callable[[int], int]):
        super().__init__()
        self.b1x1 = _incep_conv(c_in, w(320), 1)
        self.b3x3_1 = _incep_conv(c_in, w(384), 1)
        self.b3x3_2a = _incep_conv(w(384), w(384), (1, 3), padding=(0, 1))
        self.b3x3_2b = _incep_conv(w(384), w(384), (3, 1), padding=(1, 0))
        self.dbl_1 = _incep_conv(c_in, w(448), 1)
        self.dbl_2 = _incep_conv(w(448), w(384), 3, padding=1)
        self.dbl_3a = _incep_conv(w(384), w(384), (1, 3), padding=(0, 1))
        self.dbl_3b = _incep_conv(w(384), w(384), (3, 1), padding=(1, 0))
        self.bpool = _incep_conv(c_in, w(192), 1)
        self.c_out = w(320) + 4 * w(384) + w(192)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b3 = self.b3x3_1(x)
        b3 = torch.cat([self.b3x3_2a(b3), self.b3x3_2b(b3)], 1)
        dbl = self.dbl_2(self.dbl_1(x))
        dbl = torch.cat([self.dbl_3a(dbl), self.dbl_3b(dbl)], 1)
        pool = self.bpool(F.avg_pool2d(x, 3, 1, 1))
        return torch.cat([self.b1x1(x), b3, dbl, pool], 1)


class InceptionV3(nn.Module):
    """torchvision's inception_v3 without the auxiliary head; `repeats` = how many A, C and E
    blocks (3, 4, 2 in the real network).  Needs inputs of at least 75x75."""

    def __init__(self, width: float = 1.0, repeats: tuple[int, int, int] = (3, 4, 2), classes: int = 1000):
        super().__init__()
        def w(c: int) -> int:
            return max(4, int(c * width))
        self.stem = nn.Sequential(
            _incep_conv(3, w(32), 3, stride=2), _incep_conv(w(32), w(32), 3), _incep_conv(w(32), w(64), 3, padding=1),
            nn.MaxPool2d(3, 2), _incep_conv(w(64), w(80), 1), _incep_conv(w(80), w(192), 3), nn.MaxPool2d(3, 2))
        blocks: list[nn.Module] = []
        c = w(192)
        for i in range(repeats[0]):
            blocks.append(InceptionA(c, w(32) if i == 0 else w(64), w))
            c = blocks[-1].c_out
        blocks.append(InceptionB(c, w))
        c = blocks[-1].c_out
        for i in range(repeats[1]):
            blocks.append(InceptionC(c, w((128, 160, 160, 192)[min(i, 3)]), w))
            c = blocks[-1].c_out
        blocks.append(InceptionD(c, w))
        c = blocks[-1].c_out
        for _ in range(repeats[2]):
            blocks.append(InceptionE(c, w))
            c = blocks[-1].c_out
        self.blocks = nn.Sequential(*blocks)
        self.head = ClassifierHead(c, classes)
        init_cnn(self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(self.stem(x)))


# ----------------------------------------------------------------------------------------------
# DenseNet
# ----------------------------------------------------------------------------------------------
class DenseLayer(nn.Module):
    def __init__(self, c_in: int, growth: int, bn_size: int):
        super().__init__()
        self.norm1, self.conv1 = nn.BatchNorm2d(c_in), nn.Conv2d(c_in, bn_size * growth, 1, bias=False)
        self.norm2 = nn.BatchNorm2d(bn_size * growth)
        self.conv2 = nn.Conv2d(bn_size * growth, growth, 3, 1, 1, bias=False)

    def forward(self, features: list[torch.Tensor]) -> torch.Tensor:
        x = torch.cat(features, 1)   # every earlier layer's output, re-concatenated per layer
        x = self.conv1(F.relu(self.norm1(x)))
        return self.conv2(F.relu(self.norm2(x)))


class DenseBlock(nn.ModuleList):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        features = [x]
        for layer in self:
            features.append(layer(features))
        return torch.cat(features, 1)


class DenseNet(FeaturesHead):
    def __init__(self, growth: int = 32, blocks: Sequence[int] = (6, 12, 24, 16), init_features: int = 64,
                 bn_size: int = 4, classes: int = 1000):
        super().__init__()
        layers: list[nn.Module] = [nn.Conv2d(3, init_features, 7, 2, 3, bias=False), nn.BatchNorm2d(init_features),
                                   nn.ReLU(inplace=True), nn.MaxPool2d(3, 2, 1)]
        c = init_features
        for i, n in enumerate(blocks):
            layers.append(DenseBlock(DenseLayer(c + j * growth, growth, bn_size) for j in range(n)))
            c += n * growth
            if i != len(blocks) - 1:   # transition: halve channels and resolution
                layers += [nn.BatchNorm2d(c), nn.ReLU(inplace=True), nn.Conv2d(c, c // 2, 1, bias=False),
                           nn.AvgPool2d(2, 2)]
                c //= 2
        layers += [nn.BatchNorm2d(c), nn.ReLU(inplace=True)]
        self.features = nn.Sequential(*layers)
        self.head = ClassifierHead(c, classes)
        init_cnn(self)


# ----------------------------------------------------------------------------------------------
# SqueezeNet 1.1
# ----------------------------------------------------------------------------------------------
class Fire(nn.Module):
    def __init__(self, c_in: int, squeeze: int, expand: int):
        super().__init__()
        self.squeeze = nn.Conv2d(c_in, squeeze, 1)
        self.expand1x1, self.expand3x3 = nn.Conv2d(squeeze, expand, 1), nn.Conv2d(squeeze, expand, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.squeeze(x), inplace=True)
        return torch.cat([F.relu(self.expand1x1(x), inplace=True), F.relu(self.expand3x3(x), inplace=True)], 1)


class SqueezeNet(nn.Module):
    """squeezenet1_1 (no BatchNorm, ceil-mode max pools, a convolutional classifier)."""

    def __init__(self, width: float = 1.0, classes: int = 1000):
        super().__init__()
        def w(c: int) -> int:
            return max(4, int(c * width))
        fire = [(w(16), w(64)), (w(16), w(64)), None, (w(32), w(128)), (w(32), w(128)), None,
                (w(48), w(192)), (w(48), w(192)), (w(64), w(256)), (w(64), w(256))]
        layers: list[nn.Module] = [nn.Conv2d(3, w(64), 3, 2), nn.ReLU(inplace=True), nn.MaxPool2d(3, 2, ceil_mode=True)]
        c = w(64)
        for f in fire:
            if f is None:
                layers.append(nn.MaxPool2d(3, 2, ceil_mode=True))
            else:
                layers.append(Fire(c, *f))
                c = 2 * f[1]
        self.features = nn.Sequential(*layers)
        self.classifier = nn.Sequential(nn.Conv2d(c, classes, 1), nn.ReLU(inplace=True), nn.AdaptiveAvgPool2d(1),
                                        nn.Flatten(1))
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_uniform_(m.weight)
                nn.init.zeros_(m.bias)
        nn.init.normal_(self.classifier[0].weight, 0, 0.01)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(x))


# ----------------------------------------------------------------------------------------------
# MobileNetV2, MobileNetV3, EfficientNet, ShuffleNetV2
# ----------------------------------------------------------------------------------------------
class InvertedResidual(nn.Module):
    """MobileNetV2 / V3 and EfficientNet's MBConv: 1x1 expand, depthwise kxk, optional SE,
    1x1 project (no activation), residual when shapes allow (stochastic depth off)."""

    def __init__(self, c_in: int, c_exp: int, c_out: int, k: int, stride: int, act: Act,
                 se: nn.Module | None = None):
        super().__init__()
        layers: list[nn.Module] = []
        if c_exp != c_in:
            layers.append(ConvBNAct(c_in, c_exp, 1, act=act))
        layers.append(ConvBNAct(c_exp, c_exp, k, stride, groups=c_exp, act=act))
        if se is not None:
            layers.append(se)
        layers.append(ConvBNAct(c_exp, c_out, 1, act=None))
        self.block = nn.Sequential(*layers)
        self.residual = stride == 1 and c_in == c_out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.block(x) if self.residual else self.block(x)


# t (expansion), c (channels), n (repeats), s (stride of the first)
MOBILENET_V2 = ((1, 16, 1, 1), (6, 24, 2, 2), (6, 32, 3, 2), (6, 64, 4, 2), (6, 96, 3, 1), (6, 160, 3, 2),
                (6, 320, 1, 1))


class MobileNetV2(FeaturesHead):
    def __init__(self, width: float = 1.0, max_repeats: int = 4, classes: int = 1000):
        super().__init__()
        c = make_divisible(32 * width)
        last = make_divisible(1280 * max(1.0, width))
        layers: list[nn.Module] = [ConvBNAct(3, c, 3, 2, act=nn.ReLU6)]
        for t, ch, n, s in MOBILENET_V2:
            c_out = make_divisible(ch * width)
            for i in range(min(n, max_repeats)):
                layers.append(InvertedResidual(c, c * t, c_out, 3, s if i == 0 else 1, nn.ReLU6))
                c = c_out
        layers.append(ConvBNAct(c, last, 1, act=nn.ReLU6))
        self.features = nn.Sequential(*layers)
        self.head = ClassifierHead(last, classes)
        init_cnn(self)


# kernel, expanded channels, out channels, SE, hardswish, stride  (mobilenet_v3_large)
MOBILENET_V3 = ((3, 16, 16, False, False, 1), (3, 64, 24, False, False, 2), (3, 72, 24, False, False, 1),
                (5, 72, 40, True, False, 2), (5, 120, 40, True, False, 1), (5, 120, 40, True, False, 1),
                (3, 240, 80, False, True, 2), (3, 200, 80, False, True, 1), (3, 184, 80, False, True, 1),
                (3, 184, 80, False, True, 1), (3, 480, 112, True, True, 1), (3, 672, 112, True, True, 1),
                (5, 672, 160, True, True, 2), (5, 960, 160, True, True, 1), (5, 960, 160, True, True, 1))


class MobileNetV3(FeaturesHead):
    """mobilenet_v3_large; `rows` picks a subset of the block table (all by default)."""

    def __init__(self, width: float = 1.0, rows: Sequence[int] | None = None, classes: int = 1000):
        super().__init__()
        table = [MOBILENET_V3[i] for i in (rows if rows is not None else range(len(MOBILENET_V3)))]
        c = make_divisible(16 * width)
        layers: list[nn.Module] = [ConvBNAct(3, c, 3, 2, act=nn.Hardswish)]
        for k, exp, out, use_se, hs, s in table:
            c_exp, c_out = make_divisible(exp * width), make_divisible(out * width)
            se = SqueezeExcite(c_exp, make_divisible(c_exp // 4), nn.ReLU, nn.Hardsigmoid) if use_se else None
            layers.append(InvertedResidual(c, c_exp, c_out, k, s, nn.Hardswish if hs else nn.ReLU, se))
            c = c_out
        last = 6 * c
        layers.append(ConvBNAct(c, last, 1, act=nn.Hardswish))
        self.features = nn.Sequential(*layers)
        self.head = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(1), nn.Linear(last, 1280),
                                  nn.Hardswish(inplace=True), nn.Linear(1280, classes))
        init_cnn(self)


# expansion, kernel, stride, in, out, layers  (efficientnet_b0)
EFFICIENTNET_B0 = ((1, 3, 1, 32, 16, 1), (6, 3, 2, 16, 24, 2), (6, 5, 2, 24, 40, 2), (6, 3, 2, 40, 80, 3),
                   (6, 5, 1, 80, 112, 3), (6, 5, 2, 112, 192, 4), (6, 3, 1, 192, 320, 1))


class EfficientNet(FeaturesHead):
    def __init__(self, width: float = 1.0, depth: float = 1.0, classes: int = 1000):
        super().__init__()
        c = make_divisible(32 * width)
        layers: list[nn.Module] = [ConvBNAct(3, c, 3, 2, act=nn.SiLU)]
        for t, k, s, _, out, n in EFFICIENTNET_B0:
            c_out = make_divisible(out * width)
            for i in range(max(1, math.ceil(n * depth))):
                se = SqueezeExcite(c * t, max(1, c // 4), nn.SiLU, nn.Sigmoid)
                layers.append(InvertedResidual(c, c * t, c_out, k, s if i == 0 else 1, nn.SiLU, se))
                c = c_out
        last = 4 * c
        layers.append(ConvBNAct(c, last, 1, act=nn.SiLU))
        self.features = nn.Sequential(*layers)
        self.head = ClassifierHead(last, classes)
        init_cnn(self)


def channel_shuffle(x: torch.Tensor, groups: int) -> torch.Tensor:
    n, c, h, w = x.shape
    return x.view(n, groups, c // groups, h, w).transpose(1, 2).reshape(n, c, h, w)


class ShuffleUnit(nn.Module):
    def __init__(self, c_in: int, c_out: int, stride: int):
        super().__init__()
        half = c_out // 2
        self.stride = stride
        self.branch1 = nn.Sequential(ConvBNAct(c_in, c_in, 3, stride, groups=c_in, act=None),
                                     ConvBNAct(c_in, half, 1)) if stride > 1 else None
        c_b2 = c_in if stride > 1 else half
        self.branch2 = nn.Sequential(ConvBNAct(c_b2, half, 1), ConvBNAct(half, half, 3, stride, groups=half, act=None),
                                     ConvBNAct(half, half, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.stride == 1:
            x1, x2 = x.chunk(2, dim=1)
            out = torch.cat([x1, self.branch2(x2)], 1)
        else:
            out = torch.cat([self.branch1(x), self.branch2(x)], 1)
        return channel_shuffle(out, 2)


class ShuffleNetV2(FeaturesHead):
    def __init__(self, repeats: Sequence[int] = (4, 8, 4), channels: Sequence[int] = (24, 116, 232, 464, 1024),
                 classes: int = 1000):
        super().__init__()
        layers: list[nn.Module] = [ConvBNAct(3, channels[0], 3, 2), nn.MaxPool2d(3, 2, 1)]
        c = channels[0]
        for n, c_out in zip(repeats, channels[1:-1]):
            layers += [ShuffleUnit(c, c_out, 2)] + [ShuffleUnit(c_out, c_out, 1) for _ in range(n - 1)]
            c = c_out
        layers.append(ConvBNAct(c, channels[-1], 1))
        self.features = nn.Sequential(*layers)
        self.head = ClassifierHead(channels[-1], classes)
        init_cnn(self)


# ----------------------------------------------------------------------------------------------
# RegNetY
# ----------------------------------------------------------------------------------------------
class RegNetYBlock(nn.Module):
    """torchvision's ResBottleneckBlock with bottleneck ratio 1 and SE (ratio 0.25 of the input)."""

    def __init__(self, c_in: int, c_out: int, stride: int, group_width: int):
        super().__init__()
        groups = c_out // group_width
        self.f = nn.Sequential(ConvBNAct(c_in, c_out, 1), ConvBNAct(c_out, c_out, 3, stride, groups=groups),
                               SqueezeExcite(c_out, int(round(0.25 * c_in))), ConvBNAct(c_out, c_out, 1, act=None))
        self.proj = ConvBNAct(c_in, c_out, 1, stride, act=None) if stride != 1 or c_in != c_out else None
        self.relu = nn.ReLU(inplace=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.relu((x if self.proj is None else self.proj(x)) + self.f(x))


class RegNetY(FeaturesHead):
    def __init__(self, widths: Sequence[int] = (48, 104, 208, 440), depths: Sequence[int] = (1, 3, 6, 6),
                 group_width: int = 8, stem: int = 32, classes: int = 1000):
        super().__init__()
        layers: list[nn.Module] = [ConvBNAct(3, stem, 3, 2)]
        c = stem
        for w, d in zip(widths, depths):
            for i in range(d):
                layers.append(RegNetYBlock(c, w, 2 if i == 0 else 1, group_width))
                c = w
        self.features = nn.Sequential(*layers)
        self.head = ClassifierHead(c, classes)
        init_cnn(self)


# ----------------------------------------------------------------------------------------------
# ConvNeXt
# ----------------------------------------------------------------------------------------------
class LayerNorm2d(nn.LayerNorm):
    """LayerNorm over the channels of an NCHW tensor, by permuting to NHWC and back (torchvision)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.permute(0, 2, 3, 1)
        x = F.layer_norm(x, self.normalized_shape, self.weight, self.bias, self.eps)
        return x.permute(0, 3, 1, 2)


class CNBlock(nn.Module):
    def __init__(self, dim: int, layer_scale: float):
        super().__init__()
        self.dwconv = nn.Conv2d(dim, dim, 7, padding=3, groups=dim)
        self.norm = nn.LayerNorm(dim, eps=1e-6)
        self.fc1, self.fc2 = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)
        self.gamma = nn.Parameter(torch.full((dim,), layer_scale))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.dwconv(x).permute(0, 2, 3, 1)
        y = self.fc2(F.gelu(self.fc1(self.norm(y))))
        return x + (self.gamma * y).permute(0, 3, 1, 2)


class ConvNeXt(FeaturesHead):
    """convnext_tiny by default.  Layer scale starts at 0.1, not torchvision's 1e-6: with 1e-6 the
    residual branches barely reach the output and an accuracy check would only see the skips."""

    def __init__(self, dims: Sequence[int] = (96, 192, 384, 768), depths: Sequence[int] = (3, 3, 9, 3),
                 layer_scale: float = 0.1, classes: int = 1000):
        super().__init__()
        layers: list[nn.Module] = [nn.Conv2d(3, dims[0], 4, 4), LayerNorm2d(dims[0], eps=1e-6)]
        for i, (dim, depth) in enumerate(zip(dims, depths)):
            if i > 0:
                layers += [LayerNorm2d(dims[i - 1], eps=1e-6), nn.Conv2d(dims[i - 1], dim, 2, 2)]
            layers += [CNBlock(dim, layer_scale) for _ in range(depth)]
        self.features = nn.Sequential(*layers)
        self.head = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(1), nn.LayerNorm(dims[-1], eps=1e-6),
                                  nn.Linear(dims[-1], classes))
        for m in self.modules():
            if isinstance(m, (nn.Conv2d, nn.Linear)):
                nn.init.trunc_normal_(m.weight, std=0.02)
                nn.init.zeros_(m.bias)


# ----------------------------------------------------------------------------------------------
# U-Net
# ----------------------------------------------------------------------------------------------
def double_conv(c_in: int, c_out: int) -> nn.Sequential:
    return nn.Sequential(ConvBNAct(c_in, c_out, 3), ConvBNAct(c_out, c_out, 3))


class UNet(nn.Module):
    """The classic U-Net: double 3x3 convs, max-pool down, bilinear (align_corners) or
    transposed-conv up, skip connections concatenated; per-pixel class logits."""

    def __init__(self, base: int = 32, depth: int = 4, classes: int = 8, bilinear: bool = True):
        super().__init__()
        widths = [base * 2 ** i for i in range(depth + 1)]
        self.inc = double_conv(3, widths[0])
        self.downs = nn.ModuleList(double_conv(widths[i], widths[i + 1]) for i in range(depth))
        self.bilinear = bilinear
        self.ups = nn.ModuleList(None if bilinear else nn.ConvTranspose2d(widths[i + 1], widths[i], 2, 2)
                                 for i in reversed(range(depth)))
        # bilinear upsampling keeps the channels: the concat is widths[i+1] + widths[i] wide
        self.up_convs = nn.ModuleList(double_conv(widths[i + 1] + widths[i] if bilinear else 2 * widths[i], widths[i])
                                      for i in reversed(range(depth)))
        self.out = nn.Conv2d(widths[0], classes, 1)
        init_cnn(self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        skips = [self.inc(x)]
        for down in self.downs:
            skips.append(down(F.max_pool2d(skips[-1], 2)))
        y = skips.pop()
        for up, conv in zip(self.ups, self.up_convs):
            y = F.interpolate(y, scale_factor=2, mode="bilinear", align_corners=True) if self.bilinear else up(y)
            y = conv(torch.cat([skips.pop(), y], 1))
        return self.out(y)


# ----------------------------------------------------------------------------------------------
# Recurrent language models written by hand, and the MLP-Mixer
# ----------------------------------------------------------------------------------------------
class RecurrentLM(nn.Module):
    """Embedding, stacked LSTM or GRU layers written with nn.Linear gates and a Python loop over
    time steps (Dynamo unrolls it: one graph of `seq` steps), a linear head.  Each layer's input
    projection runs once over the whole sequence, the recurrent one per step."""

    def __init__(self, vocab: int, hidden: int, layers: int, cell: str = "lstm"):
        super().__init__()
        gates = 4 if cell == "lstm" else 3
        self.cell, self.hidden = cell, hidden
        self.embed = nn.Embedding(vocab, hidden)
        self.w_ih = nn.ModuleList(nn.Linear(hidden, gates * hidden) for _ in range(layers))
        self.w_hh = nn.ModuleList(nn.Linear(hidden, gates * hidden) for _ in range(layers))
        self.head = nn.Linear(hidden, vocab)
        bound = 1 / math.sqrt(hidden)   # nn.LSTM's initialisation
        for name, p in self.named_parameters():
            if not name.startswith(("embed", "head")):
                nn.init.uniform_(p, -bound, bound)

    def _lstm(self, xs: torch.Tensor, w_hh: nn.Linear) -> torch.Tensor:
        h = c = xs.new_zeros(xs.shape[0], self.hidden)
        outs = []
        for t in range(xs.shape[1]):
            i, f, g, o = (xs[:, t] + w_hh(h)).chunk(4, 1)
            c = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g)
            h = torch.sigmoid(o) * torch.tanh(c)
            outs.append(h)
        return torch.stack(outs, 1)

    def _gru(self, xs: torch.Tensor, w_hh: nn.Linear) -> torch.Tensor:
        h = xs.new_zeros(xs.shape[0], self.hidden)
        outs = []
        for t in range(xs.shape[1]):
            x_r, x_z, x_n = xs[:, t].chunk(3, 1)
            h_r, h_z, h_n = w_hh(h).chunk(3, 1)
            r, z = torch.sigmoid(x_r + h_r), torch.sigmoid(x_z + h_z)
            n = torch.tanh(x_n + r * h_n)
            h = (1 - z) * n + z * h
            outs.append(h)
        return torch.stack(outs, 1)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        step = self._lstm if self.cell == "lstm" else self._gru
        for w_ih, w_hh in zip(self.w_ih, self.w_hh):
            x = step(w_ih(x), w_hh)
        return self.head(x)


class MixerBlock(nn.Module):
    def __init__(self, tokens: int, dim: int, token_mlp: int, channel_mlp: int):
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(dim, eps=1e-6), nn.LayerNorm(dim, eps=1e-6)
        self.token_mlp = nn.Sequential(nn.Linear(tokens, token_mlp), nn.GELU(), nn.Linear(token_mlp, tokens))
        self.channel_mlp = nn.Sequential(nn.Linear(dim, channel_mlp), nn.GELU(), nn.Linear(channel_mlp, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.token_mlp(self.norm1(x).transpose(1, 2)).transpose(1, 2)   # mix across patches
        return x + self.channel_mlp(self.norm2(x))


class MLPMixer(nn.Module):
    def __init__(self, image: int = 224, patch: int = 16, dim: int = 768, depth: int = 12, token_mlp: int = 384,
                 channel_mlp: int = 3072, classes: int = 1000):
        super().__init__()
        tokens = (image // patch) ** 2
        self.stem = nn.Conv2d(3, dim, patch, patch)
        self.blocks = nn.Sequential(*(MixerBlock(tokens, dim, token_mlp, channel_mlp) for _ in range(depth)))
        self.norm = nn.LayerNorm(dim, eps=1e-6)
        self.head = nn.Linear(dim, classes)
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Conv2d)):
                nn.init.xavier_uniform_(m.weight)
                nn.init.normal_(m.bias, std=1e-6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x).flatten(2).transpose(1, 2)
        return self.head(self.norm(self.blocks(x)).mean(1))
