"""channels_last_convs (src/torchfuse/passes/channels_last.py): an inference graph's
convolutions read channels-last activations, one copy at the first convolution, the layout
carried through the ops between, outputs with eager's strides; a k x k weight is copied to
channels-last too (1 x 1 and depthwise weights already are), once per call's parameters."""
from __future__ import annotations

import re

import pytest

import torch
import torch.nn as nn
import torch.nn.functional as F


def _copies(e) -> int:
    """channels-last copies the pass inserted (activations and k x k weights), over all graphs."""
    return sum(int(re.search(r"\((\d+) changes\)", p).group(1)) for p in e.passes if "channels_last_convs" in p)


def _cnn() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
        nn.Conv2d(8, 8, 3, padding=1, groups=8), nn.Hardswish(),           # depthwise
        nn.MaxPool2d(2), nn.Conv2d(8, 16, 1), nn.ReLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, 5)).eval()


def test_one_copy_at_the_first_convolution(tf):
    model, x = _cnn(), tf.rand((2, 3, 11, 9))
    with torch.no_grad():
        e = tf.check(model, x, allow_fallbacks={"aten.convolution.default", "aten.addmm.default",
                                                "aten.max_pool2d_with_indices.default"})
    assert _copies(e) == 2, e.passes      # the input, the first (3 x 3, batch-norm folded) weight


def test_outputs_keep_eagers_strides(tf):
    """A 4-d convolution output and a flatten of one (a view that needs contiguous strides)."""
    torch.manual_seed(0)
    conv, conv2, conv3 = nn.Conv2d(3, 6, 3), nn.Conv2d(6, 6, 1), nn.Conv2d(6, 4, 1)
    x = tf.rand((2, 3, 10, 7))

    def fn(x):
        y = torch.relu(conv(x))
        z = conv3(conv2(y).sigmoid())
        return z * 2, z.view(2, -1) + 1, y[:, :2]

    with torch.no_grad():
        e = tf.check(fn, x, check_stride=True, allow_fallbacks={"aten.convolution.default"}, atol=1e-5, rtol=1e-4)
    assert _copies(e) == 2, e.passes      # the input, conv's 3 x 3 weight


def test_channels_last_input_and_training_are_left_alone(tf):
    model, x = _cnn(), tf.rand((2, 3, 8, 8))
    fallbacks = {"aten.convolution.default", "aten.addmm.default", "aten.max_pool2d_with_indices.default",
                 "aten.convolution_backward.default", "aten.max_pool2d_with_indices_backward.default",
                 "aten.mm.default"}
    with torch.no_grad():
        e = tf.check(model, x.to(memory_format=torch.channels_last), allow_fallbacks=fallbacks)
    assert _copies(e) == 0, e.passes
    # a training graph is re-laid before AOTAutograd instead (frontend/channels_last_training.py;
    # the flatten of its [2, 16, 1, 1] channels-last activation comes back as an as_strided_scatter)
    e = tf.check_grad(lambda x: model.train()(x), x.requires_grad_(),
                      allow_fallbacks=fallbacks | {"aten.copy_.default", "aten.as_strided_scatter.default"},
                      atol=1e-4, rtol=1e-4)
    assert _copies(e) == 0, e.passes


def test_a_block_with_few_convolutions_is_left_alone(tf):
    """Two convolutions do not pay for copying the input in and the output back."""
    torch.manual_seed(0)
    conv, conv2 = nn.Conv2d(3, 6, 3, padding=1), nn.Conv2d(6, 3, 3, padding=1)
    x = tf.rand((2, 3, 10, 7))
    with torch.no_grad():
        e = tf.check(lambda x: conv2(torch.relu(conv(x))) + x, x, check_stride=True,
                     allow_fallbacks={"aten.convolution.default"}, atol=1e-5, rtol=1e-4)
    assert _copies(e) == 0, e.passes


def test_devices_option_turns_it_off(tf):
    model, x = _cnn(), tf.rand((2, 3, 8, 8))
    with torch.no_grad():
        e = tf.check(model, x, options={"channels_last_devices": ()},
                     allow_fallbacks={"aten.convolution.default", "aten.addmm.default",
                                      "aten.max_pool2d_with_indices.default"})
    assert _copies(e) == 0, e.passes


