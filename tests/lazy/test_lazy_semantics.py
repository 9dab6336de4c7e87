"""torchfuse.lazy keeps eager semantics: aliasing and in-place updates, values escaping the block,
reads that leave the tensor world (.item(), print, bool, numpy, data_ptr), autograd, random ops,
the decorator forms and nesting."""
from __future__ import annotations

import copy
import io
import pickle

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import torchfuse
from torchfuse import counters
from torchfuse.lazy import LazyTensor


def r(*shape: int) -> torch.Tensor:
    return torch.randn(shape)


def same(a: torch.Tensor, b: torch.Tensor) -> None:
    assert a.shape == b.shape and a.dtype == b.dtype
    torch.testing.assert_close(a.clone(), b)


# ------------------------------------------------------------------------------------------
# in-place updates and views
# ------------------------------------------------------------------------------------------

def test_inplace_on_an_input_of_a_pending_value():
    x = r(4, 5)
    x0 = x.clone()
    with torchfuse.lazy() as ctx:
        y = x * 2 + 1            # reads x before the update
        v = x[1]                 # a view of x: sees the update
        x.add_(1)
        z = x * 3                # reads x after the update
    assert "aten.add_.Tensor writes memory" in ctx.flushes[0].reason
    assert ctx.flushes[0].ops == 2
    same(y, x0 * 2 + 1)
    same(z, (x0 + 1) * 3)
    same(v, (x0 + 1)[1])


def test_inplace_on_a_view_of_an_input():
    x = r(4, 5)
    x0 = x.clone()
    with torchfuse.lazy():
        s = x.sum(0)
        x[2].mul_(0)             # writes x through a view
        t = x.sum(0)
    same(s, x0.sum(0))
    x0[2] = 0
    same(t, x0.sum(0))


def test_inplace_on_pending_value_is_recorded():
    x = r(4, 5)
    with torchfuse.lazy() as ctx:
        y = x * 2
        w = y + 1                # before the update
        y.add_(1)
        y.mul_(3)
        y.clamp_(max=4.0)
        u = y.sum()
    assert len(ctx.flushes) == 1, ctx.explain()
    assert "aten.clamp.default" in ctx.flushes[0].op_names
    same(y, ((x * 2 + 1) * 3).clamp(max=4.0))
    same(w, x * 2 + 1)
    same(u, ((x * 2 + 1) * 3).clamp(max=4.0).sum())


def test_inplace_dtype_cast_and_errors_match_eager():
    x = r(3, 3)
    with torchfuse.lazy():
        h = x.half() * 2
        h.add_(x)                # float32 other, float16 self: eager casts
        i = (x * 10).long()
        with pytest.raises(RuntimeError):
            i.add_(0.5 * x)      # float into long: eager raises
    same(h, (x.half() * 2).add_(x))


def test_inplace_through_a_pending_view():
    x = r(4, 5)
    with torchfuse.lazy():
        y = x * 2
        v = y[1:3]
        t = y.t()
        v.mul_(10)               # must show in y and in t
        s = y.sum()
    ref = x * 2
    ref[1:3] *= 10
    same(y, ref)
    same(t, ref.t())
    same(v, ref[1:3])
    same(s, ref.sum())
    assert v.data_ptr() == y.data_ptr() + 5 * 4
    assert t.data_ptr() == y.data_ptr()


def test_inplace_on_pending_base_with_pending_views():
    x = r(4, 5)
    with torchfuse.lazy():
        y = x.exp()
        v = y[0]
        q = y * 2                # computed from y before the update
        y.zero_()
    same(v, torch.zeros(5))
    same(q, x.exp() * 2)
    same(y, torch.zeros(4, 5))


def test_setitem_copy_and_out_on_pending():
    x, src = r(4, 5), r(5)
    with torchfuse.lazy():
        y = x + 1
        y[0] = 5.0
        y[1] = src * 2
        z = x.exp()
        z.copy_(src.sin())       # broadcast copy into a pending value
        o = torch.empty(4, 5)
        torch.mul(y, 2, out=o)
        p = x * 1
        torch.add(x, 1, out=p)   # out= into a pending value
    ref = x + 1
    ref[0] = 5.0
    ref[1] = src * 2
    same(y, ref)
    same(z, src.sin().expand(4, 5))
    same(o, ref * 2)
    same(p, x + 1)


