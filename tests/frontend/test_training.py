"""Training through torchfuse (AOTAutograd forward + backward graphs) against eager PyTorch:
gradients, a few optimizer steps, and BatchNorm in train mode (running statistics) and eval mode
(the conv-bn folding path)."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import torchfuse
from torchfuse import counters


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    torch.manual_seed(0)
    eager_before = counters["eager_fallbacks"]
    yield
    torch._dynamo.reset()
    assert counters["eager_fallbacks"] == eager_before, "a graph ran eagerly instead of through torchfuse"


def randn(*shape: int) -> torch.Tensor:
    x = torch.randn(*shape)
    return torch.where(x.abs() < 1e-3, torch.full_like(x, 0.5), x)


def assert_grads_close(model: nn.Module, ref: nn.Module, rtol: float = 1e-4, atol: float = 1e-6) -> None:
    named = dict(ref.named_parameters())
    checked = 0
    for name, p in model.named_parameters():
        r = named[name]
        assert (p.grad is None) == (r.grad is None), name
        if r.grad is None:
            continue
        assert r.grad.abs().sum() > 0, f"{name}: eager gradient is zero, the test proves nothing"
        torch.testing.assert_close(p.grad, r.grad, rtol=rtol, atol=atol, msg=lambda m: f"{name}: {m}")
        checked += 1
    assert checked == len(named)


class MLP(nn.Module):
    def __init__(self, d_in: int = 12, d_hidden: int = 32, n_classes: int = 7):
        super().__init__()
        self.fc1 = nn.Linear(d_in, d_hidden)
        self.norm = nn.LayerNorm(d_hidden)
        self.drop = nn.Dropout(p=0.0)
        self.fc2 = nn.Linear(d_hidden, n_classes)

    def forward(self, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        h = self.drop(F.gelu(self.norm(self.fc1(x))))
        return F.cross_entropy(self.fc2(h), target)


def test_mlp_backward_matches_eager():
    ref = MLP()
    model = copy.deepcopy(ref)
    x, target = randn(10, 12), torch.randint(0, 7, (10,))
    x_ref, x_tf = x.clone().requires_grad_(), x.clone().requires_grad_()
    before = counters["graphs_compiled"], counters["kernels_generated"]
    compiled = torch.compile(model, backend="torchfuse", options={"strict": True})
    loss = compiled(x_tf, target)
    loss.backward()
    loss_ref = ref(x_ref, target)
    loss_ref.backward()
    # A forward and a backward graph went through torchfuse and produced kernels.
    assert counters["graphs_compiled"] - before[0] >= 2
    assert counters["kernels_generated"] - before[1] >= 2
    torch.testing.assert_close(loss, loss_ref, rtol=1e-5, atol=1e-6)
    assert_grads_close(model, ref)
    torch.testing.assert_close(x_tf.grad, x_ref.grad, rtol=1e-4, atol=1e-6)


def test_mlp_sgd_steps_track_eager():
    ref = MLP()
    model = copy.deepcopy(ref)
    compiled = torch.compile(model, backend="torchfuse", options={"strict": True})
    opt_ref = torch.optim.SGD(ref.parameters(), lr=0.5, momentum=0.9)
    opt = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    losses, losses_ref = [], []
    for step in range(4):
        x, target = randn(10, 12), torch.randint(0, 7, (10,))
        for m, fn, o, out in ((ref, ref, opt_ref, losses_ref), (model, compiled, opt, losses)):
            o.zero_grad()
            loss = fn(x, target)
            loss.backward()
            o.step()
            out.append(loss.item())
    assert losses_ref[-1] != losses_ref[0]
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(losses_ref), rtol=1e-4, atol=1e-5)
    for (name, p), r in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p, r, rtol=1e-4, atol=1e-5, msg=lambda m: f"{name}: {m}")


class ConvBN(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.conv2 = nn.Conv2d(8, 8, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(8)
        self.fc = nn.Linear(8, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.relu(self.bn(self.conv(x)))
        h = F.relu(self.bn2(self.conv2(h)) + h)
        return self.fc(h.mean((2, 3)))


def _randomize_bn(m: nn.Module) -> None:
    with torch.no_grad():
        for mod in m.modules():
            if isinstance(mod, nn.BatchNorm2d):
                mod.weight.uniform_(0.5, 1.5)
                mod.bias.uniform_(-0.5, 0.5)
                mod.running_mean.uniform_(-0.5, 0.5)
                mod.running_var.uniform_(0.5, 2.0)


def test_batchnorm_train_mode_matches_eager():
    ref = ConvBN()
    _randomize_bn(ref)
    model = copy.deepcopy(ref)
    compiled = torch.compile(model, backend="torchfuse", options={"strict": True})
    for step in range(2):
        x = randn(4, 3, 8, 8)
        out_ref, out = ref(x), compiled(x)
        torch.testing.assert_close(out, out_ref, rtol=1e-4, atol=1e-5)
        out_ref.square().sum().backward()
        out.square().sum().backward()
        for name in ("bn", "bn2"):
            b, b_ref = getattr(model, name), getattr(ref, name)
            torch.testing.assert_close(b.running_mean, b_ref.running_mean, rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(b.running_var, b_ref.running_var, rtol=1e-5, atol=1e-6)
            assert int(b.num_batches_tracked) == int(b_ref.num_batches_tracked) == step + 1
    assert_grads_close(model, ref, rtol=1e-4, atol=1e-5)


def test_batchnorm_eval_mode_conv_bn_folding():
    ref = ConvBN()
    _randomize_bn(ref)
    ref.eval()
    x = randn(2, 3, 8, 8)
    with torch.no_grad():
        expected = ref(x)
        e = torchfuse.explain(ref, x, options={"strict": True})
    torch.testing.assert_close(e.output, expected, rtol=1e-4, atol=1e-5)
    before, after = e.graphs[0], e.graphs[1]
    assert "batch_norm" in before
    assert "batch_norm" not in after, "the eval-mode batch norms were not folded into the convolutions"
    assert e.kernels
    # The running statistics are buffers: eval mode leaves them alone.
    with torch.no_grad():
        before_mean = ref.bn.running_mean.clone()
        out = torch.compile(ref, backend="torchfuse")(x)
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-5)
    assert torch.equal(ref.bn.running_mean, before_mean)


def test_dropout_train_mask_consistent_with_grad():
    """Random masks differ from eager's, but the output and the gradient must use the same mask with
    eager's scaling 1/(1-p), and about p of the elements must be dropped."""
    p = 0.25

    def f(x):
        return F.dropout(x * 2, p, True)

    x = (torch.rand(64, 64) + 0.5).requires_grad_()
    y = torch.compile(f, backend="torchfuse")(x)
    y.backward(torch.ones_like(y))
    keep = y != 0
    assert abs(keep.float().mean().item() - (1 - p)) < 0.05
    torch.testing.assert_close(y[keep], (x.detach() * 2 / (1 - p))[keep])
    torch.testing.assert_close(x.grad, keep.float() * 2 / (1 - p))


