"""Host scalars of a GPU graph moved to its device (a step every graph takes, not a pass of the
configurable pipeline: kernels cannot run without it).

Under `torch.compile(dynamic=True)` Dynamo passes a Python float it does not specialize (an
RMSNorm's epsilon, a scale attribute) as a 0-d CPU tensor input.  ATen ops accept such a tensor
next to CUDA tensors, but a Triton kernel given its pointer fails at launch ("Pointer argument
cannot be accessed from Triton (cpu tensor?)").  Each 0-d CPU input that a GPU graph computes
with (a GPU op reads it, directly or through casts) is copied to the device once per call (by
ATen: the lowering leaves a copy between devices to it), and its readers read the copy.
"""
from __future__ import annotations

import torch
import torch.fx as fx

from ._meta import create_node

aten = torch.ops.aten

# readers that want the host value itself
_HOST_READERS = frozenset({aten._local_scalar_dense.default, aten.item.default})


def move_host_scalars(gm: fx.GraphModule) -> int:
    """Copy 0-d CPU tensor inputs of a graph whose other tensors live on one GPU to that GPU;
    returns the number of inputs moved."""
    devices = {v.device for n in gm.graph.nodes if isinstance(v := n.meta.get("val"), torch.Tensor)}
    gpus = [d for d in devices if d.type != "cpu"]
    if len(gpus) != 1:
        return 0
    moved = 0
    for ph in list(gm.graph.find_nodes(op="placeholder")):
        val = ph.meta.get("val")
        if not (isinstance(val, torch.Tensor) and val.device.type == "cpu" and val.ndim == 0):
            continue
        readers = [u for u in ph.users if u.op == "call_function" and u.target not in _HOST_READERS]
        if not readers or not _feeds_device(ph, gpus[0]):
            continue
        with gm.graph.inserting_after(ph):
            copy = create_node(gm.graph, aten._to_copy.default, (ph,), {"device": gpus[0]}, meta_from=ph)
        for user in readers:
            user.replace_input_with(ph, copy)
        moved += 1
    if moved:
        gm.recompile()
    return moved


def _feeds_device(node: fx.Node, device: torch.device) -> bool:
    """Whether a GPU op reads `node`, directly or through ops on host scalars (a cast of the
    epsilon, then the add to a GPU tensor); a host scalar that only host code reads stays."""
    todo, seen = [node], set()
    while todo:
        n = todo.pop()
        for user in n.users:
            val = user.meta.get("val")
            if not isinstance(val, torch.Tensor) or user in seen:
                continue
            if val.device == device:
                return True
            if val.device.type == "cpu" and val.ndim == 0:
                seen.add(user)
                todo.append(user)
    return False
