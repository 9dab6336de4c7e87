"""The small value types shared by the pass manager and the passes."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class PassContext:
    """What a pass may assume about the graph it rewrites."""

    inference: bool = False
    """True when the graph is an inference graph (no autograd will run through it).  Rewrites
    that are only exact when parameters and buffers are frozen for the call (conv-bn folding,
    which changes what the backward pass would see) run only then."""

    cublas_devices: tuple[str, ...] = ("cuda",)
    """Device types whose matrix products run in cuBLAS: `pad_mm` pads them to 16-byte-aligned
    sizes, and `unfuse_addmm` / `unfuse_conv_bias` move the bias adds of matrix products and
    convolutions into the consumer kernels (CPU BLAS and oneDNN need neither)."""

    channels_last_devices: tuple[str, ...] = ("cpu", "cuda")
    """Device types whose inference convolutions may read channels-last activations
    (`channels_last_convs`, where `layout_rule.decide_layout` chooses it)."""

    channels_last: bool | str = "auto"
    """Config.channels_last_convs: True / False force the layout of every graph with
    convolutions, "auto" decides per graph (`layout_rule.decide_layout`)."""

    cudnn_tf32: bool | None = None
    """Whether cuDNN may run fp32 convolutions on TF32 tensor cores (the user's
    `torch.backends.cudnn.allow_tf32`, read when the graph is compiled; None: read by the rule)."""

    index_add_devices: tuple[str, ...] = ("cuda",)
    """Device types whose accumulating index_puts run as index_add (`accumulate_by_index_add`)."""

    fp32_matmul_tf32: bool = False
    """Whether cuBLAS may run fp32 products on TF32 tensor cores (the user's
    `torch.backends.cuda.matmul.fp32_precision`, read when the graph is compiled; off by default).
    Without them fp32 products run on CUDA cores, whose speed does not depend on alignment, and
    `pad_mm` leaves them alone."""


@dataclass
class PassRecord:
    """What one pass did: wall time, node counts before and after, and how many rewrites."""

    name: str
    seconds: float
    nodes_before: int
    nodes_after: int
    changes: int

    def __str__(self) -> str:
        return (f"{self.name:<16} {self.seconds * 1e3:.1f} ms  "
                f"{self.nodes_before} -> {self.nodes_after} nodes  ({self.changes} changes)")
