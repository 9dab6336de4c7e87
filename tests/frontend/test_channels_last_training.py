"""CNN training steps on channels-last activations (frontend/channels_last_training.py): the
rewrite happens on Dynamo's graph, AOTAutograd derives forward and backward from it; results,
gradients, running statistics and output strides are eager's."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

from torchfuse import counters
from torchfuse.frontend.channels_last_training import MIN_ACTIVATIONS_PER_WEIGHT


class ConvNet(nn.Module):
    """conv-bn-relu blocks, a depthwise one, a concat and a residual; `flatten_with_view`:
    the head flattens with .view (which a channels-last activation does not allow)."""

    def __init__(self, width: int = 8, flatten_with_view: bool = False, map_out: bool = False):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, width, 3, padding=1), nn.BatchNorm2d(width), nn.ReLU())
        self.dw = nn.Sequential(nn.Conv2d(width, width, 3, padding=1, groups=width), nn.BatchNorm2d(width), nn.ReLU())
        self.pw = nn.Conv2d(2 * width, width, 1)
        self.head = nn.Linear(width * 4, 5)
        self.flatten_with_view, self.map_out = flatten_with_view, map_out

    def forward(self, x):
        y = self.stem(x)
        z = self.dw(y)
        y = self.pw(torch.cat([y, z], 1)) + y
        if self.map_out:
            return y            # a 4-d output: eager's strides (contiguous) expected
        y = nn.functional.adaptive_avg_pool2d(y, 2)
        y = y.view(y.shape[0], -1) if self.flatten_with_view else torch.flatten(y, 1)
        return self.head(y)


def _step(model, x):
    out = model(x)
    out.square().mean().backward()
    return out


def _check(model: nn.Module, x: torch.Tensor, relaid: int) -> None:
    ref = copy.deepcopy(model)
    before = counters["channels_last_training"]
    compiled = torch.compile(model, backend="torchfuse")
    for _ in range(2):              # the second step reads the running stats the first updated
        model.zero_grad()
        ref.zero_grad()
        out, expected = _step(compiled, x), _step(ref, x)
        torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-5)
        assert out.stride() == expected.stride()
        for (name, p), r in zip(model.named_parameters(), ref.parameters()):
            torch.testing.assert_close(p.grad, r.grad, rtol=2e-3, atol=1e-4, msg=name)
        for b, r in zip(model.buffers(), ref.buffers()):
            torch.testing.assert_close(b, r, rtol=1e-4, atol=1e-5)
    assert counters["channels_last_training"] - before == relaid


def test_training_step_runs_channels_last_with_eagers_gradients():
    _check(ConvNet(), torch.randn(4, 3, 16, 16), relaid=1)


def test_four_d_output_keeps_eagers_strides():
    _check(ConvNet(map_out=True), torch.randn(3, 3, 10, 12), relaid=1)


def test_view_that_needs_nchw_falls_back_to_the_graph_as_it_was():
    """AOTAutograd cannot trace .view(n, -1) of a channels-last activation: the rewrite is
    undone (net count 0) and the step still matches eager."""
    _check(ConvNet(flatten_with_view=True), torch.randn(4, 3, 16, 16), relaid=0)


def test_weights_heavier_than_activations_stay_nchw():
    """64-channel 3x3 convs on a 4x4 image: 36,864 weight elements per conv against 2,048 input
    elements, well under MIN_ACTIVATIONS_PER_WEIGHT: the copies of the weights would cost more."""
    model = nn.Sequential(*[m for _ in range(3) for m in (nn.Conv2d(64, 64, 3, padding=1), nn.ReLU())],
                          nn.Flatten(), nn.Linear(64 * 16, 3))
    x = torch.randn(2, 64, 4, 4)
    assert x.numel() < MIN_ACTIVATIONS_PER_WEIGHT * 64 * 64 * 9
    _check(model, x, relaid=0)


def test_inference_and_eval_graphs_are_left_to_the_aten_pass():
    model = ConvNet().eval()
    before = counters["channels_last_training"]
    with torch.no_grad():
        out = torch.compile(model, backend="torchfuse")(torch.randn(2, 3, 8, 8))
    assert out.shape == (2, 5)
    assert counters["channels_last_training"] == before


@pytest.mark.parametrize("option", [{"channels_last_devices": ()}, {"passes": ("dce", "cse")}])
def test_switched_off_with_the_aten_pass(option):
    model, x = ConvNet(), torch.randn(2, 3, 8, 8)
    before = counters["channels_last_training"]
    _step(torch.compile(model, backend="torchfuse", options=option), x)
    assert counters["channels_last_training"] == before


def test_new_batch_sizes_build_nothing():
    """The rewrite keeps batch sizes symbolic: after the first dynamic recompile (8, then 4) the
    training steps at 16 and 3 build no kernel (16 may compile a graph again, for the guard
    torch's fake convolution adds) and match eager."""
    model = ConvNet()
    ref = copy.deepcopy(model)
    compiled = torch.compile(model, backend="torchfuse")
    builds, relaid = [], counters["channels_last_training"]
    for batch in (8, 4, 16, 3):
        x = torch.randn(batch, 3, 12, 12)
        before = counters["kernel_builds"]
        model.zero_grad()
        ref.zero_grad()
        torch.testing.assert_close(_step(compiled, x), _step(ref, x), rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(model.stem[0].weight.grad, ref.stem[0].weight.grad, rtol=2e-3, atol=1e-4)
        builds.append(counters["kernel_builds"] - before)
    assert builds[2:] == [0, 0], builds
    assert counters["channels_last_training"] > relaid


def test_channels_last_copy_of_the_input_is_not_saved(monkeypatch):
    """The images' channels-last copy feeds the stem's convolution, whose weight gradient reads
    it again: the backward recomputes it from the input (held by the caller anyway) instead of
    the forward saving a second copy of the batch for the whole step."""
    import torchfuse.pipeline as cg
    saved_shapes: list[tuple[int, ...]] = []
    real = cg.compile_graph

    def spy(gm, config, *, kind, **kw):
        if kind == "forward":
            outs = next(iter(gm.graph.find_nodes(op="output"))).args[0]
            saved_shapes.extend(tuple(o.meta["val"].shape) for o in outs
                                if isinstance(o, torch.fx.Node) and o.op != "placeholder"
                                and isinstance(o.meta.get("val"), torch.Tensor))
        return real(gm, config, kind=kind, **kw)

    monkeypatch.setattr(cg, "compile_graph", spy)
    torch.manual_seed(0)
    x = torch.randn(4, 3, 12, 12)
    _check(ConvNet(), x, relaid=1)
    assert saved_shapes and tuple(x.shape) not in saved_shapes, saved_shapes


def _same_layout(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal strides where the size is not 1 (autograd's layout contract for gradients)."""
    return a.shape == b.shape and all(n == 1 or x == y for n, x, y in zip(a.shape, a.stride(), b.stride()))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("channels_last", [True, False])
def test_mixed_net_training_both_layouts(dtype, channels_last):
    """conv-bn-relu-pool, grouped, depthwise, 1 x 1 and transposed convs, odd sizes: outputs,
    their strides, input and weight gradients are eager's, and each weight gradient comes back
    in its parameter's (contiguous) layout.  Channels-last copies the input and the three k x k
    non-depthwise weights once in the forward and the 4-d output back; the backward copies the
    three weight gradients and the input's gradient back (no flip-flop in between)."""
    import torchfuse
    from tests.passes.test_pass_channels_last import MixedNet, layout_copies
    model = MixedNet().to(dtype)
    ref = copy.deepcopy(model)
    torch.manual_seed(1)
    x = torch.randn(2, 3, 11, 13, dtype=dtype).requires_grad_()
    e = torchfuse.explain(model, x, options={"strict": True, "channels_last_convs": channels_last})
    expected = ref(x)
    grads_out = [torch.randn_like(o) for o in expected]
    params = list(model.parameters())
    got = torch.autograd.grad(e.output, [x, *params], grads_out)
    want = torch.autograd.grad(expected, [x, *ref.parameters()], grads_out)
    tol = {"rtol": 2e-3, "atol": 1e-4} if dtype == torch.float32 else {"rtol": 5e-2, "atol": 5e-2}
    for o, r in zip(e.output, expected):
        torch.testing.assert_close(o, r, **tol)
        assert o.stride() == r.stride()
    for (name, _), g, r in zip([("x", x), *model.named_parameters()], got, want):
        torch.testing.assert_close(g, r, **tol, msg=name)
        assert _same_layout(g, r), (name, g.stride(), r.stride())
    fw = [g for g in e.graphs if "_forward: after passes" in g.splitlines()[0]]
    bw = [g for g in e.graphs if "_backward: after passes" in g.splitlines()[0]]
    assert len(fw) == len(bw) == 1
    assert layout_copies(type("E", (), {"graphs": fw})) == ((4, 1) if channels_last else (0, 0))
    assert layout_copies(type("E", (), {"graphs": bw})) == ((0, 4) if channels_last else (0, 0))
    assert e.layouts[0].split(": ")[1] == ("channels-last" if channels_last else "NCHW"), e.layouts


def test_weight_gradients_keep_the_parameters_layout():
    """Default ("auto") decision on a CPU training step: channels-last, and the weight gradients
    the compiled backward returns are contiguous like the parameters (before, they came back
    channels-last and autograd's accumulation copied each again)."""
    model, x = ConvNet(), torch.randn(4, 3, 16, 16)
    compiled = torch.compile(model, backend="torchfuse")
    before = counters["channels_last_training"]
    out = compiled(x)
    grads = torch.autograd.grad(out.square().mean(), list(model.parameters()))
    assert counters["channels_last_training"] - before == 1
    for (name, p), g in zip(model.named_parameters(), grads):
        assert _same_layout(g, p), (name, g.stride(), p.stride())