def _spy_saved_bytes(monkeypatch) -> list[int]:
    """Activation bytes each compiled forward graph saves for the backward: the values it computed
    (not its inputs or views of them)."""
    import torchfuse.pipeline as cg
    saved: list[int] = []
    real = cg.compile_graph

    def spy(gm, config, *, kind, **kw):
        if kind == "forward":
            outs = next(iter(gm.graph.find_nodes(op="output"))).args[0]
            vals = [o.meta["val"] for o in outs if isinstance(o, torch.fx.Node) and o.op != "placeholder"
                    and o.target is not torch.ops.aten.t.default]
            saved.append(sum(v.numel() * v.element_size() for v in vals))
        return real(gm, config, kind=kind, **kw)
    monkeypatch.setattr(cg, "compile_graph", spy)
    return saved


def _forward_saved_bytes(partitioner: str, monkeypatch) -> int:
    """Train an MLP once through torchfuse; return the activation bytes its forward saves."""
    saved = _spy_saved_bytes(monkeypatch)
    torch.manual_seed(0)
    model, x, target = MLP(d_in=24, d_hidden=512, n_classes=40), randn(64, 24), torch.randint(0, 40, (64,))
    ref = copy.deepcopy(model)
    F.cross_entropy(ref.fc2(ref.drop(F.gelu(ref.norm(ref.fc1(x)), approximate="tanh"))), target).backward()
    compiled = torch.compile(lambda x, t: F.cross_entropy(model.fc2(F.gelu(model.norm(model.fc1(x)),
                                                                            approximate="tanh")), t),
                             backend="torchfuse", options={"partitioner": partitioner})
    compiled(x, target).backward()
    assert_grads_close(model, ref)
    assert len(saved) == 1
    return saved[0]