def test_views_alias_after_compute_and_metadata_inplace():
    x = r(3, 4)
    with torchfuse.lazy():
        y = x * 2
        v = y.view(12)
    v[0] = 100.0
    assert y[0, 0].item() == 100.0
    y.t_()                       # metadata-changing in-place op on a computed value
    assert y.shape == (4, 3) and y.stride() == (1, 4)
    same(y, (x * 2).t().contiguous().index_put_((torch.tensor(0), torch.tensor(0)), torch.tensor(100.0)))


# ------------------------------------------------------------------------------------------
# values escaping the block
# ------------------------------------------------------------------------------------------

def test_values_escape_the_block():
    x = r(3, 3)
    with torchfuse.lazy() as ctx:
        y = (x + 1).relu()
        v = (x * 2).t()
    assert isinstance(y, LazyTensor) and y._lz_real is not None
    assert len(ctx.flushes) == 1
    out = y + 1
    assert type(out) is torch.Tensor          # ops outside the block run eagerly
    same(out, (x + 1).relu() + 1)
    same(v, (x * 2).t())
    assert v.stride() == (1, 3)
    y.add_(1)
    same(y, (x + 1).relu() + 1)
    assert y.data_ptr() != 0 and y.untyped_storage().nbytes() == 36
    same(torch.matmul(y, v), ((x + 1).relu() + 1) @ (x * 2).t())


def test_decorator_returns_plain_tensors():
    x = r(4)

    @torchfuse.lazy
    def f(t):
        return (t * 2).sin() + 1, {"k": t.exp()}

    a, d = f(x)
    assert type(a) is torch.Tensor and type(d["k"]) is torch.Tensor
    same(a, (x * 2).sin() + 1)
    same(d["k"], x.exp())
    assert len(f.lazy_context.flushes) == 1

    @torchfuse.lazy(options={"strict": True}, max_nodes=64)
    def g(t):
        return t.cos() * 3

    same(g(x), x.cos() * 3)
    assert g.lazy_context.max_nodes == 64 and g.lazy_context.config.strict


def test_exception_in_block_still_flushes_live_values():
    x = r(3)
    with pytest.raises(ValueError):
        with torchfuse.lazy():
            y = x * 4
            raise ValueError("boom")
    same(y, x * 4)


def test_nested_blocks():
    x = r(4)
    with torchfuse.lazy() as outer:
        a = x * 2
        with torchfuse.lazy() as inner:
            b = a + 1            # uses a pending value of the outer block
        # a is computed on the way to b and still referenced: it is stored too, not recomputed
        assert b._lz_real is not None and a._lz_real is not None
        assert inner.flushes[0].extra_outputs == 1
        c = a - 1
        d = c * 3
    same(a, x * 2)
    same(b, x * 2 + 1)
    same(c, x * 2 - 1)
    same(d, (x * 2 - 1) * 3)
    assert len(inner.flushes) == 1 and len(outer.flushes) == 1 and outer.flushes[0].ops == 2


def test_parameter_deepcopy_pickle_of_lazy_values():
    x = r(3, 3)
    with torchfuse.lazy():
        y = x * 2
    p = nn.Parameter(y)
    assert isinstance(p, nn.Parameter) and p.requires_grad
    same(p.detach(), x * 2)
    same(copy.deepcopy(y), x * 2)
    buf = io.BytesIO()
    torch.save(y, buf)
    buf.seek(0)
    same(torch.load(buf), x * 2)
    same(pickle.loads(pickle.dumps(y)), x * 2)


def test_inference_mode():
    x = r(3, 3)
    with torch.inference_mode(), torchfuse.lazy() as ctx:
        y = (x * 2).exp()
        z = y.sum().item()
    assert abs(z - (x * 2).exp().sum().item()) < 1e-3
    same(y, (x * 2).exp())
    assert ctx.flushes


# ------------------------------------------------------------------------------------------
# reads that leave the tensor world
# ------------------------------------------------------------------------------------------

def test_item_bool_float_flush():
    x = r(10)
    with torchfuse.lazy() as ctx:
        s = (x * 2).sum()
        val = s.item()
        assert len(ctx.flushes) == 1 and "item" in ctx.flushes[0].reason
        flag = bool((x.abs() > 100).any())
        f = float(x.max() * 3)
        i = int((x > 0).sum())
    assert val == pytest.approx((x * 2).sum().item(), abs=1e-4)
    assert flag is False
    assert f == pytest.approx(x.max().item() * 3, abs=1e-5)
    assert i == int((x > 0).sum())
    assert len(ctx.flushes) == 4


