"""Tests for torchfuse.pipeline.compile_graph: the per-graph pipeline driven directly
on aten graphs traced with make_fx (no Dynamo), so its contract can be checked on its own: boxed
calling convention, report filling, debug folder, eager fallback on lowering or build failure,
strict mode, graphs without kernels, symbolic sizes and inputs with unexpected strides."""
from __future__ import annotations

import warnings

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from torchfuse import Config, Explanation, counters
from torchfuse.frontend.decompositions import decomposition_table
from torchfuse.ir.buffers import Unsupported
from torchfuse import pipeline as compiled_graph
from torchfuse.pipeline import compile_graph
from torchfuse.backends.cpp.build import CompileError

KEYS = ("graphs_compiled", "kernels_generated", "kernel_builds", "cache_hits_disk", "cache_hits_memory",
        "fallback_ops", "eager_fallbacks")


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def snapshot() -> dict[str, int]:
    return {k: counters[k] for k in KEYS}


def delta(before: dict[str, int]) -> dict[str, int]:
    return {k: counters[k] - before[k] for k in KEYS}


def randn(*shape: int) -> torch.Tensor:
    x = torch.randn(*shape)
    return torch.where(x.abs() < 1e-3, torch.full_like(x, 0.5), x)


def trace(fn, *args, mode: str = "fake") -> torch.fx.GraphModule:
    return make_fx(fn, decomposition_table=decomposition_table(), tracing_mode=mode)(*args)


def assert_outputs(actual, expected, atol=1e-5, rtol=1e-5):
    assert isinstance(actual, tuple) and len(actual) == len(expected)
    for a, e in zip(actual, expected):
        if isinstance(e, torch.Tensor):
            assert a.shape == e.shape and a.dtype == e.dtype
            torch.testing.assert_close(a, e, atol=atol, rtol=rtol)
        else:
            assert a == e


def fn_mixed(x, y):
    """A softmax (decomposed into reductions), pointwise ops and a matmul (ATen fallback)."""
    return torch.softmax(x, -1) * y + 1, (x @ y.t()).relu()


def test_boxed_call_convention_and_results(tmp_path):
    x, y = randn(4, 6), randn(4, 6)
    gm = trace(fn_mixed, x, y)
    before = snapshot()
    call = compile_graph(gm, Config(cache_dir=tmp_path), inference=True)
    d = delta(before)
    assert d["graphs_compiled"] == 1 and d["kernels_generated"] >= 1 and d["fallback_ops"] == 1
    assert getattr(call, "_boxed_call", False)
    args = [x, y]
    out = call(args)
    assert args == [], "a boxed callable must clear its argument list"
    assert_outputs(out, fn_mixed(x, y))
    # Reusable, and the inputs are not written.
    x0, y0 = x.clone(), y.clone()
    x2, y2 = randn(4, 6), randn(4, 6)
    assert_outputs(call([x2, y2]), fn_mixed(x2, y2))
    assert torch.equal(x, x0) and torch.equal(y, y0)


def test_report_is_filled(tmp_path):
    x, y = randn(3, 5), randn(3, 5)
    gm = trace(fn_mixed, x, y)
    report = Explanation()
    call = compile_graph(gm, Config(cache_dir=tmp_path), inference=False, kind="forward", report=report)
    assert_outputs(call([x, y]), fn_mixed(x, y))
    assert len(report.graphs) == 2
    assert "aten graph" in report.graphs[0] and "after passes" in report.graphs[1]
    assert "_forward" in report.graphs[0].splitlines()[0]
    assert report.kernels and all(k.backend == "cpp" and 'extern "C"' in k.source for k in report.kernels)
    assert [f.op for f in report.fallbacks] == ["aten.mm.default"]
    assert report.passes and all("_forward" in p for p in report.passes)


