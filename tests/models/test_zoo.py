"""The model zoo (benchmarks/zoo_models.py) through torchfuse at its "tiny" size: one model per
family compiled for inference against eager, and a training step (loss, every parameter
gradient, BatchNorm running statistics) for the CNN families and one transformer.  The benchmark
itself (benchmarks/zoo.py) runs the same models at realistic sizes; these tests keep every family
compiling and correct in CI."""
from __future__ import annotations

import copy
import os
import sys

import pytest
import torch

from torchfuse import counters

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks"))
from zoo_models import BY_NAME, FAMILIES  # noqa: E402
from zoo_transformers import BUILDERS as HF_MODELS  # noqa: E402

# one model per family; the training cases: the CNN families plus one transformer (GQA + rotary)
INFERENCE = {"resnet": "resnet18", "grouped": "resnext50_32x4d", "concat": "densenet", "mobile": "mobilenet_v3",
             "regnet": "regnety", "convnext": "convnext", "vit": "vit", "encoder": "bert", "t5": "t5",
             "decoder": "llama", "rnn": "lstm", "unet": "unet", "mixer": "mlp_mixer"}
TRAINING = ["resnet18", "resnext50_32x4d", "densenet", "mobilenet_v2", "regnety", "convnext", "unet", "llama"]
assert set(INFERENCE) == set(FAMILIES)

REL = 1e-4   # tolerance relative to each tensor's largest magnitude


def make_tiny(name: str) -> tuple[torch.nn.Module, tuple[torch.Tensor, ...]]:
    if name in HF_MODELS:
        pytest.importorskip("transformers")
    return BY_NAME[name].make("tiny", "cpu", torch.float32)


def assert_close_scaled(actual: torch.Tensor, expected: torch.Tensor, what: str, floor: float = 0.0) -> None:
    """assert_close with atol = REL * (the expected tensor's largest magnitude, at least `floor`)."""
    scale = max(expected.abs().max().item(), floor)
    torch.testing.assert_close(actual, expected, rtol=REL, atol=REL * scale, msg=lambda m: f"{what}: {m}")


def assert_close_or_as_close_to_fp64(actual: torch.Tensor, expected: torch.Tensor, exact: torch.Tensor, what: str,
                                     floor: float = 0.0) -> None:
    """assert_close_scaled, or, where fp32 rounding differs (a channels-last convolution's
    gradient sums in another order), the zoo harness's rule against an fp64 run: the RMS
    error vs fp64 at most twice eager's, plus REL of the tensor's scale."""
    try:
        assert_close_scaled(actual, expected, what, floor)
    except AssertionError:
        scale = max(expected.abs().max().item(), floor)
        ours, eagers = (float((t.double() - exact).square().mean().sqrt()) for t in (actual, expected))
        assert ours <= 2 * eagers + REL * scale, f"{what}: RMSE vs fp64 {ours:.3g}, eager's {eagers:.3g}"


def compiled_by_torchfuse(before: dict[str, int]) -> None:
    """The graphs went through torchfuse (kernels generated, none run eagerly after a build failure)."""
    assert counters["kernels_generated"] > before.get("kernels_generated", 0), "torchfuse generated no kernels"
    assert counters["eager_fallbacks"] == before.get("eager_fallbacks", 0), "a torchfuse graph ran eagerly"


@pytest.mark.parametrize("name", sorted(INFERENCE.values()))
def test_zoo_inference(name: str) -> None:
    model, inputs = make_tiny(name)
    before = dict(counters)
    with torch.no_grad():
        expected = model(*inputs)
        actual = torch.compile(model, backend="torchfuse")(*inputs)
    compiled_by_torchfuse(before)
    assert_close_scaled(actual, expected, f"{name} output")