def test_print_tolist_numpy_data_ptr_flush(capsys):
    x = r(5)
    with torchfuse.lazy() as ctx:
        m = x * 2
        print(m)
        lst = (x + 1).tolist()
        arr = (x * 3).numpy()
        ptr = (x - 1).data_ptr()
        txt = f"{(x * 4).sum():.3f}"
        reasons = [f.reason for f in ctx.flushes]
    out = capsys.readouterr().out
    assert "tensor([" in out
    assert lst == pytest.approx((x + 1).tolist(), abs=1e-6)
    assert arr == pytest.approx((x * 3).numpy(), abs=1e-6)
    assert ptr != 0
    assert txt == f"{(x * 4).sum().item():.3f}"
    assert reasons == ["repr()/print()", ".tolist()", ".numpy()", ".data_ptr()", "format()"]


def test_printing_a_plain_tensor_compiles_nothing(capsys):
    x = r(3, 3)
    before = counters["lazy_flushes"]
    with torchfuse.lazy() as ctx:
        print(x)
        print(x.abs() > 5)       # a pending value prints through its own flush only
    assert "tensor(" in capsys.readouterr().out
    assert len(ctx.flushes) == 1 and counters["lazy_flushes"] - before == 1


# ------------------------------------------------------------------------------------------
# autograd and random ops
# ------------------------------------------------------------------------------------------

def test_autograd_grads_match():
    w = torch.randn(5, requires_grad=True)
    b = torch.randn(5, requires_grad=True)
    x = r(3, 5)
    with torchfuse.lazy() as ctx:
        mask = (x > 0).float()                 # no grad needed: lazy
        out = ((w * mask + b).tanh() * x.exp()).sum()
        assert out.requires_grad
        out.backward()
    w2 = w.detach().clone().requires_grad_()
    b2 = b.detach().clone().requires_grad_()
    ((w2 * (x > 0).float() + b2).tanh() * x.exp()).sum().backward()
    same(w.grad, w2.grad)
    same(b.grad, b2.grad)
    # forward and backward are recorded and compiled together, in one flush as backward ends
    assert [f.reason for f in ctx.flushes] == ["end of a backward pass"]
    assert "aten.tanh_backward.default" in ctx.flushes[0].op_names
    assert ctx.flushes[0].kernels >= 2


def test_autograd_through_lazy_values_and_training_step():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.GELU(), nn.LayerNorm(8), nn.Linear(8, 2))
    ref = copy.deepcopy(model)
    x, y = r(4, 6), torch.tensor([0, 1, 1, 0])
    with torchfuse.lazy():
        xn = (x - x.mean(0)) / (x.std(0) + 1e-5)    # lazy, no grad
        loss = F.cross_entropy(model(xn), y)
        loss.backward()
        with torch.no_grad():
            for p in model.parameters():
                p.sub_(0.1 * p.grad)                 # optimizer step, in place
    xr = (x - x.mean(0)) / (x.std(0) + 1e-5)
    lr = F.cross_entropy(ref(xr), y)
    lr.backward()
    with torch.no_grad():
        for p in ref.parameters():
            p.sub_(0.1 * p.grad)
    same(loss.detach(), lr.detach())
    for p, q in zip(model.parameters(), ref.parameters()):
        same(p.grad, q.grad)
        same(p.detach(), q.detach())


def test_requires_grad_on_a_lazy_value():
    x = r(4)
    with torchfuse.lazy():
        a = (x * 2).requires_grad_()
        out = (a.sin() * 3).sum()
        out.backward()
    same(a.grad, (x * 2).cos() * 3)


def test_random_ops_keep_the_random_stream():
    torch.manual_seed(1)
    with torchfuse.lazy():
        u = torch.rand(6) * 2
        d = F.dropout(torch.ones(6) * 3, 0.5, training=True)
        n = torch.randn(3, 3).relu()
    torch.manual_seed(1)
    same(u, torch.rand(6) * 2)
    same(d, F.dropout(torch.ones(6) * 3, 0.5, training=True))
    same(n, torch.randn(3, 3).relu())


def test_metadata_only_op_on_a_computed_value():
    """empty_like of a LazyTensor computed earlier in the block runs on its real tensor (it
    used to dispatch back to itself without end)."""
    x = r(3, 4)
    with torchfuse.lazy():
        y = x * 2
        y.sum().item()                   # y is computed now; z pending
        z = torch.empty_like(y, memory_format=torch.contiguous_format) + (y - 1) * 0 + 3
        w = (y + 1) * 2
    assert z.shape == (3, 4)
    same(w, (x * 2 + 1) * 2)
