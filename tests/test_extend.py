"""The extension API (torchfuse/extend.py): user graph passes by name, as callables and as
torch.fx PassBase objects, recorded like torchfuse's own and undone when they fail; a custom
operator that runs through ATen until a decomposition or a lowering lets it fuse."""
from __future__ import annotations

import os
import warnings

import pytest
import torch

import torchfuse
from torchfuse.passes import DEFAULT_PIPELINE, REGISTRY

aten = torch.ops.aten
os.environ.setdefault("TRITON_INTERPRET", "1")     # the Triton backend on CPU tensors


def _relu_of_add_to_clamp(gm, ctx) -> int:
    """A pattern rewrite: relu(add(a, b)) -> clamp_min(add(a, b), 0)."""
    changes = 0
    for node in list(gm.graph.nodes):
        if node.target is aten.relu.default and node.args[0].target is aten.add.Tensor:
            with gm.graph.inserting_after(node):
                new = gm.graph.call_function(aten.clamp_min.default, (node.args[0], 0))
            new.meta = dict(node.meta)
            node.replace_all_uses_with(new)
            gm.graph.erase_node(node)
            changes += 1
    return changes


def _fn(x, y):
    return torch.relu(x + y) * 2


@pytest.fixture
def registered():
    torchfuse.register_pass("relu_of_add_to_clamp", _relu_of_add_to_clamp)
    yield
    REGISTRY.pop("relu_of_add_to_clamp", None)


def test_registered_pass_runs_and_is_recorded(registered):
    x, y = torch.randn(6, 5), torch.randn(5)
    e = torchfuse.explain(_fn, x, y, options={"passes": ["relu_of_add_to_clamp", *DEFAULT_PIPELINE]})
    torch.testing.assert_close(e.output, _fn(x, y))
    rec = [r for r in e.passes if "relu_of_add_to_clamp" in r]
    assert len(rec) == 1 and "(1 changes)" in rec[0], e.passes
    assert "clamp_min" in "\n".join(e.graphs) and len(e.kernels) == 1


def test_callable_and_passbase_passes():
    from torch.fx.passes.infra.pass_base import PassBase, PassResult

    class CountNodes(PassBase):
        seen = 0

        def call(self, gm):
            CountNodes.seen = len(gm.graph.nodes)
            return PassResult(gm, False)

    x, y = torch.randn(6, 5), torch.randn(5)
    e = torchfuse.explain(_fn, x, y, options={"passes": [_relu_of_add_to_clamp, CountNodes(), "dce"]})
    torch.testing.assert_close(e.output, _fn(x, y))
    assert CountNodes.seen > 0
    assert any("_relu_of_add_to_clamp" in r and "(1 changes)" in r for r in e.passes), e.passes
    assert any("CountNodes" in r for r in e.passes), e.passes


@pytest.mark.parametrize("how", ["raises", "breaks the graph"])
def test_failing_pass_is_undone_with_a_warning(how):
    def bad(gm, ctx):
        node = next(n for n in gm.graph.nodes if n.target is aten.mul.Tensor)
        if how == "raises":
            node.args = (node.args[0], 3)        # a half-done rewrite, then a crash
            raise RuntimeError("my pass has a bug")
        gm.graph.erase_node(next(n for n in gm.graph.nodes if n.op == "output"))   # no output: lint fails
        return 1

    x, y = torch.randn(6, 5), torch.randn(5)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        e = torchfuse.explain(_fn, x, y, options={"passes": [bad, *DEFAULT_PIPELINE]})
    torch.testing.assert_close(e.output, _fn(x, y))            # the graph as it was before the pass
    said = [str(w.message) for w in caught if "graph pass 'bad' failed" in str(w.message)]
    assert len(said) == 1 and "undone" in said[0], [str(w.message) for w in caught]


def test_pass_registration_is_checked():
    with pytest.raises(ValueError, match="built-in"):
        torchfuse.register_pass("cse", _relu_of_add_to_clamp)
    with pytest.raises(ValueError, match="unknown pass"):
        torchfuse.compile(lambda x: x, options={"passes": ["no_such_pass"]})


# --- a custom operator ----------------------------------------------------------------------

@torch.library.custom_op("torchfuse_test::squash", mutates_args=())
def squash(x: torch.Tensor) -> torch.Tensor:
    return x * torch.sigmoid(x) * 0.5


@squash.register_fake
def _(x):
    return torch.empty_like(x)


def _squash_backward(ctx, grad):
    x, = ctx.saved_tensors
    s = torch.sigmoid(x)
    return grad * 0.5 * (s + x * s * (1 - s))


squash.register_autograd(_squash_backward, setup_context=lambda ctx, inputs, output: ctx.save_for_backward(*inputs))


def _model(x, w):
    return squash(x @ w + 1) * 3


def _check(e, x, w):
    torch.testing.assert_close(e.output, _model(x, w), rtol=1e-5, atol=1e-5)