@pytest.mark.parametrize("name", TRAINING)
def test_zoo_training_step(name: str) -> None:
    zm = BY_NAME[name]
    ref, inputs = make_tiny(name)
    ref.train()
    model, exact = copy.deepcopy(ref), copy.deepcopy(ref).double()
    zm.loss(exact(*(x.double() if x.is_floating_point() else x for x in inputs)), inputs).backward()
    before = dict(counters)
    loss = zm.loss(torch.compile(model, backend="torchfuse")(*inputs), inputs)
    loss.backward()
    compiled_by_torchfuse(before)
    loss_ref = zm.loss(ref(*inputs), inputs)
    loss_ref.backward()
    assert_close_scaled(loss, loss_ref, f"{name} loss")

    ref_params, exact_params = dict(ref.named_parameters()), dict(exact.named_parameters())
    # Gradients that are zero in exact arithmetic (an attention key bias) are rounding noise:
    # judge every gradient on at least a thousandth of the largest one's scale.
    floor = 1e-3 * max(p.grad.abs().max().item() for p in ref_params.values())
    for pname, p in model.named_parameters():
        r = ref_params[pname]
        assert p.grad is not None and r.grad is not None, f"{name}: {pname} got no gradient"
        assert_close_or_as_close_to_fp64(p.grad, r.grad, exact_params[pname].grad, f"{name} grad of {pname}", floor)
    # Train-mode BatchNorm updates its running statistics: a mutation the compiled graph must keep.
    # (A running mean that is zero in exact arithmetic, after another norm, is noise too.)
    ref_buffers = dict(ref.named_buffers())
    floor = 1e-3 * max((b.abs().max().item() for b in ref_buffers.values() if b.is_floating_point()), default=0.0)
    for bname, b in model.named_buffers():
        assert_close_scaled(b.double(), ref_buffers[bname].double(), f"{name} buffer {bname}", floor)


# ----------------------------------------------------------------------------------------------
# kernel counts of the patterns every CNN repeats
# ----------------------------------------------------------------------------------------------
def _block(groups: int = 1) -> torch.nn.Module:
    import zoo_cnn
    block = zoo_cnn.Bottleneck(16, 4, groups=groups, base_width=64) if groups > 1 else zoo_cnn.BasicBlock(8, 8)
    with torch.no_grad():
        for m in block.modules():
            if isinstance(m, torch.nn.BatchNorm2d):
                m.running_mean.uniform_(-1, 1)
                m.running_var.uniform_(0.5, 2)
                m.weight.uniform_(0.5, 1.5)
                m.bias.uniform_(-0.5, 0.5)
    return block.eval()


@pytest.mark.parametrize("groups", [1, 4])
@pytest.mark.parametrize("channels_last", [False, True])
def test_conv_neighbourhood_inference_kernels(groups: int, channels_last: bool) -> None:
    """Inference: every batch norm folds into its convolution, and what follows a convolution
    (ReLU; the residual add and ReLU) is one kernel: a basic block is 2 kernels, a grouped
    bottleneck (conv-bn-relu x2, conv-bn + add + relu) 3."""
    import torchfuse
    block = _block(groups)
    x = torch.randn(2, 16 if groups > 1 else 8, 9, 11)
    if channels_last:
        block, x = block.to(memory_format=torch.channels_last), x.to(memory_format=torch.channels_last)
    with torch.no_grad():
        # (NCHW input: without channels_last_convs, whose one copy of the input is counted in
        # tests/passes/test_pass_channels_last.py)
        e = torchfuse.explain(block, x, options={"channels_last_devices": ()})
        assert_close_scaled(e.output, block(x), "block output")
    assert len(e.kernels) == (3 if groups > 1 else 2), str(e)
    assert e.frozen, "the folded weights were not hoisted out of the call"


