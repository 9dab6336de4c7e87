"""Module capture under torchfuse.lazy (lazy/capture.py): a module called at a block's top level
is recorded op by op on its first call and runs compiled (Dynamo + torchfuse, forward and
backward) from its second; results, gradients and optimizer updates equal eager's; what is
around the call is still recorded lazily; the module is left as it was outside lazy blocks."""
from __future__ import annotations

import copy
import logging

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import torchfuse
from torchfuse import counters
from torchfuse.lazy import capture

CALL = "compiled {} call"


class Block(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, 3 * width)
        self.down = nn.Linear(3 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(self.norm(x))))


def net(width: int = 24, depth: int = 2) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[Block(width) for _ in range(depth)])


def reasons(ctx: torchfuse.LazyContext) -> list[str]:
    return [f.reason for f in ctx.flushes]


def test_second_call_runs_compiled_and_matches_eager():
    model = net().eval()
    ctx = torchfuse.lazy()
    for step, shape in enumerate([(3, 7, 24), (3, 7, 24), (3, 7, 24)]):
        x = torch.randn(shape)
        n0 = len(ctx.flushes)
        with torch.no_grad(), ctx:
            out = model(x * 2 - 1)
        with torch.no_grad():
            torch.testing.assert_close(out, model(x * 2 - 1), atol=1e-5, rtol=1e-5)
        new = reasons(ctx)[n0:]
        if step == 0:    # recorded op by op: no compiled call
            assert CALL.format("Sequential") not in new and type(out) is not torch.Tensor
        else:            # the pending input computed in one flush, then one compiled call
            assert new == ["inputs of a compiled Sequential call", CALL.format("Sequential")], ctx.explain()
            assert type(out) is torch.Tensor and out.is_contiguous()
    # submodules called from inside the captured forward are not captured themselves
    assert all(isinstance(model[i]._compiled_call_impl, type(None)) for i in range(2))


def test_training_steps_match_eager_with_new_batch_sizes():
    model = net(depth=3)
    ref = copy.deepcopy(model)
    opt, ref_opt = (torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (model, ref))
    ctx = torchfuse.lazy(options={"strict": True})
    graphs = []
    for batch in [4, 4, 6, 9, 5, 12]:
        x = torch.randn(batch, 5, 24)
        before = counters["graphs_compiled"]
        with ctx:
            loss = (model(x).float() ** 2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
        graphs.append(counters["graphs_compiled"] - before)
        ref_loss = (ref(x) ** 2).mean()
        ref_loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        torch.testing.assert_close(loss.detach(), ref_loss.detach(), atol=1e-6, rtol=1e-5)
        for p, q in zip(model.parameters(), ref.parameters()):
            torch.testing.assert_close(p, q, atol=1e-6, rtol=1e-5)
            assert p.grad is None
    # the forward and backward are compiled for the second call; a symbolic compile covers
    # every later batch size, and so do the recorded loss's graphs (the mean's backward divides
    # by the batch's element count: a size, not a new constant)
    assert graphs[1] >= 2 and not any(graphs[2:]), graphs
    compiled = [f for f in ctx.flushes if f.reason == CALL.format("Sequential")]
    assert len(compiled) == 5


def test_gradients_reach_parameters_and_inputs_outside_the_call():
    torch.manual_seed(1)
    model, head = net(), nn.Linear(24, 3)
    ref_model, ref_head = copy.deepcopy(model), copy.deepcopy(head)
    for _ in range(3):
        x = torch.randn(2, 6, 24)
        leaf = torch.randn(24, requires_grad=True)
        with torchfuse.lazy() as ctx:
            out = head(model(x) * leaf).logsumexp(-1).sum()   # head: a second top-level module
            out.backward()
        ref_leaf = leaf.detach().clone().requires_grad_()
        ref_out = ref_head(ref_model(x) * ref_leaf).logsumexp(-1).sum()
        ref_out.backward()
        torch.testing.assert_close(leaf.grad, ref_leaf.grad, atol=1e-5, rtol=1e-5)
        for p, q in zip([*model.parameters(), *head.parameters()], [*ref_model.parameters(), *ref_head.parameters()]):
            torch.testing.assert_close(p.grad, q.grad, atol=1e-5, rtol=1e-5)
    # (one block per step: each block sees the modules' calls counted by the ones before)
    assert CALL.format("Sequential") in reasons(ctx), ctx.explain()


def test_input_with_lazy_autograd_history_is_recorded_not_compiled():
    model = net()
    w = torch.randn(24, requires_grad=True)
    ctx = torchfuse.lazy()
    for _ in range(3):
        x = torch.randn(2, 3, 24)
        with ctx:
            y = model(x * w)              # x * w: a pending value that carries w's history
            y.sum().backward()
    assert CALL.format("Sequential") not in reasons(ctx)
    ref = copy.deepcopy(model)
    w.grad = None
    x = torch.randn(2, 3, 24)
    with ctx:
        model(x * w).sum().backward()
    gw = w.grad.clone()
    w.grad = None
    ref(x * w).sum().backward()
    torch.testing.assert_close(gw, w.grad, atol=1e-5, rtol=1e-5)


def test_capture_off_records_every_call():
    model = net().eval()
    ctx = torchfuse.lazy(capture_modules=False)
    for _ in range(3):
        with torch.no_grad(), ctx:
            out = model(torch.randn(2, 4, 24))
        assert type(out) is not torch.Tensor
    assert not any(f.graph == "module" for f in ctx.flushes)
    assert model._compiled_call_impl is None


def test_module_is_left_as_it_was_outside_lazy_blocks():
    model = net().eval()
    x = torch.randn(2, 4, 24)
    for _ in range(2):
        with torch.no_grad(), torchfuse.lazy():
            model(x)
    assert model._compiled_call_impl is None            # disarmed when the last block closed
    assert not torch.nn.modules.module._global_forward_pre_hooks
    compiled = torch.compile(model, backend="torchfuse")   # a later torch.compile sees the module
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), model(x), atol=1e-5, rtol=1e-5)
    with torch.no_grad(), torchfuse.lazy() as ctx:      # re-armed in the next block
        model(x)
    assert reasons(ctx) == [CALL.format("Sequential")]


