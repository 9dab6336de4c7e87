"""Which layout a graph's convolutions run in: channels-last (NHWC) or as the user gave them (NCHW).

Decided per graph, from what the graph holds, by `decide_layout`; both places that re-lay a
graph ask it: `channels_last.py` (inference graphs, on the aten graph) and
`frontend/channels_last_training.py` (training graphs, on Dynamo's graph before AOTAutograd).
`Config.channels_last_convs` overrides it (True / False); "auto" applies the rule:

- fewer than MIN_CONVS convolutions on NCHW activations: NCHW.  Copying the input in and a
  4-d output back is a pass over an activation each, which one or two convolutions do not win
  back (a ViT's patch embedding, a single block compiled on its own).
- CPU (oneDNN): channels-last.  oneDNN's convolutions, dense, grouped, depthwise and transposed,
  fp32 and bf16, ran 10-40% faster on channels-last activations (zoo CNNs on 2 cores; Inductor
  makes the same choice for every graph with a convolution on a oneDNN device).  Every
  convolution of such a graph reads a channels-last input, a slice of a channel shuffle too.
  Where weights outweigh activations (ResNet's last stages at small batch) ATen's reorder of
  the weight in every call cost more under channels-last than under NCHW (up to 1.7x the
  convolution); runtime/cpu_conv.py reorders large dense weights once instead.  Training
  graphs only where the convolutions read at least MIN_ACTIVATIONS_PER_WEIGHT activation
  elements per weight element: each step copies every weight to channels-last and its gradient
  back, which a net whose weights outweigh its activations does not win back (resnet18 at
  0.14: 14.7 -> 19.0 ms a step; resnext50 at 0.62: 13.5 -> 11.9).
- CUDA (cuDNN): channels-last runs on tensor cores.  fp32 convolutions with cuDNN's TF32 off
  (`torch.backends.cudnn.allow_tf32`) run on CUDA cores, where cuDNN's NCHW kernels were faster
  (resnet18/resnet50 inference and training 6-20% slower channels-last on an H100,
  benchmarks/probes/nchw_layout.py): NCHW.  Otherwise (bf16/fp16, or fp32 with TF32, PyTorch's
  default) Inductor's measured rules, which torchfuse's NCHW-only GPU default lost to by
  0.71-0.90x on timm's ResNeXt/RegNetY/EfficientNet/Inception/Swin with NCHW input:
  * inference: each convolution's FLOPs weighted by the channels-last time ratio of its kind
    (grouped with several input channels per group 1.358, both channel counts <= 64 0.783,
    in-channels >= 2x out-channels with a k > 1 kernel 0.725, other 0.823; measured by PyTorch
    on torchbench's convolutions): channels-last where the weighted sum is not above the total;
  * training: NCHW if any convolution is grouped with several input channels per group (31x
    slower channels-last at worst), reduces channels 2x with a k > 1 kernel (U-Net's decoders),
    or if all have <= 64 channels; else channels-last;
  * NCHW where the graph holds 300 nodes or more per convolution (a transformer with a patch
    embedding) or convolutions of symbolic size (Inductor saw cuDNN slow down on those).
"""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Sequence

import torch

log = logging.getLogger("torchfuse.layout")

# Fewer convolutions than this: NCHW (see above).
MIN_CONVS = 3

# Training graphs on the CPU: conv input elements per weight element below this stay NCHW.
MIN_ACTIVATIONS_PER_WEIGHT = 0.3

# Inductor's channels-last / NCHW time ratios per kind of convolution (cuDNN, torchbench's
# convolutions), weighting FLOPs in the inference rule.
_GPU_RATIO = {"grouped": 1.358, "small": 0.783, "in_out": 0.725, "default": 0.823}

# On CUDA, a graph with this many nodes per convolution or more stays NCHW.
_NODES_PER_CONV = 300


@dataclass(frozen=True)
class ConvInfo:
    """One convolution on an NCHW activation, as the rule sees it (sizes as hints)."""

    in_channels: int
    out_channels: int
    groups: int
    kernel: tuple[int, ...]
    transposed: bool
    input_numel: int
    output_numel: int
    weight_numel: int
    symbolic: bool = False

    @property
    def kind(self) -> str:
        in_per_group = self.in_channels // max(self.groups, 1)
        if self.groups > 1 and in_per_group > 1:
            return "grouped"
        if self.in_channels <= 64 and self.out_channels <= 64:
            return "small"
        if self.out_channels * 2 <= self.in_channels and math.prod(self.kernel) > 1:
            return "in_out"
        return "default"

    @property
    def flops(self) -> float:
        # multiply-adds: each output (of a transposed convolution: each input) element reads
        # in_channels / groups x kernel weights
        per = self.weight_numel / max(self.out_channels if not self.transposed else self.in_channels, 1)
        return float(self.output_numel if not self.transposed else self.input_numel) * per


