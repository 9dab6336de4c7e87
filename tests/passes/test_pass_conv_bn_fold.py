"""Folding inference batch norms into convolutions."""
from __future__ import annotations

import pytest
import torch
import torch.fx as fx
from torch._functorch.aot_autograd import aot_module_simplified
from torch._subclasses.fake_tensor import FakeTensorMode

from _passes_helpers import count, run, trace
from torchfuse.passes._meta import create_node

aten = torch.ops.aten
BN_OPS = [aten._native_batch_norm_legit_no_training.default, aten.native_batch_norm.default,
          aten._native_batch_norm_legit.default, aten.batch_norm.default]


def _n_bn(gm):
    return sum(count(gm, t) for t in BN_OPS)


def _randomize_bn(bn):
    with torch.no_grad():
        bn.running_mean.uniform_(-1, 1)
        bn.running_var.uniform_(0.25, 2)
        if bn.weight is not None:
            bn.weight.uniform_(0.5, 2)
            bn.bias.uniform_(-1, 1)
    return bn


class _Tuple(torch.nn.Module):
    """aot_module_simplified wants tuple outputs."""
    def __init__(self, m):
        super().__init__()
        self.m = m

    def forward(self, x):
        return (self.m(x),)


def aot_inference_graph(m, x):
    """The forward graph AOTAutograd hands a backend for `m(x)` under no_grad, and its args."""
    captured = {}

    def fw(gm, args):
        captured["gm"] = gm
        return gm
    with torch.no_grad():
        aot_module_simplified(torch.fx.symbolic_trace(_Tuple(m)), [x], fw_compiler=fw)(x)
    return captured["gm"], [*m.parameters(), *m.buffers(), x]


CASES = {
    "conv2d": lambda: torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.BatchNorm2d(8)),
    "no_conv_bias": lambda: torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3, bias=False), torch.nn.BatchNorm2d(8)),
    "groups": lambda: torch.nn.Sequential(torch.nn.Conv2d(4, 8, 3, groups=2, stride=2), torch.nn.BatchNorm2d(8)),
    "depthwise_no_affine": lambda: torch.nn.Sequential(torch.nn.Conv2d(4, 4, 3, groups=4),
                                                       torch.nn.BatchNorm2d(4, affine=False)),
    "conv1d": lambda: torch.nn.Sequential(torch.nn.Conv1d(4, 6, 3), torch.nn.BatchNorm1d(6), torch.nn.ReLU()),
    "conv3d": lambda: torch.nn.Sequential(torch.nn.Conv3d(2, 4, 2), torch.nn.BatchNorm3d(4)),
}
INPUTS = {"conv1d": (2, 4, 10), "conv3d": (2, 2, 5, 5, 5), "groups": (2, 4, 9, 9), "depthwise_no_affine": (2, 4, 8, 8)}


@pytest.mark.parametrize("name", list(CASES))
def test_fold_aot_inference_graph(name):
    torch.manual_seed(0)
    m = CASES[name]()
    _randomize_bn(m[1]).eval()
    x = torch.randn(*INPUTS.get(name, (2, 3, 8, 8)))
    gm, args = aot_inference_graph(m, x)
    assert _n_bn(gm) == 1
    assert run(gm, "conv_bn_fold", "dce", inference=True) == 1
    assert _n_bn(gm) == 0 and count(gm, aten.convolution.default) == 1
    with torch.no_grad():
        torch.testing.assert_close(gm(*args)[0], m(x), atol=1e-5, rtol=1e-5)


def test_fold_make_fx_native_batch_norm_channels_last():
    m = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.BatchNorm2d(8))
    _randomize_bn(m[1]).eval()
    params = {**dict(m.named_parameters()), **dict(m.named_buffers())}

    def f(p, x):
        return torch.func.functional_call(m, p, (x,))
    x = torch.randn(2, 3, 8, 8).to(memory_format=torch.channels_last)
    gm = trace(f, params, x)
    assert count(gm, aten.native_batch_norm.default) == 1
    assert run(gm, "conv_bn_fold", inference=True) == 1
    assert _n_bn(gm) == 0
    out = gm(params, x)
    with torch.no_grad():
        torch.testing.assert_close(out, m(x), atol=1e-5, rtol=1e-5)
    assert out.is_contiguous(memory_format=torch.channels_last)