def test_custom_op_falls_back_then_fuses_after_decomposition():
    op = torch.ops.torchfuse_test.squash.default
    x, w = torch.randn(7, 6), torch.randn(6, 6)
    xs, ws = x.clone().requires_grad_(), w.clone().requires_grad_()
    e = torchfuse.explain(_model, xs, ws)
    _check(e, x, w)
    assert any("squash" in f.op for f in e.fallbacks), [f.op for f in e.fallbacks]
    e.output.sum().backward()                    # before: through ATen, with its own autograd
    xe, we = x.clone().requires_grad_(), w.clone().requires_grad_()
    _model(xe, we).sum().backward()
    torch.testing.assert_close(xs.grad, xe.grad, rtol=1e-4, atol=1e-5)
    with torchfuse.lazy() as ctx:
        _model(x, w)
    assert any("squash" in str(f) and "not fusible" in str(f) for f in ctx.flushes), ctx.flushes
    torchfuse.register_decomposition(op, lambda x: x * torch.sigmoid(x) * 0.5)
    try:
        xs, ws = x.clone().requires_grad_(), w.clone().requires_grad_()
        e = torchfuse.explain(_model, xs, ws)
        _check(e, x, w)
        forward = [k for k in e.kernels if k.graph.endswith("_forward")]
        assert not any("squash" in f.op for f in e.fallbacks) and len(forward) == 1, str(e)
        e.output.sum().backward()
        with torchfuse.lazy() as ctx:             # the other front door fuses it too
            lazy_out = _model(x, w)
        torch.testing.assert_close(lazy_out, _model(x, w), rtol=1e-5, atol=1e-5)
        assert not any("squash" in str(f) for f in ctx.flushes), ctx.flushes
        xe, we = x.clone().requires_grad_(), w.clone().requires_grad_()
        _model(xe, we).sum().backward()
        torch.testing.assert_close(xs.grad, xe.grad, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(ws.grad, we.grad, rtol=1e-4, atol=1e-5)
    finally:
        from torchfuse import extend
        extend._decompositions.pop(op, None)


@pytest.mark.parametrize("backend", ["cpp", "triton"])
def test_custom_op_fuses_after_a_lowering(backend):
    from torchfuse.lowering.pointwise import pointwise
    from torchfuse.lowering.registry import LOWERINGS
    from torchfuse.ir.nodes import const
    from torchfuse.ir.nodes import op as ir

    target = torch.ops.torchfuse_test.squash.default

    def lower_squash(lw, x):
        return pointwise(lw, [x], lambda a: ir("mul", ir("mul", a, ir("sigmoid", a, dtype=a.dtype), dtype=a.dtype),
                                               const(0.5, a.dtype), dtype=a.dtype))

    torchfuse.register_lowering(target, lower_squash)
    try:
        x, w = torch.randn(7, 6), torch.randn(6, 6)
        if backend == "triton":
            pytest.importorskip("triton")
        with torch.no_grad():
            e = torchfuse.explain(_model, x, w, options={"cpu_backend": backend})
        _check(e, x, w)
        assert not any("squash" in f.op for f in e.fallbacks) and len(e.kernels) == 1, str(e)
    finally:
        LOWERINGS.pop(target, None)


def test_readme_example_runs(capsys):
    """The README's extension example, run as written: the custom op first falls back, then fuses."""
    import re
    from pathlib import Path
    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    code = re.search(r"<!-- extend-example -->\n```python\n(.*?)```", readme, re.S).group(1)
    try:
        exec(compile(code, "README.md", "exec"), {})
    finally:
        REGISTRY.pop("relu_to_clamp", None)
        from torchfuse import extend
        extend._decompositions.pop(torch.ops.demo.squash.default, None)
    fallbacks, kernels = capsys.readouterr().out.splitlines()[:2]
    assert int(fallbacks) >= 1 and int(kernels) == 1, (fallbacks, kernels)


@torch.library.custom_op("torchfuse_test::sum_squares", mutates_args=())
def sum_squares(x: torch.Tensor) -> torch.Tensor:
    return (x * x).sum(-1)


@sum_squares.register_fake
def _(x):
    return x.new_empty(x.shape[:-1])


@pytest.mark.parametrize("backend", ["cpp", "triton"])
def test_custom_reduction_fuses_after_a_lowering(backend):
    """A custom reduction lowered with the built-in `reduction` helper: its producer (x * 2 + 1)
    and its consumer (sqrt) fuse around it, one kernel."""
    from torchfuse.lowering.reduce import reduction
    from torchfuse.lowering.registry import LOWERINGS
    from torchfuse.ir.nodes import op as ir

    if backend == "triton":
        pytest.importorskip("triton")
    target = torch.ops.torchfuse_test.sum_squares.default

    def lower(lw, x):
        return reduction(lw, x, [x.ndim - 1], "sum", torch.float32, lw.out_dtype(), False,
                         pre=lambda v: ir("mul", v, v, dtype=v.dtype))

    def fn(x):
        return torch.sqrt(sum_squares(x * 2 + 1))

    x = torch.randn(9, 37)
    before = torchfuse.explain(fn, x, options={"cpu_backend": backend})
    torchfuse.register_lowering(target, lower)
    try:
        e = torchfuse.explain(fn, x, options={"cpu_backend": backend})
        torch.testing.assert_close(e.output, fn(x), rtol=1e-5, atol=1e-5)
        assert len(e.kernels) == 1 and not e.fallbacks, str(e)
        assert any("sum_squares" in f.op for f in before.fallbacks)
    finally:
        LOWERINGS.pop(target, None)