@dataclass(frozen=True)
class LayoutDecision:
    channels_last: bool
    reason: str
    convs: int = 0
    """How many convolutions on NCHW activations the graph holds."""

    def __str__(self) -> str:
        return f"{'channels-last' if self.channels_last else 'NCHW'}: {self.reason}"


def conv_info(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor, groups: int, transposed: bool) -> ConvInfo:
    """A ConvInfo from the fake (or example) values of a convolution's input, weight and output."""
    from ._meta import size_hint
    shape = [size_hint(s) for s in w.shape]
    in_ch, out_ch = (shape[0], shape[1] * groups) if transposed else (shape[1] * groups, shape[0])
    symbolic = any(isinstance(s, torch.SymInt) for t in (x, w) for s in t.shape)
    return ConvInfo(in_ch, out_ch, groups, tuple(shape[2:]), transposed,
                    math.prod(size_hint(s) for s in x.shape), math.prod(size_hint(s) for s in out.shape),
                    math.prod(shape), symbolic)


def cudnn_tf32() -> bool:
    """Whether cuDNN may run fp32 convolutions on TF32 tensor cores (torch >= 2.9 has a second
    API for it, `torch.backends.cudnn.conv.fp32_precision`; either answers here)."""
    try:
        precision = torch.backends.cudnn.conv.fp32_precision
        if precision in ("tf32", "ieee"):
            return precision == "tf32"
    except (AttributeError, RuntimeError):
        pass
    return bool(torch.backends.cudnn.allow_tf32)


def decide_layout(convs: Sequence[ConvInfo], *, device: str, dtype: torch.dtype, inference: bool,
                  override: bool | str = "auto", devices: Sequence[str] = ("cpu", "cuda"),
                  tf32: bool | None = None, graph_nodes: int = 0) -> LayoutDecision:
    """The layout of a graph whose convolutions on NCHW activations are `convs` (see the module
    docstring); `device`, `dtype`: theirs; `tf32`: cuDNN's TF32 setting (read now if None)."""
    n = len(convs)
    decision = _decide(convs, device, dtype, inference, override, devices, tf32, graph_nodes)
    return LayoutDecision(decision.channels_last, decision.reason, n)


def _decide(convs: Sequence[ConvInfo], device: str, dtype: torch.dtype, inference: bool, override: bool | str,
            devices: Sequence[str], tf32: bool | None, graph_nodes: int) -> LayoutDecision:
    n = len(convs)
    if override is True:
        return LayoutDecision(n > 0, "forced by channels_last_convs=True" if n else "no NCHW convolution")
    if override is False:
        return LayoutDecision(False, "forced by channels_last_convs=False")
    if n == 0:
        return LayoutDecision(False, "no NCHW convolution")
    if device not in devices:
        return LayoutDecision(False, f"{device} is not in channels_last_devices")
    if n < MIN_CONVS:
        return LayoutDecision(False, f"{n} convolution(s): fewer than {MIN_CONVS} do not pay for the copies")
    if device == "cpu":
        if not inference:
            activations = sum(c.input_numel for c in convs)
            weights = sum(c.weight_numel for c in convs)
            if activations < MIN_ACTIVATIONS_PER_WEIGHT * weights:
                return LayoutDecision(False, f"training, {n} convolutions reading {activations / max(weights, 1):.2f} "
                                             f"activation elements per weight element (< {MIN_ACTIVATIONS_PER_WEIGHT})")
        return LayoutDecision(True, f"{n} convolutions on oneDNN")
    if dtype == torch.float32 and not (cudnn_tf32() if tf32 is None else tf32):
        return LayoutDecision(False, f"{n} fp32 convolutions with cuDNN's TF32 off")
    if graph_nodes >= _NODES_PER_CONV * n:
        return LayoutDecision(False, f"{n} convolutions in a graph of {graph_nodes} nodes")
    if any(c.symbolic for c in convs):
        return LayoutDecision(False, f"{n} convolutions of symbolic size")
    kinds = [c.kind for c in convs]
    if inference:
        total = sum(c.flops for c in convs)
        weighted = sum(c.flops * _GPU_RATIO[k] for c, k in zip(convs, kinds))
        counts = ", ".join(f"{kinds.count(k)} {k}" for k in _GPU_RATIO if k in kinds)
        return LayoutDecision(weighted <= total, f"{n} convolutions ({counts}): estimated channels-last time "
                                                 f"{weighted / max(total, 1.0):.2f}x NCHW")
    for kind, why in (("grouped", "grouped with several input channels per group"),
                      ("in_out", "reducing channels 2x with a k > 1 kernel")):
        if kind in kinds:
            return LayoutDecision(False, f"training, {kinds.count(kind)} of {n} convolutions {why}")
    if all(k == "small" for k in kinds):
        return LayoutDecision(False, f"training, all {n} convolutions have <= 64 channels")
    return LayoutDecision(True, f"training, {n} convolutions")