def test_fold_batch_norm_default_and_half_conv():
    # aten.batch_norm (training=False) after a half-precision conv with float32 bn parameters
    g = fx.Graph()
    mode = FakeTensorMode()
    real = {"x": torch.randn(2, 3, 6, 6).half(), "w": torch.randn(4, 3, 3, 3).half(),
            "gamma": torch.rand(4) + 0.5, "beta": torch.randn(4), "mean": torch.randn(4),
            "var": torch.rand(4) + 0.5}
    ph = {}
    for k, v in real.items():
        ph[k] = g.placeholder(k)
        ph[k].meta["val"] = mode.from_tensor(v)
    conv = create_node(g, aten.convolution.default, (ph["x"], ph["w"], None, [1, 1], [1, 1], [1, 1], False, [0, 0], 1))
    bn = create_node(g, aten.batch_norm.default, (conv, ph["gamma"], ph["beta"], ph["mean"], ph["var"], False,
                                                   0.1, 1e-3, False))
    g.output((bn,))
    gm = fx.GraphModule(torch.nn.Module(), g)
    expected = gm(*real.values())[0]
    assert run(gm, "conv_bn_fold", inference=True) == 1
    assert _n_bn(gm) == 0
    out = gm(*real.values())[0]
    assert out.dtype == torch.float16
    torch.testing.assert_close(out.float(), expected.float(), atol=2e-2, rtol=2e-2)


def test_no_fold_in_training_graphs():
    m = CASES["conv2d"]()
    _randomize_bn(m[1]).eval()
    gm, _ = aot_inference_graph(m, torch.randn(2, 3, 8, 8))
    assert run(gm, "conv_bn_fold", inference=False) == 0
    assert _n_bn(gm) == 1


def test_no_fold_when_bn_is_training():
    m = CASES["conv2d"]()
    params = {**dict(m.named_parameters()), **dict(m.named_buffers())}
    gm = trace(lambda p, x: torch.func.functional_call(m, p, (x,)), params, torch.randn(2, 3, 8, 8))
    assert run(gm, "conv_bn_fold", inference=True) == 0
    assert _n_bn(gm) == 1


def test_no_fold_transposed_conv():
    m = torch.nn.Sequential(torch.nn.ConvTranspose2d(3, 8, 3), torch.nn.BatchNorm2d(8))
    _randomize_bn(m[1]).eval()
    x = torch.randn(2, 3, 5, 5)
    gm, args = aot_inference_graph(m, x)
    assert run(gm, "conv_bn_fold", inference=True) == 0
    assert _n_bn(gm) == 1
    with torch.no_grad():
        torch.testing.assert_close(gm(*args)[0], m(x))


def test_no_fold_when_conv_has_other_users():
    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.conv, self.bn = torch.nn.Conv2d(3, 8, 3), _randomize_bn(torch.nn.BatchNorm2d(8))

        def forward(self, x):
            y = self.conv(x)
            return self.bn(y) + y
    m = M().eval()
    x = torch.randn(2, 3, 8, 8)
    gm, args = aot_inference_graph(m, x)
    assert run(gm, "conv_bn_fold", inference=True) == 0
    assert _n_bn(gm) == 1
    with torch.no_grad():
        torch.testing.assert_close(gm(*args)[0], m(x))


def test_meta_vals_on_new_nodes():
    m = CASES["conv2d"]()
    _randomize_bn(m[1]).eval()
    gm, args = aot_inference_graph(m, torch.randn(2, 3, 8, 8))
    run(gm, "conv_bn_fold", "dce", inference=True)
    for n in gm.graph.nodes:
        if n.op == "call_function":
            val = n.meta["val"]
            assert isinstance(val, torch.Tensor) and val.dtype == torch.float32
    conv = next(n for n in gm.graph.nodes if n.target is aten.convolution.default)
    assert tuple(conv.meta["val"].shape) == (2, 8, 8, 8)
