"""oneDNN convolutions of channels-last CPU graphs with their weights reordered once.

`aten.convolution` on the CPU hands oneDNN a plain tensor as the weight, which oneDNN reorders
to its blocked format in every call: a pass over the whole weight, which in a small-batch
inference step costs more than the convolution where the weight outweighs the activations
(ResNet's last stages at batch 4: a 512 x 512 x 3 x 3 convolution on 2 x 2 maps takes 3.2 ms
with a channels-last weight, 1.9 ms with an NCHW one, 0.9 ms with the weight reordered once;
fp32, one thread).  So a channels-last graph's dense k x k fp32 convolutions with large
weights (MIN_WEIGHT) call oneDNN's
`mkldnn._convolution_pointwise` (Inductor's op when it freezes weights) with the weight reordered
once and kept beside it, keyed by the weight tensor and its version counter: the hoisted
channels-last copy of a parameter (or folded conv-bn weight) lives as long as the compiled graph
and changes only when it is recomputed.  A weight whose version moves (trained in place) is
not kept: it is reordered by ATen in every call as before.  The kept copy is one more copy of
each such weight in memory.

The wrapper calls `convolution` only where the lowering expects a channels-last output (the op
always returns one); anything else (autograd, other dtypes, 1 x 1, depthwise and small
weights, whose reorder is cheap and which ATen may run outside oneDNN) goes to ATen.
"""
from __future__ import annotations

import math
from typing import Any, Sequence

import torch
from torch.utils.weak import WeakIdKeyDictionary

__all__ = ["convolution", "packed_weights"]

# Weights smaller than this (elements) keep ATen's call: their reorder is a few microseconds,
# and the reordered call measured the same or up to 5% slower on activation-heavy convolutions
# (64 x 64 x 3 x 3 on 32 x 32 maps); from 128 x 128 x 3 x 3 on it was 8-70% faster at batch 4.
MIN_WEIGHT = 65536

_packed: WeakIdKeyDictionary = WeakIdKeyDictionary()
# a weight whose version moved between calls: not worth keeping a reordered copy of
_VOLATILE = (None, None)


def _available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_convolution_pointwise")


_AVAILABLE = _available()
_POINTWISE = torch.ops.mkldnn._convolution_pointwise.default if _AVAILABLE else None
_REORDER = torch.ops.mkldnn._reorder_convolution_weight.default if _AVAILABLE else None


def packed_weights() -> int:
    """How many reordered weights are kept (for tests)."""
    return sum(1 for v in _packed.values() if v is not _VOLATILE)


def _eligible(x: torch.Tensor, w: torch.Tensor, transposed: bool) -> bool:
    return (_AVAILABLE and not transposed and x.dtype is torch.float32 and w.dtype is torch.float32
            and w.dim() == 4 and x.dim() == 4 and x.device.type == "cpu" and w.shape[1] > 1
            and (w.shape[2] > 1 or w.shape[3] > 1) and torch._C._get_mkldnn_enabled()
            and not (torch.is_grad_enabled() and (x.requires_grad or w.requires_grad)))


def convolution(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, stride: Sequence[int],
                padding: Sequence[int], dilation: Sequence[int], transposed: bool,
                output_padding: Sequence[int], groups: int) -> torch.Tensor:
    """`aten.convolution` with the arguments of the op; see the module docstring."""
    if _eligible(x, w, transposed):
        key = (w._version, tuple(stride), tuple(padding), tuple(dilation), groups, tuple(x.shape))
        entry = _packed.get(w)
        if entry is not None and entry is not _VOLATILE and entry[0][0] != key[0]:
            entry = _packed[w] = _VOLATILE          # changed in place since it was reordered
        if entry is not _VOLATILE:
            if entry is None or entry[0] != key:    # (first call, or another input shape)
                entry = _packed[w] = (key, _REORDER(
                    w, list(padding), list(stride), list(dilation), groups, list(x.shape)))
            return _POINTWISE(x, entry[1], b, list(padding), list(stride), list(dilation), groups, "none", [], "")
    return torch.convolution(x, w, b, stride, padding, dilation, transposed, output_padding, groups)


def use_packed(output_sizes: Sequence[Any], output_strides: Sequence[Any], device: Any,
               weight_sizes: Sequence[Any], dtype: Any) -> bool:
    """Whether the wrapper calls `convolution` for an aten convolution whose output buffer has
    these sizes, strides (IR nodes), device and dtype, and whose weight these sizes: a 4-d
    channels-last fp32 CPU output and a dense k x k weight of MIN_WEIGHT elements or more (the
    others would only pay the call's checks, ~2 us)."""
    from ..ir.buffers import is_row_major
    if not _AVAILABLE or getattr(device, "type", device) != "cpu" or dtype is not torch.float32 \
            or len(output_sizes) != 4 or len(weight_sizes) != 4:
        return False
    known = [s.arg if getattr(s, "op", None) == "const" else None for s in weight_sizes]
    if None in known or known[1] <= 1 or known[2] * known[3] <= 1 or math.prod(known) < MIN_WEIGHT:
        return False
    n, c, h, w = output_sizes
    sn, sc, sh, sw = output_strides
    return is_row_major((n, h, w, c), (sn, sh, sw, sc)) and not is_row_major(output_sizes, output_strides)
