"""The per-graph layout decision (src/torchfuse/passes/layout_rule.py): the rule on described
convolutions for CPU and CUDA graphs, the option that overrides it, and the decision as the
inference pass and the training rewrite take it on real graphs (listed by explain())."""
from __future__ import annotations

import logging

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import torchfuse
from torchfuse.passes.layout_rule import ConvInfo, decide_layout


def _conv(cin: int, cout: int, k: int = 3, groups: int = 1, hw: int = 28, batch: int = 8, transposed: bool = False):
    weight = (cin if not transposed else cout) // groups * (cout if not transposed else cin) * k * k
    return ConvInfo(cin, cout, groups, (k, k), transposed, batch * cin * hw * hw, batch * cout * hw * hw, weight)


DENSE = [_conv(128, 128) for _ in range(6)]                      # a ResNet stage
DEPTHWISE = [_conv(96, 96, groups=96) for _ in range(4)]         # MobileNet's depthwise convs
# ResNeXt bottlenecks: 1 x 1 convs around a grouped 3 x 3 with 4 input channels per group
GROUPED = [c for _ in range(3) for c in (_conv(256, 128, k=1), _conv(128, 128, groups=32), _conv(128, 256, k=1))]


def _decide(convs, device, dtype=torch.float32, inference=True, **kw):
    return decide_layout(convs, device=device, dtype=dtype, inference=inference, **kw)


@pytest.mark.parametrize("inference", [True, False])
def test_many_dense_convolutions_go_channels_last(inference):
    assert _decide(DENSE, "cpu", inference=inference).channels_last
    assert _decide(DENSE, "cuda", torch.bfloat16, inference=inference).channels_last
    assert _decide(DENSE, "cuda", inference=inference, tf32=True).channels_last


def test_fp32_without_tf32_stays_nchw_on_cuda_only():
    d = _decide(DENSE, "cuda", tf32=False)
    assert not d.channels_last and "TF32" in d.reason, d
    assert _decide(DENSE, "cpu", tf32=False).channels_last
    assert _decide(DENSE, "cuda", torch.float16, tf32=False).channels_last


def test_one_or_two_convolutions_stay_nchw():
    for device in ("cpu", "cuda"):
        for convs in (DENSE[:1], DENSE[:2]):
            d = _decide(convs, device, torch.bfloat16)
            assert not d.channels_last and d.convs == len(convs), d


def test_only_depthwise_convolutions_in_fp32():
    """oneDNN's depthwise kernels are faster channels-last; on CUDA, fp32 without TF32 is
    NCHW, and with TF32 depthwise counts as a small-channel conv (Inductor's 0.78x)."""
    assert _decide(DEPTHWISE, "cpu").channels_last
    assert not _decide(DEPTHWISE, "cuda", tf32=False).channels_last
    assert _decide(DEPTHWISE, "cuda", tf32=True).channels_last


def test_grouped_convolutions_on_cuda():
    """ResNeXt's grouped 3 x 3 convs (several input channels per group) are slower
    channels-last: inference weighs them by FLOPs, training stays NCHW as soon as one is there."""
    infer = _decide(GROUPED, "cuda", torch.bfloat16)
    assert infer.channels_last and "3 grouped" in infer.reason, infer      # most FLOPs in the 1 x 1 convs
    train = _decide(GROUPED, "cuda", torch.bfloat16, inference=False)
    assert not train.channels_last and "grouped" in train.reason, train
    heavy = [_conv(256, 256, groups=2) for _ in range(4)]                    # all FLOPs grouped: 1.36x
    assert not _decide(heavy, "cuda", torch.bfloat16).channels_last
    assert _decide(GROUPED, "cpu", inference=False).channels_last           # oneDNN: grouped convs too


def test_cuda_training_rules():
    small = [_conv(32, 32) for _ in range(4)]
    assert not _decide(small, "cuda", torch.bfloat16, inference=False).channels_last
    decoder = DENSE + [_conv(256, 64)]
    assert not _decide(decoder, "cuda", torch.bfloat16, inference=False).channels_last
    assert not _decide(DENSE, "cuda", torch.bfloat16, graph_nodes=300 * len(DENSE)).channels_last


def test_cpu_training_weights_heavier_than_activations_stay_nchw():
    heavy = [_conv(64, 64, hw=4, batch=2) for _ in range(3)]
    assert not _decide(heavy, "cpu", inference=False).channels_last
    assert _decide(heavy, "cpu", inference=True).channels_last


def test_option_forces_and_devices_gate():
    assert _decide(DENSE[:1], "cuda", override=True, tf32=False).channels_last
    assert not _decide(DENSE, "cpu", override=False).channels_last
    assert not _decide(DENSE, "cpu", devices=("cuda",)).channels_last
    assert not _decide([], "cpu", override=True).channels_last


def test_config_option_values():
    assert torchfuse.Config.from_options().channels_last_convs == "auto"
    for value in (True, False, "auto"):
        assert torchfuse.Config.from_options({"channels_last_convs": value}).channels_last_convs is value or value == "auto"
    for bad in ("yes", 1, None):
        with pytest.raises(ValueError, match="channels_last_convs"):
            torchfuse.Config.from_options({"channels_last_convs": bad})


def _layouts(fn, *args, **options) -> list[str]:
    return torchfuse.explain(fn, *args, options={"strict": True, **options}).layouts


def test_graph_decisions_are_logged_and_listed_by_explain(caplog):
    torch.manual_seed(0)
    many = nn.Sequential(*[m for _ in range(4) for m in (nn.Conv2d(8, 8, 3, padding=1), nn.ReLU())]).eval()
    one = nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU()).eval()
    depthwise = nn.Sequential(*[nn.Conv2d(8, 8, 3, padding=1, groups=8) for _ in range(3)]).eval()
    x, x3 = torch.randn(2, 8, 9, 7), torch.randn(2, 3, 9, 7)
    with torch.no_grad(), caplog.at_level(logging.INFO, logger="torchfuse.layout"):
        assert [s.split(": ", 1)[1] for s in _layouts(many, x)] == ["channels-last: 4 convolutions on oneDNN"]
        assert "NCHW: 1 convolution(s)" in _layouts(one, x3)[0]
        assert "channels-last: 3 convolutions" in _layouts(depthwise, x)[0]
        assert _layouts(lambda x: F.relu(x) * 2, x) == []          # no convolution: nothing to say
        assert "forced by channels_last_convs=False" in _layouts(many, x, channels_last_convs=False)[0]
    assert any("inference graph: channels-last" in r.getMessage() for r in caplog.records)
    # a training graph: decided on Dynamo's graph, before AOTAutograd
    many.train()
    layouts = _layouts(many, x.requires_grad_())
    assert layouts == ["training graph (Dynamo's, before AOTAutograd): channels-last: 4 convolutions on oneDNN"]