def test_debug_writer_stages_in_order(tmp_path):
    x = randn(5, 7)
    gm = trace(lambda t: (torch.softmax(t, -1) * 3 - t,), x)
    cfg = Config(cache_dir=tmp_path / "cache", debug=True, debug_dir=tmp_path / "dbg")
    call = compile_graph(gm, cfg, inference=False, kind="backward")
    assert_outputs(call([x]), (torch.softmax(x, -1) * 3 - x,))
    dirs = list((tmp_path / "dbg").iterdir())
    assert len(dirs) == 1 and dirs[0].name.endswith("_backward")
    names = sorted(p.name for p in dirs[0].iterdir())
    # Numbered in the order written: 00_, 01_, ... with no gaps; the first four stages are fixed.
    assert [n[:3] for n in names] == [f"{k:02d}_" for k in range(len(names))], names
    assert [n[3:] for n in names[:4]] == ["aten_graph.txt", "passes.txt", "loop_ir.txt", "fusion.txt"]
    assert sorted(n[3:] for n in names[4:]) == ["kernels.cpp", "memory.txt", "wrapper.py"], names
    text = {n[3:]: (dirs[0] / n).read_text() for n in names}
    assert "aten." in text["aten_graph.txt"]
    assert 'extern "C"' in text["kernels.cpp"]
    assert "def call" in text["wrapper.py"]