def test_layout_reaches_later_convolutions_through_cat_and_pool(tf):
    """A concat-heavy block: the branches' convolutions share one copy of the input."""
    torch.manual_seed(0)
    a, b, c = nn.Conv2d(4, 3, 1), nn.Conv2d(4, 5, 3, padding=1), nn.Conv2d(8, 2, 1)
    x = tf.rand((2, 4, 9, 9))

    def fn(x):
        y = torch.cat([F.relu(a(x)), F.relu(b(x))], 1)
        return c(F.avg_pool2d(y, 3, 1, 1)).sum((2, 3))

    with torch.no_grad():
        e = tf.check(fn, x, allow_fallbacks={"aten.convolution.default", "aten.avg_pool2d.default"},
                     atol=1e-5, rtol=1e-4)
    assert _copies(e) == 2, e.passes      # the input (shared by both branches), b's 3 x 3 weight


def test_explicit_strides_leave_the_graph_alone(tf):
    """as_strided reads by eager's strides: on a re-laid-out value it would read other elements."""
    torch.manual_seed(0)
    convs = [nn.Conv2d(3, 3, 1) for _ in range(3)]
    x = tf.rand((2, 3, 6, 5))

    def fn(x):
        y = convs[2](convs[1](convs[0](x)))
        return torch.as_strided(torch.relu(y), (2, 3, 5), (90, 30, 6)) * 2

    with torch.no_grad():
        e = tf.check(fn, x, allow_fallbacks={"aten.convolution.default"}, atol=1e-5, rtol=1e-4)
    assert _copies(e) == 0, e.passes


def test_weight_copies_are_hoisted_out_of_the_call(tf):
    """A parameter's channels-last copy is made once: the call itself copies only the input
    (ATen would otherwise copy every NCHW weight to the input's layout in every call)."""
    torch.manual_seed(0)
    model = nn.Sequential(*[m for _ in range(3) for m in (nn.Conv2d(8, 8, 3, padding=1), nn.ReLU())]).eval()
    x = tf.rand((2, 8, 12, 10))
    with torch.no_grad():
        e = tf.check(model, x, allow_fallbacks={"aten.convolution.default"}, atol=1e-5, rtol=1e-4)
    assert _copies(e) == 4, e.passes       # the input and three weights
    assert any("clone" in f for f in e.frozen), e.frozen


