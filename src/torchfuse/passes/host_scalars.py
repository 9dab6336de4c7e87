"""Host tensors of a GPU graph moved to its device (a step every graph takes, not a pass of the
configurable pipeline: kernels cannot run without it).

Under `torch.compile(dynamic=True)` Dynamo passes a Python float it does not specialize (an
RMSNorm's epsilon, a scale attribute) as a 0-d CPU tensor input.  ATen ops accept such a tensor
next to CUDA tensors, but a Triton kernel given its pointer fails at launch ("Pointer argument
cannot be accessed from Triton (cpu tensor?)").  Each 0-d CPU input that a GPU graph computes
with (a GPU op reads it, directly or through casts) is copied to the device once per call (by
ATen: the lowering leaves a copy between devices to it), and its readers read the copy.

Inputs are not the only host tensors a GPU graph holds: a constant the graph made
(`torch.tensor(2.0)`, lifted to a CPU attribute), an op the graph computes on the host (an ATen
fallback such as `torch.full((), v)` without a device, or `x.cpu()`) and a CPU index tensor
(eager indexes a CUDA tensor with one) are copied the same way where a GPU op reads them: 0-d
tensors for every reader that is not host code, others for their GPU readers.
"""
from __future__ import annotations

import torch
import torch.fx as fx

from ._meta import create_node, fake_mode_of

aten = torch.ops.aten

# readers that want the host value itself
_HOST_READERS = frozenset({aten._local_scalar_dense.default, aten.item.default})


def move_host_scalars(gm: fx.GraphModule) -> int:
    """Copy the CPU tensors that a graph whose other tensors live on one GPU computes with on
    that GPU (inputs, constants, results of host ops, index tensors); returns the number of
    tensors moved."""
    devices = {v.device for n in gm.graph.nodes for v in _tensors(n.meta.get("val"))}
    gpus = [d for d in devices if d.type != "cpu"]
    if len(gpus) != 1:
        return 0
    moved = 0
    on_device: set[fx.Node] = set()    # copies, and host-scalar ops that now read only copies
    for node in list(gm.graph.nodes):
        if node.op not in ("placeholder", "get_attr", "call_function"):
            continue
        val = _value(gm, node)
        if not (isinstance(val, torch.Tensor) and val.device.type == "cpu"):
            continue
        inputs = [a for a in node.all_input_nodes if _tensors(a.meta.get("val"))]
        if node.op == "call_function" and inputs and all(a in on_device for a in inputs):
            # computes on the device now (a kernel, or ATen given device tensors): no second
            # copy, and its metadata says where its result lives
            with fake_mode_of(gm.graph):
                node.meta["val"] = val.to(gpus[0])
            on_device.add(node)
            continue
        if val.ndim == 0:
            # every reader but host code: a cast of the epsilon computes on the GPU too
            readers = [u for u in node.users if u.op == "call_function" and u.target not in _HOST_READERS]
            if not readers or not _feeds_device(node, gpus[0]):
                continue
        else:
            readers = [u for u in node.users if u.op == "call_function" and _on(u, gpus[0])]
            if not readers:
                continue
        if "val" not in node.meta:
            node.meta["val"] = val
        with gm.graph.inserting_after(node):
            copy = create_node(gm.graph, aten._to_copy.default, (node,), {"device": gpus[0]}, meta_from=node)
        on_device.add(copy)
        for user in readers:
            user.replace_input_with(node, copy)
        moved += 1
    if moved:
        gm.recompile()
    return moved


def _tensors(val: object) -> list[torch.Tensor]:
    if isinstance(val, torch.Tensor):
        return [val]
    if isinstance(val, (list, tuple)):
        return [v for v in val if isinstance(v, torch.Tensor)]
    return []


def _value(gm: fx.GraphModule, node: fx.Node) -> object:
    val = node.meta.get("val")
    if val is None and node.op == "get_attr":
        val = getattr(gm, node.target, None)
    return val


def _on(node: fx.Node, device: torch.device) -> bool:
    """Does `node` compute on `device` (one of its results lives there)?"""
    return any(v.device == device for v in _tensors(node.meta.get("val")))


def _feeds_device(node: fx.Node, device: torch.device) -> bool:
    """Whether a GPU op reads `node`, directly or through ops on host scalars (a cast of the
    epsilon, then the add to a GPU tensor); a host scalar that only host code reads stays."""
    todo, seen = [node], set()
    while todo:
        n = todo.pop()
        for user in n.users:
            val = user.meta.get("val")
            if _on(user, device):
                return True
            if not isinstance(val, torch.Tensor) or user in seen:
                continue
            if val.device.type == "cpu" and val.ndim == 0:
                seen.add(user)
                todo.append(user)
    return False
