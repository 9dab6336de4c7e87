"""passes/host_scalars.py: 0-d CPU inputs that a GPU graph computes with are copied to the
device once per call (a Triton kernel cannot read host memory); host-only scalars stay.  The
"GPU" here is the meta device (CI has no GPU); tests/gpu runs it on CUDA."""
from __future__ import annotations

import pytest
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


# ---- every host tensor a GPU op reads (the meta device stands for the GPU) ----------------------

GPU = "meta"


def _trace(fn, *args):
    """fn's aten graph (outputs as a tuple, as AOTAutograd gives them), traced with fake tensors."""
    from torch.fx.experimental.proxy_tensor import make_fx
    return make_fx(lambda *a: (fn(*a),), tracing_mode="fake")(*args)


def _fake_inputs(*specs):
    """(shape, dtype, device) -> fake tensors."""
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    with mode:
        return [torch.randn(s, device=d).to(dt) if dt.is_floating_point else torch.zeros(s, dtype=dt, device=d)
                for s, dt, d in specs]


def _host_reads_of_gpu_ops(gm: fx.GraphModule) -> list[str]:
    """GPU ops (a result on the GPU) reading a CPU tensor, other than the copies to the GPU."""
    bad = []
    for n in gm.graph.nodes:
        val = n.meta.get("val")
        if n.op != "call_function" or n.target is aten._to_copy.default:
            continue
        if not (isinstance(val, torch.Tensor) and val.device.type == GPU):
            continue
        for a in n.all_input_nodes:
            v = a.meta.get("val") if a.op != "get_attr" else getattr(gm, a.target)
            if isinstance(v, torch.Tensor) and v.device.type == "cpu":
                bad.append(f"{n.name} reads {a.name}")
    return bad


_CONSTANT = torch.tensor(2.5)
_CONSTANT_INT = torch.tensor(3)

HOST_TENSOR_PROGRAMS = {
    # a 0-d CPU input scaling a CUDA tensor, and a 0-d CPU index
    "input_scalar_and_index": (lambda x, s, i: x * s + x[i[None]], [((4, 8), torch.float32, GPU),
                                                               ((), torch.float32, "cpu"), ((), torch.int64, "cpu")]),
    # a constant the graph made (lifted to a CPU attribute) and host math on it
    "constant": (lambda x: x * _CONSTANT + _CONSTANT_INT * _CONSTANT,
                 [((4, 8), torch.float32, GPU)]),
    # a host op without a device (ATen computes it on the CPU)
    "host_full": (lambda x: x + torch.full((), 1.5), [((4, 8), torch.float32, GPU)]),
    # a 1-d CPU index tensor: eager indexes a CUDA tensor with it
    "index_tensor": (lambda x, i: x[i] * 2, [((5, 8), torch.float32, GPU), ((3,), torch.int64, "cpu")]),
    # host ops made into an index and an operand
    "host_index": (lambda x: x[torch.full((1,), 1, dtype=torch.int64)] + torch.scalar_tensor(2.0),
                   [((4, 8), torch.float32, GPU)]),
}


@pytest.mark.parametrize("name", sorted(HOST_TENSOR_PROGRAMS))
def test_no_gpu_op_reads_a_host_tensor(name):
    fn, specs = HOST_TENSOR_PROGRAMS[name]
    gm = _trace(fn, *_fake_inputs(*specs))
    assert _host_reads_of_gpu_ops(gm), "the program does not exercise the pass"
    assert move_host_scalars(gm) >= 1
    assert not _host_reads_of_gpu_ops(gm), gm.print_readable(print_output=False)


@pytest.mark.parametrize("name", sorted(HOST_TENSOR_PROGRAMS))
def test_no_kernel_of_a_gpu_graph_reads_host_memory(name):
    """Lowered and scheduled after the pass, no kernel of the GPU graph reads a buffer on the
    CPU: every kernel argument is a device tensor (what pipeline.foreign_reads
    checks before code generation)."""
    from torchfuse.config import Config
    from torchfuse.lowering.graph import lower_graph
    from torchfuse.pipeline import foreign_reads
    from torchfuse.scheduler.fusion import buffer_readers, schedule
    from torchfuse.scheduler.loops import plan_loops

    fn, specs = HOST_TENSOR_PROGRAMS[name]
    gm = _trace(fn, *_fake_inputs(*specs))
    move_host_scalars(gm)
    config = Config.from_options({})
    program, _ = lower_graph(gm, config)
    sched = schedule(program, config)
    readers = buffer_readers(sched, program)
    plans = [plan_loops(k, readers, split=False) for k in sched.kernels]
    assert plans, "no kernel: nothing checked"
    assert not [f for p in plans for f in foreign_reads(program, p, GPU)]


def test_foreign_reads_names_a_host_buffer():
    """The check is not vacuous: without the pass a kernel of the graph reads the CPU constant."""
    from torchfuse.config import Config
    from torchfuse.lowering.graph import lower_graph
    from torchfuse.pipeline import foreign_reads
    from torchfuse.scheduler.fusion import buffer_readers, schedule
    from torchfuse.scheduler.loops import plan_loops

    fn, specs = HOST_TENSOR_PROGRAMS["index_tensor"]
    gm = _trace(fn, *_fake_inputs(*specs))
    config = Config.from_options({})
    program, _ = lower_graph(gm, config)
    sched = schedule(program, config)
    readers = buffer_readers(sched, program)
    found = [f for k in sched.kernels for f in foreign_reads(program, plan_loops(k, readers, split=False), GPU)]
    assert found and all("(cpu)" in f for f in found)