@pytest.mark.parametrize("channels_last", [False, True])
def test_batch_norm_training_kernels(channels_last: bool) -> None:
    """Training: a batch norm is one statistics kernel (mean, variance, running statistics, written
    into the buffers themselves), one kernel applying it with the ReLU and the scalar
    num_batches_tracked + 1; the backward is one reduction and one pointwise kernel.  NCHW, the
    statistics read along their reduced loops ([C] x [N, H, W]), and the element-wise kernels,
    whose [N, C, H, W] loops are a permutation of those, join them as their epilogues: the
    forward is the statistics with the normalization and ReLU, and the scalar; the backward one
    kernel."""
    import torchfuse
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.BatchNorm2d(8), torch.nn.ReLU())
    x = torch.randn(4, 3, 10, 10)
    if channels_last:
        m, x = m.to(memory_format=torch.channels_last), x.to(memory_format=torch.channels_last)
    ref = copy.deepcopy(m)
    xe, xt = x.clone().requires_grad_(), x.clone().requires_grad_()
    e = torchfuse.explain(lambda x: m(x), xt)

    def kinds(graph: str) -> list[str]:
        return [k.kind for k in e.kernels if k.graph.endswith(graph)]
    assert kinds("_forward") == (["reduction", "pointwise", "pointwise"] if channels_last
                                 else ["reduction", "pointwise"]), str(e)
    expected = ref(xe)
    assert_close_scaled(e.output, expected, "output")
    g = torch.randn_like(expected)
    e.output.backward(g)
    expected.backward(g)
    assert kinds("_backward") == (["reduction", "pointwise"] if channels_last else ["reduction"]), str(e)
    assert_close_scaled(xt.grad, xe.grad, "input gradient")
    for (name, b), rb in zip(m.named_buffers(), ref.buffers()):
        assert_close_scaled(b.double(), rb.double(), name)


@pytest.mark.parametrize("name", ["llama", "resnet18"])
def test_new_batch_sizes_build_nothing(name: str) -> None:
    """After the first dynamic recompile (batch 8, then 4), batches 16, 3 and 32 build no kernel
    and give eager's results.  The transformer compiles no graph either; the CNN compiles one
    more at 16, for a guard torch's own fake convolution adds (batch <= 15, also Inductor's)."""
    model, (x, *rest) = make_tiny(name)
    compiled = torch.compile(model, backend="torchfuse")
    graphs, builds = [], []
    for batch in (8, 4, 16, 3, 32):
        shape = (batch, *x.shape[1:])
        xb = torch.randint(0, 32, shape) if not x.is_floating_point() else torch.randn(shape)
        g, b = counters["graphs_compiled"], counters["kernel_builds"]
        with torch.no_grad():
            assert_close_scaled(compiled(xb, *rest), model(xb, *rest), f"{name} batch {batch}")
        graphs.append(counters["graphs_compiled"] - g)
        builds.append(counters["kernel_builds"] - b)
    assert builds[2:] == [0, 0, 0], builds
    assert graphs[2:] == ([0, 0, 0] if name == "llama" else [1, 0, 0]), graphs


def test_small_batch_cuts_batched_inputs_only() -> None:
    """zoo.py --batch: every tensor batched like the first is cut to its first samples, layout
    kept (a channels-last image stays channels-last); the rest (a per-model constant) stays."""
    from zoo import small_batch
    x = torch.randn(8, 3, 5, 5).contiguous(memory_format=torch.channels_last)
    ids, table = torch.randint(0, 9, (8, 7)), torch.randn(4, 2)
    cut = small_batch((x, ids, table, 3), 2)
    torch.testing.assert_close(cut[0], x[:2])
    assert cut[0].is_contiguous(memory_format=torch.channels_last)
    torch.testing.assert_close(cut[1], ids[:2])
    assert cut[2] is table and cut[3] == 3
    assert small_batch((x,), 8)[0] is x


def test_zero_initialised_weights_get_random_values() -> None:
    """A library's zero-initialised head (torchvision's ViT, timm's Mixer) would make a random
    model's output constant, so no backend could be told apart from eager: the zoo gives such
    weight matrices random values and keeps zero vectors (biases, norm scales) as they are."""
    from zoo_models import _randomize_zero_weights
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.LayerNorm(16), torch.nn.Linear(16, 3))
    torch.nn.init.zeros_(model[2].weight)
    torch.nn.init.zeros_(model[2].bias)
    kept = model[0].weight.detach().clone()
    _randomize_zero_weights(model)
    assert model[2].weight.abs().min() > 0 and model[2].bias.abs().max() == 0
    assert torch.equal(model[0].weight, kept)
    x = torch.randn(5, 8)
    assert model(x).std(0).min() > 0, "the output should depend on the input"
