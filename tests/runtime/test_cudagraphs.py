"""mode="reduce-overhead" decisions (runtime/cudagraphs.py), on CPU: which inputs a capture takes
at their address, which graphs cannot be captured and why, the bound on captures per graph, and
that a graph that cannot be captured runs as compiled.  Graphs are traced with fake CUDA
tensors (no GPU needed); the captures themselves are tested in tests/gpu."""
from __future__ import annotations

import functools
import logging

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx
from torch.fx.experimental.symbolic_shapes import ShapeEnv

import torchfuse
from torchfuse.runtime import cudagraphs


def _trace(fn, *shapes, device="cuda"):
    with FakeTensorMode():
        args = [torch.empty(s, device=d) if isinstance(s, tuple) else s
                for s, d in zip(shapes, device if isinstance(device, (list, tuple)) else [device] * len(shapes))]
    return make_fx(fn, tracing_mode="fake")(*args)


def test_inference_graph_is_captured_with_its_parameters_static():
    gm = _trace(lambda x, w, b: torch.relu(x @ w + b), (4, 8), (8, 8), (8,))
    plan = cudagraphs.plan_capture(gm, "inference", [1, 2])
    assert plan.skip is None and plan.static == (1, 2) and plan.mutated == () and plan.device_index == 0
    assert len(plan.stack_traces) == 1 and len(plan.placeholders) == 3    # one per output, per input


def test_backward_graph_takes_saved_activations_as_static():
    def backward(primals_1, relu, tangents_1):
        return (tangents_1 * (relu > 0)) @ primals_1.t(), None

    gm = _trace(backward, (8, 8), (4, 8), (4, 8))
    names = [n.name for n in gm.graph.find_nodes(op="placeholder")]
    plan = cudagraphs.plan_capture(gm, "backward", [])
    assert plan.skip is None
    assert plan.static == tuple(i for i, n in enumerate(names) if "tangents" not in n) == (0, 1), names


def test_cpu_tensor_is_not_captured():
    gm = _trace(lambda x, s: x * s, (4, 8), (), device=["cuda", "cpu"])
    plan = cudagraphs.plan_capture(gm, "inference", [])
    assert plan.skip is not None and "cpu tensor" in plan.skip, plan


def test_no_cuda_tensors_is_not_captured():
    gm = _trace(lambda x: x.sin(), (4, 8), device="cpu")
    assert cudagraphs.plan_capture(gm, "inference", []).skip == "the graph has no CUDA tensors"


def test_mutated_input_must_be_static():
    def step(x, running):
        running.mul_(0.9).add_(x.mean(0))
        return x * 2

    gm = _trace(step, (4, 8), (8,))
    user = cudagraphs.plan_capture(gm, "inference", [])
    assert user.mutated == (1,) and user.skip is not None and "mutates input 1" in user.skip, user
    buffer = cudagraphs.plan_capture(gm, "inference", [1])      # a module buffer: fine
    assert buffer.mutated == (1,) and buffer.skip is None, buffer


def test_data_dependent_shape_is_not_captured():
    """(A node whose value has an unbacked size, as nonzero() gives; set by hand, as fake CUDA
    tensors cannot run nonzero without a GPU.)"""
    gm = _trace(lambda x: x.sin(), (4, 8))
    shape_env = ShapeEnv()
    with FakeTensorMode(shape_env=shape_env):
        value = torch.empty(shape_env.create_unbacked_symint(), 2, device="cuda")
    next(n for n in gm.graph.nodes if n.op == "call_function").meta["val"] = value
    plan = cudagraphs.plan_capture(gm, "inference", [])
    assert plan.skip is not None and "data-dependent" in plan.skip, plan


def test_captures_per_graph_are_bounded(caplog):
    """Past `cudagraph_max_sizes` distinct integer (dynamic size) inputs, new sizes run uncaptured,
    logged once; sizes already captured keep replaying."""
    ran: list[tuple[str, int]] = []
    bounded = cudagraphs._Bounded(lambda a: ran.append(("captured", a[1])), lambda a: ran.append(("plain", a[1])),
                                  limit=2, name="a forward graph")
    with caplog.at_level(logging.WARNING, logger="torchfuse.cudagraphs"):
        for n in (3, 5, 7, 3, 9, 5):
            bounded([torch.zeros(1), n])
    assert ran == [("captured", 3), ("captured", 5), ("plain", 7), ("captured", 3), ("plain", 9), ("captured", 5)]
    assert sum("cudagraph_max_sizes" in r.message for r in caplog.records) == 1
    # still boxed once Dynamo wraps it (functools.wraps copies the instance's __dict__ only)
    assert functools.wraps(bounded)(lambda args: None).__dict__.get("_boxed_call") is True


def test_skipped_graph_runs_as_compiled_and_backward_tells_the_trees():
    def call(args):
        return tuple(args)

    gm = _trace(lambda x: x.sin(), (4,), device="cpu")
    plan = cudagraphs.plan_capture(gm, "forward", [])
    state = cudagraphs.TrainingState()
    assert cudagraphs.wrap(call, plan, state, 8, "a forward graph") is call and not state.forward_captured
    backward = cudagraphs.CapturePlan("backward", (), (), 0, "it uses a cpu tensor (x)")
    assert cudagraphs.wrap(call, backward, state, 8, "a backward graph") is call
    state.forward_captured = True     # the forward was captured: the trees must hear of the backward
    assert cudagraphs.wrap(call, backward, state, 8, "a backward graph") is not call


def test_reduce_overhead_on_cpu_matches_eager(caplog):
    """On a CPU model the mode compiles as usual, says once per graph why nothing is captured,
    and trains as eager does."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 4))
    ref = [p.detach().clone().requires_grad_() for p in model.parameters()]
    compiled = torchfuse.compile(model, mode="reduce-overhead")
    x = torch.randn(8, 16)
    with caplog.at_level(logging.WARNING, logger="torchfuse.cudagraphs"):
        compiled(x).square().sum().backward()
    eager = torch.nn.functional.linear(torch.nn.functional.gelu(torch.nn.functional.linear(x, ref[0], ref[1])),
                                       ref[2], ref[3])
    eager.square().sum().backward()
    for p, r in zip(model.parameters(), ref):
        torch.testing.assert_close(p.grad, r.grad, rtol=1e-4, atol=1e-5)
    reasons = [r.message for r in caplog.records if "without CUDA graphs" in r.message]
    assert len(reasons) == 2 and all("no CUDA tensors" in m for m in reasons), reasons


@pytest.mark.parametrize("value", [0, 3])
def test_max_sizes_is_a_config_option(value):
    assert torchfuse.config.Config.from_options({"cudagraph_max_sizes": value}).cudagraph_max_sizes == value