def test_no_debug_folder_by_default(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("TORCHFUSE_DEBUG", raising=False)
    x = randn(3, 3)
    call = compile_graph(trace(lambda t: (t.exp() + 2,), x), Config(cache_dir=tmp_path / "c"), inference=True)
    assert_outputs(call([x]), (x.exp() + 2,))
    assert not (tmp_path / "torchfuse_debug").exists()


def test_build_failure_falls_back_to_eager(tmp_path):
    x = randn(4, 4)
    gm = trace(lambda t: (t.sin() * 2 + t.cos(),), x)
    cfg = Config(cache_dir=tmp_path, cxx_flags=("-fPIC", "-shared", "--definitely-not-a-flag"))
    before = snapshot()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        call = compile_graph(gm, cfg, inference=True)
    ours = [str(w.message) for w in caught if "torchfuse" in str(w.message)]
    assert len(ours) == 1 and "eagerly" in ours[0] and "definitely-not-a-flag" in ours[0]
    assert delta(before)["eager_fallbacks"] == 1
    assert getattr(call, "_boxed_call", False)
    args = [x]
    assert_outputs(call(args), (x.sin() * 2 + x.cos(),))
    assert args == []


def test_build_failure_strict_raises(tmp_path):
    x = randn(4, 4)
    gm = trace(lambda t: (t.sin() * 2 + t.cos(),), x)
    cfg = Config(cache_dir=tmp_path, strict=True, cxx_flags=("-fPIC", "-shared", "--definitely-not-a-flag"))
    with pytest.raises(CompileError, match="definitely-not-a-flag"):
        compile_graph(gm, cfg, inference=True)


def test_unsupported_lowering_falls_back_to_eager(tmp_path, monkeypatch):
    def refuse(gm, config):
        raise Unsupported("test refusal")

    monkeypatch.setattr(compiled_graph, "lower_graph", refuse)
    x = randn(3, 5)
    gm = trace(lambda t: (t.tanh() + 1,), x)
    before = snapshot()
    with pytest.warns(UserWarning, match="test refusal"):
        call = compile_graph(gm, Config(cache_dir=tmp_path), inference=True)
    assert delta(before)["eager_fallbacks"] == 1
    assert_outputs(call([x]), (x.tanh() + 1,))


def test_a_failed_compile_is_a_value_that_carries_its_reason(tmp_path, monkeypatch):
    """try_compile_graph says nothing and counts nothing: it returns an EagerFallback (stage,
    reason) that runs the graph as traced; compile_graph derives one warning and one count."""
    from torchfuse.pipeline import EagerFallback, eager_fallback, try_compile_graph

    def refuse(gm, config):
        raise Unsupported("test refusal")

    monkeypatch.setattr(compiled_graph, "lower_graph", refuse)
    x = randn(5, 3).t()
    gm = trace(lambda t: (t.exp() * 3,), x)
    before = snapshot()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        result = try_compile_graph(gm, Config(cache_dir=tmp_path), inference=True)
    assert isinstance(result, EagerFallback) and eager_fallback(result) is result
    assert (result.stage, result.reason) == ("lowering", "test refusal") and "test refusal" in result.message
    assert delta(before).get("eager_fallbacks", 0) == 0
    assert_outputs(result([x]), (x.exp() * 3,))
    with pytest.warns(UserWarning, match="runs eagerly: test refusal"):
        compile_graph(gm, Config(cache_dir=tmp_path), inference=True)
    assert delta(before)["eager_fallbacks"] == 1


def test_graph_without_kernels_builds_nothing(tmp_path):
    a, b = randn(3, 4), randn(4, 5)
    gm = trace(lambda p, q: (p @ q,), a, b)
    before = snapshot()
    call = compile_graph(gm, Config(cache_dir=tmp_path), inference=True)
    d = delta(before)
    assert d["kernels_generated"] == 0 and d["kernel_builds"] == 0 and d["fallback_ops"] == 1
    assert not list(tmp_path.rglob("*.so"))
    assert_outputs(call([a, b]), (a @ b,))


def test_no_passes_and_no_fusion(tmp_path):
    x = randn(6, 8)
    f = lambda t: (((t * 2).exp() + 1).log() - t,)  # noqa: E731
    gm = trace(f, x)
    report = Explanation()
    before = snapshot()
    call = compile_graph(gm, Config(cache_dir=tmp_path, passes=(), fuse=False), inference=True, report=report)
    assert report.passes == []
    assert delta(before)["kernels_generated"] >= 4
    assert_outputs(call([x]), f(x))


def test_symbolic_sizes(tmp_path):
    f = lambda x, y: (torch.softmax(x, -1) * y + x.sum(0), x.size(0) * 2)  # noqa: E731
    gm = trace(f, randn(4, 6), randn(4, 6), mode="symbolic")
    call = compile_graph(gm, Config(cache_dir=tmp_path), inference=True)
    for rows in (2, 5, 9):
        x, y = randn(rows, 6), randn(rows, 6)
        assert_outputs(call([x, y]), f(x, y))


def test_inputs_with_other_strides_than_traced(tmp_path):
    f = lambda x, y: (x * 2 + y.sum(-1, keepdim=True), (x - y).abs())  # noqa: E731
    x, y = randn(5, 7), randn(5, 7)
    call = compile_graph(trace(f, x, y), Config(cache_dir=tmp_path), inference=True)
    xt = randn(7, 5).t()                      # same shape, transposed strides
    ys = randn(5, 14)[:, ::2]                 # same shape, strided
    assert_outputs(call([xt, ys]), f(xt, ys))


def test_num_threads_option(tmp_path):
    x = randn(300, 300)  # above the parallel threshold
    f = lambda t: (torch.softmax(t, -1) + t.sigmoid(),)  # noqa: E731
    for threads in (1, 2):
        cfg = Config(cache_dir=tmp_path, num_threads=threads, parallel_threshold=1024)
        call = compile_graph(trace(f, x), cfg, inference=True)
        assert_outputs(call([x]), f(x))


def test_triton_launch_site_binds_after_first_launch(monkeypatch):
    """A call site takes the helper (which plans, compiles and verifies a direct launcher) on
    the first call of each shape class (its sizes and symbols), and on pointers not 16-byte
    aligned; otherwise it calls the launcher bound to that class with the buffers' addresses.
    Classes seen before stay bound (a dynamic graph alternating sizes launches directly), at
    most _SITE_CLASSES of them."""
    from torchfuse.backends.triton import launch as triton_launch
    calls = []

    class Fast:
        def bind(self, grid, tail, n_args):
            return lambda *args: calls.append(("bound", grid, tail, args, n_args))

    def helper(kernel, xnumel, big, *args, fast=Fast()):
        calls.append(("helper", xnumel, args))
        return fast, (kernel, (xnumel // 4, 1, 1), (xnumel, 1), (4, 1, big), 4, ("XBLOCK", "RBLOCK", "BIG"))

    site = triton_launch.make_site(helper, ("k",), 2, 2, 1)
    a, b = torch.randn(64), torch.randn(64)
    pa, pb = a.data_ptr(), b.data_ptr()
    site(64, False, a, b, 7)
    site(64, False, a, b, 7)
    site(32, False, a, b, 7)
    site(32, False, a, b, 7)
    site(32, False, a[1:], b, 7)
    site(32, False, a, b, 7)
    site(32, False, a, b, 8)
    site(64, False, a, b, 7)          # an earlier class: still bound
    site(32, False, a, b, 8)
    assert [c[0] for c in calls] == ["helper", "bound", "helper", "bound", "helper", "bound", "helper", "bound",
                                     "bound"]
    assert calls[1] == ("bound", (16, 1, 1), (64, 1), (pa, pb, 7), 3)
    assert calls[3] == ("bound", (8, 1, 1), (32, 1), (pa, pb, 7), 3)
    assert calls[5] == calls[3] and calls[7] == calls[1]
    assert calls[8] == ("bound", (8, 1, 1), (32, 1), (pa, pb, 8), 3)

    never = triton_launch.make_site(lambda *a: (False, None), ("k",), 1, 1, 0)     # no direct launcher: always the helper
    never(4, a)
    never(4, a)
    assert never._tf_bound == {}

    monkeypatch.setattr(triton_launch, "_SITE_CLASSES", 3)
    calls.clear()
    small = triton_launch.make_site(helper, ("k",), 2, 1, 0)
    for n in (8, 16, 24, 32, 8):       # the fourth class starts the table afresh
        small(n, False, a)
        small(n, False, a)
    assert len(small._tf_bound) == 2 and [c[0] for c in calls].count("helper") == 5


def test_fallbacks_call_the_python_binding_only_when_it_binds_the_same_overload():
    from torchfuse.codegen.wrapper import python_binding
    aten, VF = torch.ops.aten, torch._C._VariableFunctions
    assert python_binding(aten.convolution.default, 9) is VF.convolution
    assert python_binding(aten.mm.default, 2) is VF.mm                  # mm.dtype needs a third argument
    assert python_binding(aten.addmm.default, 3, frozenset({"beta"})) is VF.addmm
    # add.Tensor / add.Scalar, max.dim / max.other ...: the binding could pick another overload
    assert python_binding(aten.add.Tensor, 2) is aten.add.Tensor
    assert python_binding(aten.max.dim, 2) is aten.max.dim
    flash = aten._scaled_dot_product_flash_attention.default
    assert python_binding(flash, 3, frozenset({"scale"})) is VF._scaled_dot_product_flash_attention
    assert python_binding(flash, 6) is flash                             # .quantized takes 6 positional too
    # copy_.Tensor (TorchScript's) takes two tensors too: the op stays
    assert python_binding(aten.copy_.default, 2) is aten.copy_.default
    # an in-place op calls its Tensor method
    assert python_binding(aten.index_copy_.default, 4) is torch._C.TensorBase.index_copy_
    assert python_binding(aten.index_copy.default, 4) is VF.index_copy
    assert python_binding(aten.mm.out, 2) is aten.mm.out                  # out= variants stay ops


def test_in_place_fallback_is_called_through_its_tensor_method():
    """A graph that keeps an in-place ATen op (make_fx without functionalization, as lazy mode
    records) calls the resolved Tensor method from the wrapper, with eager's result."""
    def f(x, idx, src):
        y = x * 2
        y.index_copy_(0, idx, src)
        return (y + 1,)

    x, idx, src = randn(7, 5), torch.tensor([4, 1]), randn(2, 5)
    call = compile_graph(trace(f, x, idx, src), Config(), inference=True)
    assert_outputs(call([x, idx, src]), f(x, idx, src))
    constants = call._torchfuse_code.globals.values()
    assert any(c is torch._C.TensorBase.index_copy_ for c in constants)
    assert not any(isinstance(c, torch._ops.OpOverload) for c in constants)


def test_fallback_bindings_match_eager(tf):
    """Matmul, convolution and embedding run through ATen via their bindings, as eager."""
    import torch.nn.functional as F

    def fn(x, w, c, k, idx, table):
        y = (x @ w).relu()
        z = F.conv2d(c, k, padding=1).sigmoid()
        return y * 2, z + 1, F.embedding(idx, table) * 3
    args = (tf.rand((5, 7)), tf.rand((7, 3)), tf.rand((2, 3, 6, 5)), tf.rand((4, 3, 3, 3)),
            torch.randint(0, 9, (4, 2)), tf.rand((9, 6)))
    tf.check(fn, *args, allow_fallbacks=("aten.mm.default", "aten.convolution.default", "aten.embedding.default"),
             min_kernels=1, atol=1e-5, rtol=1e-5)