def test_cross_entropy_backward_recomputes_the_log_probabilities(monkeypatch):
    """A language model's loss: the forward keeps the logits (an input) and two numbers per row;
    the [tokens, vocab] log-probabilities are recomputed in the backward, not written and read."""
    saved = _spy_saved_bytes(monkeypatch)
    logits, target = randn(96, 1000).requires_grad_(), torch.randint(0, 1000, (96,))
    target[5] = -100
    ref = logits.detach().clone().requires_grad_()
    loss = torch.compile(lambda lg, t: F.cross_entropy(lg, t), backend="torchfuse")(logits, target)
    loss.backward()
    F.cross_entropy(ref, target).backward()
    torch.testing.assert_close(logits.grad, ref.grad, rtol=1e-5, atol=1e-7)
    assert saved and saved[0] < 96 * 1000 * 4 // 10, saved


def test_min_cut_partitioner_saves_less_for_the_backward(monkeypatch):
    """The default min-cut partition recomputes GELU's intermediates and the log-softmax in the
    backward instead of writing them out: same gradients, fewer bytes saved."""
    min_cut = _forward_saved_bytes("min_cut", monkeypatch)
    torch._dynamo.reset()
    everything = _forward_saved_bytes("default", monkeypatch)
    assert min_cut < 0.75 * everything, (min_cut, everything)