def test_a_module_whose_compile_fails_is_recorded_with_one_warning(monkeypatch, caplog):
    model = net().eval()

    def failing(module, ctx):
        def call(*args, **kwargs):
            raise torch._dynamo.exc.Unsupported("a test's unsupported construct")
        return call
    monkeypatch.setattr(capture, "_compile", failing)
    x = torch.randn(2, 4, 24)
    with caplog.at_level(logging.WARNING, logger="torchfuse.lazy"):
        outs = []
        for _ in range(3):
            with torch.no_grad(), torchfuse.lazy() as ctx:
                outs.append(model(x))
    assert sum("compiling Sequential's forward failed" in r.message for r in caplog.records) == 1
    with torch.no_grad():
        for out in outs:
            torch.testing.assert_close(out, model(x), atol=1e-5, rtol=1e-5)
    assert CALL.format("Sequential") not in reasons(ctx)
    with pytest.raises(torch._dynamo.exc.Unsupported):
        m2 = net().eval()
        for _ in range(2):
            with torch.no_grad(), torchfuse.lazy(options={"strict": True}):
                m2(x)


def test_batch_norm_cnn_step_matches_eager():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                          nn.Conv2d(8, 8, 3, stride=2, groups=2), nn.BatchNorm2d(8), nn.ReLU(),
                          nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 5))
    ref = copy.deepcopy(model)
    opt, ref_opt = (torch.optim.SGD(m.parameters(), lr=0.05) for m in (model, ref))
    ctx = torchfuse.lazy()
    for batch in [4, 4, 4]:
        x, y = torch.randn(batch, 3, 11, 11), torch.randint(0, 5, (batch,))
        with ctx:
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
        ref_loss = F.cross_entropy(ref(x), y)
        ref_loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        torch.testing.assert_close(loss.detach(), ref_loss.detach(), atol=1e-5, rtol=1e-5)
    for a, b in zip([*model.parameters(), *model.buffers()], [*ref.parameters(), *ref.buffers()]):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    assert reasons(ctx).count(CALL.format("Sequential")) == 2


def test_many_modules_are_each_compiled():
    """Each captured module has its own compiled code: more modules than Dynamo's recompile
    limit (8 per code object) all run compiled, and match eager."""
    torch.manual_seed(0)
    models = [nn.Sequential(nn.Linear(8, 8), nn.Tanh()).eval() for _ in range(12)]
    x = torch.randn(3, 8)
    ctx = torchfuse.lazy()
    for _ in range(3):
        with torch.no_grad(), ctx:
            outs = [m(x) for m in models]
        with torch.no_grad():
            for m, out in zip(models, outs):
                torch.testing.assert_close(out, m(x))
    assert reasons(ctx).count(CALL.format("Sequential")) == 2 * len(models), ctx.explain()
    assert all(type(out) is torch.Tensor for out in outs)
    stats = torch._dynamo.utils.counters["stats"]
    assert not torch._dynamo.utils.counters["recompile_limit"] and stats["unique_graphs"] >= len(models)


def test_optimizer_step_runs_after_pending_values_are_computed():
    """An optimizer step runs outside the lazy mode; what is pending (here a value that reads
    the weights) is computed first, so it sees the weights from before the update."""
    torch.manual_seed(0)
    lin = nn.Linear(4, 3)
    ref = copy.deepcopy(lin)
    grads = [torch.randn_like(p) for p in lin.parameters()]
    for p, q, g in zip(lin.parameters(), ref.parameters(), grads):
        p.grad, q.grad = g.clone(), g.clone()
    opt, ref_opt = (torch.optim.AdamW(m.parameters(), lr=0.1) for m in (lin, ref))
    x = torch.randn(2, 4)
    with torch.no_grad(), torchfuse.lazy(capture_modules=False) as ctx:
        y = torch.tanh(lin(x)) * 2           # pending: reads the weights
        opt.step()
        after = lin(x) + 1                   # recorded on the updated weights
    with torch.no_grad():
        torch.testing.assert_close(y, torch.tanh(ref(x)) * 2)
        ref_opt.step()
        torch.testing.assert_close(after, ref(x) + 1)
    for p, q in zip(lin.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q)
    assert reasons(ctx)[0] == "an optimizer step", ctx.explain()
