"""Generated recorders (src/torchfuse/lazy/recorder.py): a program recorded again is recorded by
one generated function per trie step.  Each test runs a program eagerly and in lazy blocks until
it is predicted, compares every run with eager on fresh random inputs, and checks that an
argument the step did not see (another scalar, layout, output of a multi-output op, list
length) is not recorded from the step."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import torchfuse
from torchfuse.lazy import mode


def lazy_run(fn, *args, **kw):
    with torchfuse.lazy(options={"strict": True}, **kw) as ctx:
        out = fn(*args)
    return out, ctx


@pytest.fixture
def recorded(monkeypatch):
    """The ops recorded the ordinary way (not predicted by a generated recorder)."""
    calls = []
    original = mode._try_record

    def counting(ctx, func, info, args, kwargs):
        calls.append(func)
        return original(ctx, func, info, args, kwargs)
    monkeypatch.setattr(mode, "_try_record", counting)
    return calls


def program(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor, scale: float) -> torch.Tensor:
    h = F.layer_norm(x * scale + 1, (x.shape[-1],), w, b)        # pending, real, float, multi-output
    a, c = h.split([3, 4], dim=1)                                  # a list of outputs
    h = torch.cat([a * 2, c.relu()], 1)                            # a list of tensors
    h = h.view(-1).view(x.shape).sum(-1, keepdim=True)             # views, an int list, a bool
    h = h + torch.arange(h.shape[0], dtype=h.dtype).unsqueeze(1)  # a factory
    return h.to(torch.float64) * -0.0 + h.sum()                    # kwargs, -0.0


def test_every_argument_kind_is_recorded_by_a_generated_recorder(recorded):
    torch.manual_seed(0)
    w, b = torch.randn(7), torch.randn(7)
    for i in range(3):
        x = torch.randn(5, 7)
        expected = program(x, w, b, 1.5)
        out, ctx = lazy_run(program, x, w, b, 1.5)
        torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)     # (float32 math, then float64)
        assert ctx.kernels >= 1 and len(ctx.flushes) == 1
        if i == 0:
            kernels = ctx.kernels
        if i < 2:
            recorded.clear()
    # the third run: every op predicted and recorded by a generated function, same graph
    assert ctx.trace_misses == 0 and ctx.trace_hits == len(ctx.flushes[-1].funcs) > 10
    assert recorded == []
    assert ctx.kernels == kernels and ctx.flushes[-1].cache_hit


def test_a_different_scalar_is_not_recorded_from_the_step():
    torch.manual_seed(1)
    w, b = torch.randn(7), torch.randn(7)
    x = torch.randn(5, 7)
    for _ in range(2):
        lazy_run(program, x, w, b, 1.5)
    for scale in (2.5, -1.5):
        out, ctx = lazy_run(program, x, w, b, scale)
        torch.testing.assert_close(out, program(x, w, b, scale), atol=1e-5, rtol=1e-5)
        assert ctx.trace_misses >= 1


def zero_times(x: torch.Tensor, zero: float) -> torch.Tensor:
    return (x + 1) * zero


def test_signed_zero_scalars_are_told_apart():
    torch.manual_seed(2)
    x = torch.randn(4, 6)
    for zero in (0.0, 0.0, -0.0, -0.0, 0.0):
        out, _ = lazy_run(zero_times, x, zero)
        expected = zero_times(x, zero)
        assert torch.equal(out, expected) and torch.equal(out.signbit(), expected.signbit())


def scale_int(x: torch.Tensor, s) -> torch.Tensor:
    return (x + 1) * s


def test_an_int_and_a_float_scalar_are_told_apart():
    x = torch.randint(-5, 5, (3, 5), dtype=torch.int32)
    for s in (2, 2, 2.0, 2.0, 2):
        out, _ = lazy_run(scale_int, x, s)
        expected = scale_int(x, s)
        assert out.dtype == expected.dtype and torch.equal(out, expected)


def pick(x: torch.Tensor, k: int) -> torch.Tensor:
    parts = (x + 1).split(4, dim=1)
    return parts[k] * 2 + parts[1 - k]


def test_the_output_of_a_multi_output_producer_is_checked():
    """`parts[k] * 2` learnt with output 0: called with output 1 it is another step."""
    torch.manual_seed(3)
    x = torch.randn(3, 8)
    for k in (0, 0, 0, 1, 1, 0):
        out, _ = lazy_run(pick, x, k)
        torch.testing.assert_close(out, pick(x, k))


def sub(a: torch.Tensor, b: torch.Tensor, swap: bool) -> torch.Tensor:
    x, y = a + 1, b * 2
    return y - x if swap else x - y


def test_pending_inputs_are_checked_by_position():
    torch.manual_seed(4)
    a, b = torch.randn(4, 5), torch.randn(4, 5)
    for swap in (False, False, True, False, True):
        out, _ = lazy_run(sub, a, b, swap)
        torch.testing.assert_close(out, sub(a, b, swap))


def matmul_bias(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return (x + 1) * w + w.sum()


def test_a_real_tensor_of_another_layout_is_not_recorded_from_the_step():
    torch.manual_seed(5)
    x = torch.randn(6, 6)
    w = torch.randn(6, 6)
    for wi in (w, w, w.t(), w.t(), w[:, :6], torch.randn(6, 12)[:, ::2], w):
        out, _ = lazy_run(matmul_bias, x, wi)
        torch.testing.assert_close(out, matmul_bias(x, wi))


def cat_n(x: torch.Tensor, n: int) -> torch.Tensor:
    return torch.cat([x * (i + 1) for i in range(n)], 0).relu()


def test_a_list_of_another_length_is_not_recorded_from_the_step():
    torch.manual_seed(6)
    x = torch.randn(3, 4)
    for n in (2, 2, 2, 3, 3, 1, 2):
        out, _ = lazy_run(cat_n, x, n)
        torch.testing.assert_close(out, cat_n(x, n))


def view_then_update(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    y = x * 2
    v = y.view(-1)[1:]          # a pending view chain on y
    y.add_(1)                   # in place on y: the view must see it
    return v * 1, y


def test_a_predicted_view_marks_its_root():
    """Recorded from a generated function, a view still marks its pending root, so an in-place
    update of the root is not recorded by re-pointing the root (which the view would miss)."""
    torch.manual_seed(7)
    for _ in range(4):
        x = torch.randn(3, 5)
        (v, y), _ = lazy_run(view_then_update, x)
        ev, ey = view_then_update(x)
        torch.testing.assert_close(v, ev)
        torch.testing.assert_close(y, ey)


def chain(x: torch.Tensor, n: int) -> torch.Tensor:
    for i in range(n):
        x = x * 1.01 + i
    return x


@pytest.mark.parametrize("seed, n, option, reason, flushes", [
    (8, 40, {"max_nodes": 16}, "size limit", 4),      # predicted ops still flush at the size limit
    (9, 20, {"pipeline_ops": 8}, "pipeline", 3),      # predicted CPU ops are pipelined when asked
])
def test_predicted_ops_flush_at_the_limits(seed, n, option, reason, flushes):
    torch.manual_seed(seed)
    x = torch.randn(4, 4)
    for _ in range(3):
        out, ctx = lazy_run(chain, x, n, **option)
        torch.testing.assert_close(out, chain(x, n))
        assert [f.reason for f in ctx.flushes].count(reason) >= flushes, ctx.flushes


def test_the_module_hook_is_installed_only_for_blocks_that_capture_modules():
    hooks = torch.nn.modules.module._global_forward_pre_hooks
    model = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.GELU())
    x = torch.randn(3, 5)
    n = len(hooks)
    with torch.no_grad():
        expected = model(x)
        with torchfuse.lazy(capture_modules=False):
            assert len(hooks) == n
            out = model(x)
            with torchfuse.lazy():
                assert len(hooks) == n + 1
                inner = model(x)
            assert len(hooks) == n
        assert len(hooks) == n
        with torchfuse.lazy():
            assert len(hooks) == n + 1
            captured = model(x)
        assert len(hooks) == n
    for o in (out, inner, captured):
        torch.testing.assert_close(o, expected)


def test_a_computed_value_shares_its_result_s_memory_and_keeps_its_version():
    torch.manual_seed(10)
    x = torch.randn(4, 6)
    with torchfuse.lazy():
        y = x * 3 + 1
        v = y.t()
        version = y._version
        y_real = y * 1          # (pending: nothing computed yet)
    torch.testing.assert_close(y, x * 3 + 1)
    torch.testing.assert_close(v, (x * 3 + 1).t())
    assert y._version == version and not y_real.requires_grad
    assert v.data_ptr() == y.data_ptr() and v.stride() == (1, 6)
    y.add_(1)                   # after the block: a plain in-place op, seen through the view
    torch.testing.assert_close(v, (x * 3 + 2).t())
