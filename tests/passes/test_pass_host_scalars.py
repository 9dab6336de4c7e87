"""passes/host_scalars.py: 0-d CPU inputs that a GPU graph computes with are copied to the
device once per call (a Triton kernel cannot read host memory); host-only scalars stay.  The
"GPU" here is the meta device (CI has no GPU); tests/gpu runs it on CUDA."""
from __future__ import annotations

import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import FakeTensorMode

from torchfuse.passes.host_scalars import move_host_scalars

aten = torch.ops.aten


def _graph() -> fx.GraphModule:
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    g = fx.Graph()
    x, eps, count = g.placeholder("x"), g.placeholder("eps"), g.placeholder("count")
    x.meta["val"] = mode.from_tensor(torch.empty(4, 8, device="meta"))
    eps.meta["val"] = mode.from_tensor(torch.tensor(1e-6, dtype=torch.float64))
    count.meta["val"] = mode.from_tensor(torch.tensor(3))
    with mode:
        cast = g.call_function(torch.ops.prims.convert_element_type.default, (eps, torch.float32))
        cast.meta["val"] = eps.meta["val"].to(torch.float32)
        y = g.call_function(aten.add.Tensor, (x, cast))
        y.meta["val"] = x.meta["val"] + cast.meta["val"]
        doubled = g.call_function(aten.mul.Tensor, (count, 2))      # host arithmetic, read on the host
        doubled.meta["val"] = count.meta["val"] * 2
    item = g.call_function(aten._local_scalar_dense.default, (doubled,))
    g.output((y, item))
    return fx.GraphModule(torch.nn.Module(), g)


def test_host_scalar_read_by_a_device_op_is_copied_there():
    gm = _graph()
    assert move_host_scalars(gm) == 1
    by_target = {n.target: n for n in gm.graph.nodes if n.op == "call_function"}
    placeholders = {n.name: n for n in gm.graph.find_nodes(op="placeholder")}
    copy = by_target[torch.ops.prims.convert_element_type.default].args[0]
    assert copy.target is aten._to_copy.default and copy.args[0] is placeholders["eps"]
    assert copy.kwargs["device"] == torch.device("meta") and copy.meta["val"].device.type == "meta"
    # the host scalar that only host code reads stays where it is
    assert by_target[aten.mul.Tensor].args[0] is placeholders["count"]


def test_graph_without_a_device_is_left_alone():
    g = fx.Graph()
    a, s = g.placeholder("a"), g.placeholder("s")
    a.meta["val"], s.meta["val"] = torch.empty(3), torch.tensor(2.0)
    out = g.call_function(aten.mul.Tensor, (a, s))
    out.meta["val"] = a.meta["val"] * s.meta["val"]
    g.output(out)
    gm = fx.GraphModule(torch.nn.Module(), g)
    assert move_host_scalars(gm) == 0
    torch.testing.assert_close(gm(torch.ones(3), torch.tensor(2.0)), torch.full((3,), 2.0))