@pytest.mark.parametrize("gather", ["index_select", "index"])
def test_gathered_messages_are_recomputed_not_saved(monkeypatch, gather):
    """A GAT layer: node features gathered along the edges ([edges, heads, channels]), weighted
    by a per-edge score whose softmax scatters by the same edge index, summed into the nodes.
    The forward saves the node features and the scores, not the gathered messages (E / N times
    larger): the backward gathers again inside its kernel."""
    saved = _spy_saved_bytes(monkeypatch)
    n, e, heads, ch = 40, 300, 4, 16
    x, att = randn(n, heads, ch).requires_grad_(), randn(1, heads, ch).requires_grad_()
    ei = torch.randint(0, n, (2, e))
    ei[:, 0] = torch.tensor([0, n - 1])

    def gat(x, att, ei):
        src, dst = ei[0], ei[1]
        x_j = x.index_select(0, src) if gather == "index_select" else x[src]
        score = (x_j * att).sum(-1).exp()                          # [edges, heads]
        total = torch.zeros(n, heads).index_add(0, dst, score)
        alpha = score / total.index_select(0, dst)
        return torch.zeros(n, heads, ch).index_add(0, dst, x_j * alpha.unsqueeze(-1)).tanh()

    ref_x, ref_att = x.detach().clone().requires_grad_(), att.detach().clone().requires_grad_()
    gat(ref_x, ref_att, ei).square().sum().backward()
    torch.compile(gat, backend="torchfuse")(x, att, ei).square().sum().backward()
    torch.testing.assert_close(x.grad, ref_x.grad, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(att.grad, ref_att.grad, rtol=1e-4, atol=1e-5)
    messages = e * heads * ch * 4
    assert len(saved) == 1 and saved[0] < messages // 2, (saved, messages)


@pytest.mark.parametrize("options", [{}, {"cpu_backend": "triton"}], ids=["cpp", "triton"])
def test_relu_and_max_pool_save_no_float_activation(monkeypatch, options):
    """conv -> relu -> max pool -> conv: the forward saves relu's bool mask (its backward is
    decomposed: `threshold_backward` whole needed the fp32 input) and the pooling's indices,
    not the pooling's fp32 input (its backward reads it for its shape only).  What it saves:
    the pooled output (the second convolution's input), the indices, the mask, and the second
    convolution's output (square's backward) and the loss."""
    if options:
        pytest.importorskip("triton")
    saved = _spy_saved_bytes(monkeypatch)
    torch.manual_seed(0)
    conv1, conv2 = nn.Conv2d(3, 8, 3, padding=1), nn.Conv2d(8, 4, 3)

    def step(x):
        return conv2(F.max_pool2d(torch.relu(conv1(x)), 3, 2, ceil_mode=True)).square().sum()

    x = randn(2, 3, 17, 17)
    ref1, ref2 = copy.deepcopy(conv1), copy.deepcopy(conv2)
    torch.compile(step, backend="torchfuse", options=options)(x).backward()
    conv2(F.max_pool2d(torch.relu(ref1(x)), 3, 2, ceil_mode=True)).square().sum()   # (warm the modules)
    ref2(F.max_pool2d(torch.relu(ref1(x)), 3, 2, ceil_mode=True)).square().sum().backward()
    for a, b in ((conv1, ref1), (conv2, ref2)):
        torch.testing.assert_close(a.weight.grad, b.weight.grad, rtol=1e-4, atol=1e-4)
    pooled = 2 * 8 * 8 * 8
    indices = pooled * (1 if options else 8)        # int8 window offsets on Triton, ATen's int64 on C++
    relu_mask = 2 * 8 * 17 * 17                     # bool
    conv_out = 2 * 4 * 6 * 6 * 4
    assert saved == [pooled * 4 + indices + relu_mask + conv_out + 4], saved


def _ffn_stack(h: torch.Tensor, *ws: torch.Tensor) -> torch.Tensor:
    # T5's feed-forward blocks: relu, dropout (p=0: a clone), down projection, residual
    for w1, w2 in zip(ws[::2], ws[1::2]):
        h = h + F.dropout(torch.relu(h @ w1), p=0.0, training=True) @ w2
    return h.sum()


@pytest.mark.parametrize("options", [{}, {"cpu_backend": "triton"}], ids=["cpp", "triton"])
def test_saved_relu_masks_are_computed_in_their_layer(options):
    """The partition saves each layer's ReLU output (the down projection's weight gradient reads
    it) and its bool mask, which it moves from the backward into the forward, after the whole
    forward: computed there, every layer's pre-activation stayed alive to the forward's end, and
    each ReLU output was written twice (for its matmul, and as the saved output).  Now the
    forward holds what the backward reads and one matmul output: four ReLU outputs (4 KiB
    each), their masks (1 KiB each), three residual sums (1 KiB each), the last matmul's
    output (1 KiB)."""
    if options:
        pytest.importorskip("triton")
    torch.manual_seed(0)
    layers, n, f = 4, 32, 128
    h = randn(8, n).requires_grad_()
    ws = [(torch.randn(n, f) / 6 if k % 2 == 0 else torch.randn(f, n) / 12).requires_grad_()
          for k in range(2 * layers)]
    e = torchfuse.explain(_ffn_stack, h, *ws, options=options)
    forward = next(m for m in e.memory if "forward" in m)
    assert "_forward: planned peak 24.0 KiB held by the wrapper" in forward, forward
    relu_kernels = [k.name for k in e.kernels if "relu" in k.name]
    assert len(relu_kernels) == layers and all("threshold_backward" in k for k in relu_kernels), relu_kernels
    refs = [t.detach().clone().requires_grad_() for t in (h, *ws)]
    _ffn_stack(*refs).backward()
    compiled = torch.compile(_ffn_stack, backend="torchfuse", options=options)
    compiled(h, *ws).backward()
    for got, ref in zip((h, *ws), refs):
        torch.testing.assert_close(got.grad, ref.grad, rtol=1e-4, atol=1e-5)


def test_unknown_partitioner_is_refused():
    with pytest.raises(ValueError, match=r"partitioner='greedy' must be one of \['default', 'min_cut'\]"):
        torchfuse.compile(lambda x: x + 1, options={"partitioner": "greedy"})