class MixedNet(nn.Module):
    """conv-bn-relu-pool, a grouped conv with a residual, a depthwise conv, a 1 x 1 and a
    transposed conv; two outputs: the transposed conv's 4-d map and pooled features."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.stem, self.bn = nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16)
        self.grouped = nn.Conv2d(16, 16, 3, padding=1, groups=4)
        self.dw = nn.Conv2d(16, 16, 3, padding=1, groups=16)
        self.pw = nn.Conv2d(16, 8, 1)
        self.up = nn.ConvTranspose2d(8, 4, 3, stride=2, padding=1, output_padding=1)

    def forward(self, x):
        y = F.max_pool2d(F.relu(self.bn(self.stem(x))), 2)
        y = F.relu(self.grouped(y)) + y
        y = self.pw(F.hardswish(self.dw(y)))
        return self.up(y), y.mean((2, 3))


def layout_copies(e) -> tuple[int, int]:
    """(copies to channels-last, copies back to contiguous) in the graphs after the passes."""
    after = "".join(g for g in e.graphs if "after passes" in g.splitlines()[0])
    return after.count("memory_format = torch.channels_last"), after.count("memory_format = torch.contiguous_format")


MIXED_FALLBACKS = {"aten.convolution.default", "aten.max_pool2d_with_indices.default"}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("channels_last", [True, False])
def test_mixed_net_both_layouts(tf, dtype, channels_last):
    """Outputs and their strides are eager's either way; channels-last copies only the input and
    the k x k weights of the non-depthwise convs (stem, grouped, transposed) in, and the 4-d
    output back: nothing flips layout between the convolutions."""
    model, x = MixedNet().eval().to(dtype), tf.rand((2, 3, 11, 13), dtype)
    tol = {} if dtype == torch.float32 else {"atol": 3e-2, "rtol": 3e-2}
    with torch.no_grad():
        e = tf.check(model, x, options={"channels_last_convs": channels_last}, check_stride=True,
                     allow_fallbacks=MIXED_FALLBACKS, **tol)
    assert layout_copies(e) == ((4, 1) if channels_last else (0, 0)), e.graphs[-1]
    assert len(e.layouts) == 1 and e.layouts[0].split(": ")[1] == ("channels-last" if channels_last else "NCHW")


def test_mixed_net_auto_on_cpu_is_channels_last(tf):
    with torch.no_grad():
        e = tf.check(MixedNet().eval(), tf.rand((3, 3, 9, 15)), check_stride=True, allow_fallbacks=MIXED_FALLBACKS)
    assert layout_copies(e) == (4, 1)
    assert "channels-last: 5 convolutions" in e.layouts[0], e.layouts


class ShuffleUnit(nn.Module):
    """ShuffleNet-v2's unit (torchvision's code): half the channels pass through, the other half
    through 1x1 / depthwise 3x3 / 1x1 convolutions, then a channel shuffle (view, transpose,
    contiguous, view); twice, so that the second unit's branch reads a slice of a shuffle."""

    def __init__(self, c: int = 8):
        super().__init__()
        torch.manual_seed(0)
        self.stem = nn.Conv2d(3, 2 * c, 3, padding=1)
        self.branches = nn.ModuleList(nn.Sequential(
            nn.Conv2d(c, c, 1), nn.BatchNorm2d(c), nn.ReLU(), nn.Conv2d(c, c, 3, padding=1, groups=c),
            nn.BatchNorm2d(c), nn.Conv2d(c, c, 1), nn.ReLU()) for _ in range(2))
        for m in self.modules():
            if isinstance(m, nn.BatchNorm2d):
                m.running_mean.normal_()
                m.running_var.uniform_(0.5, 2.0)

    @staticmethod
    def shuffle(x):
        b, c, h, w = x.shape
        return torch.transpose(x.view(b, 2, c // 2, h, w), 1, 2).contiguous().view(b, c, h, w)

    def forward(self, x):
        x = F.relu(self.stem(x))
        for branch in self.branches:
            x1, x2 = x.chunk(2, dim=1)
            x = self.shuffle(torch.cat((x1, branch(x2)), dim=1))
        return x


def _conv_inputs(e) -> list[str]:
    """The first argument of each convolution in the graph after the passes."""
    after = "".join(g for g in e.graphs if "after passes" in g.splitlines()[0])
    return re.findall(r"aten\.convolution\.default\((\w+),", after)


def test_convolutions_on_a_channel_shuffles_slices_go_channels_last(tf):
    """Each branch's first convolution reads a slice of a channel shuffle's output, which is no
    NCHW activation; it reads a channels-last copy too (its producer writes it so), and the
    shuffle's views of channels-last values stay views: no copy back to NCHW in between."""
    with torch.no_grad():
        e = tf.check(ShuffleUnit().eval(), tf.rand((2, 3, 7, 9)), check_stride=True,
                     allow_fallbacks={"aten.convolution.default"}, atol=1e-5, rtol=1e-4)
    inputs = _conv_inputs(e)
    assert len(inputs) == 7 and inputs[1].startswith("clone") and inputs[4].startswith("clone"), inputs
    # copies to channels-last: the input, the stem's 3 x 3 weight, each branch's slice; to
    # contiguous: the two shuffles' own .contiguous() (the output is the second's view), none added
    assert layout_copies(e) == (4, 2), e.graphs[-1]
    assert "channels-last: 7 convolutions" in e.layouts[0], e.layouts


class GroupNormNet(nn.Module):
    """MobileViT-v2's norm, GroupNorm(1, C), whose decomposition reads its per-sample scale
    with as_strided: a value computed from channels-last activations, with unchanged strides."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.convs = nn.ModuleList([nn.Conv2d(3, 8, 3, padding=1), nn.Conv2d(8, 8, 1), nn.Conv2d(8, 8, 3, padding=1)])
        self.norms = nn.ModuleList([nn.GroupNorm(1, 8) for _ in range(3)])
        for n in self.norms:
            n.weight.data.normal_()
            n.bias.data.normal_()

    def forward(self, x):
        for conv, norm in zip(self.convs, self.norms):
            x = F.silu(norm(conv(x)))
        return x


def test_group_norm_keeps_the_graph_channels_last(tf):
    with torch.no_grad():
        e = tf.check(GroupNormNet().eval(), tf.rand((2, 3, 9, 7)), check_stride=True,
                     allow_fallbacks={"aten.convolution.default"}, atol=1e-5, rtol=1e-4)
    assert e.layouts == ["forward_0: channels-last: 3 convolutions on oneDNN"] or \
        (len(e.layouts) == 1 and e.layouts[0].endswith("channels-last: 3 convolutions on oneDNN")), e.layouts
    assert layout_copies(e)[0] == 3, e.graphs[-1]      # the input and the two 3 x 3 weights
