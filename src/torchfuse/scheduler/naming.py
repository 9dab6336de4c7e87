"""Kernel names that say what a kernel does: `<kind>_fused_<ops>_<n>`.

The scheduler numbers kernels as it forms them (`kernel3`, `kernel3_part` after a split).  Once
the schedule is final each is renamed after the ops it fuses, in program order, the way Inductor
names its kernels (`triton_poi_fused_add_relu_0`): `poi_fused_add_mul_relu_0`,
`red_fused_native_layer_norm_gelu_1`, `red_fused_sum_2_part` (a split reduction's partials).
The ops are the user's, before decomposition: each fx node's `original_aten` (recorded by
make_fx, so by AOTAutograd and the lazy mode, for the ops a decomposition produced), else the
node's own op.  The names are what the profiler shows (Triton kernels by their
function name, C++ kernels through the wrapper's profiled path), what `explain()` lists and what
the debug folder's sources define.  Short (the first MAX_OPS distinct ops), deterministic
(from the graph alone) and unique within a graph (the trailing index).
"""
from __future__ import annotations

import re
from typing import Mapping

import torch.fx as fx

from .fusion import Kernel, Schedule

MAX_OPS = 5
_SUFFIX = re.compile(r"_\d+$")


def op_of(origin: str) -> str:
    """The op an fx node name stands for: `mul_3` -> `mul`, `_to_copy_1` -> `to_copy`."""
    return _SUFFIX.sub("", origin).strip("_") or "op"


def user_ops(graph: fx.Graph) -> dict[str, str]:
    """node name -> the name of the op the user's program had there before decomposition
    (`native_layer_norm` for each node of its decomposition), for the nodes that record one."""
    out = {}
    for node in graph.nodes:
        original = node.meta.get("original_aten")
        name = getattr(original, "_opname", None)     # an OpOverload's op: "_softmax", "gelu"
        if isinstance(name, str) and name.strip("_"):
            out[node.name] = name.strip("_")
    return out


def kernel_name(kernel: Kernel, index: int, ops_of: Mapping[str, str] | None = None) -> str:
    ops: list[str] = []
    for origin in kernel.origins:
        op = ((ops_of or {}).get(origin) or op_of(origin))[:32]    # (native_batch_norm_backward: 26)
        if op not in ops:
            ops.append(op)
    kind = "red" if kernel.kind == "reduction" else "poi"
    shown = "_".join(ops[:MAX_OPS]) or "copy"
    # a split reduction's partial / final-epilogue kernels keep saying so
    role = next((r for r in ("_part", "_post") if kernel.name.endswith(r)), "")
    return f"{kind}_fused_{shown}_{index}{role}"


def name_kernels(sched: Schedule, ops_of: Mapping[str, str] | None = None) -> Schedule:
    """Rename the schedule's kernels after their ops (in place; `ops_of`: see `user_ops`), and
    the refused-fusion reasons that mention them; returns the schedule."""
    renamed: dict[str, str] = {}
    for i, kernel in enumerate(sched.kernels):
        new = kernel_name(kernel, i, ops_of)
        renamed[kernel.name] = new
        kernel.name = new
    if renamed and sched.refused:
        # longest first: kernel1_part before kernel1
        pattern = re.compile("|".join(rf"\b{re.escape(k)}\b" for k in sorted(renamed, key=len, reverse=True)))
        sched.refused = [pattern.sub(lambda m: renamed[m.group(0)], r) for r in sched.refused]
    return sched
