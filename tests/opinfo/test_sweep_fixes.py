"""Focused tests for the lowering bugs the OpInfo sweep and the fuzzer found (and that are fixed)."""
from __future__ import annotations

import torch


def test_squeeze_of_0d(tf):
    # OpInfo squeeze sample 7: squeeze(0) of a 0-d tensor indexed its (missing) dim 0
    tf.check(lambda x: x.sin().squeeze(0), torch.tensor(0.5))
    tf.check(lambda x: x.sin().squeeze(-1) + 1, torch.tensor(0.5))


def test_index_select_of_0d(tf):
    # OpInfo index_select sample 0: a 0-d input has no dim to index
    # (aten's op: torch_geometric, which the library zoo's tests import, patches torch.index_select
    # with a version that rejects 0-d inputs)
    tf.check(lambda x, i: torch.ops.aten.index_select(x.cos(), 0, i), torch.tensor(0.25), torch.tensor([0]))


def test_split_of_input_is_zero_copy(tf):
    # OpInfo chunk/split/unbind: the pieces of a stored tensor are views of it, as in eager
    x = torch.randn(6, 5)
    e = tf.check(lambda x: torch.split(x, 2), x, min_kernels=0)
    assert all(o.untyped_storage().data_ptr() == x.untyped_storage().data_ptr() for o in e.output)
    tf.check(lambda x: x.unbind(1), x, min_kernels=0)
    tf.check(lambda x: [c * 2 for c in x.chunk(3, 0)], x)


def test_complex_values_fall_back(tf):
    # OpInfo fft.fft2: constant_pad_nd of a complex tensor reached the C++ code generator
    x = torch.randn(3, 4)
    fn = lambda x: torch.nn.functional.pad(x.to(torch.complex64), (1, 2)) * 2  # noqa: E731
    expected = fn(x)
    e = tf.explain(fn, x)
    assert e.fallbacks and all("complex" in f.reason for f in e.fallbacks), [f.reason for f in e.fallbacks]
    torch.testing.assert_close(e.output, expected)


def test_empty_repeat_reshape_roll(tf):
    # fuzzer: index maths modulo a zero size (ZeroDivisionError at compile time)
    x = torch.randn(5, 5, 5)
    tf.check(lambda x: x[0:0].neg().repeat(1, 2, 1), x, min_kernels=0)
    tf.check(lambda x: x[:, 0:0].neg().reshape(-1, 5), x, min_kernels=0)
    tf.check(lambda x: torch.roll(x[:, 0:0].neg(), 2), x, min_kernels=0)


def test_signbit_of_bf16_builds(tf):
    # OpInfo signbit (bfloat16): std::signbit of a float reinterpreted from bf16 bits crashed GCC 12's
    # vectorizer (internal compiler error); backends/cpp/codegen.py now emits tf_signbit (copysign + compare)
    specials = [-0.0, 0.0, float("nan"), -float("nan"), -1.5, 2.0, float("inf"), -float("inf")]
    for dt in (torch.bfloat16, torch.float16, torch.float32, torch.float64):
        x = torch.tensor(specials * 4, dtype=dt)
        tf.check(lambda x: torch.signbit(x), x, options={"parallel_threshold": 1})
    tf.check(lambda x: torch.signbit(x), torch.arange(-5, 27))



def test_interpreter_gap_is_skipped_not_a_crash(tmp_path, monkeypatch):
    # Triton sweep under TRITON_INTERPRET (warm): atan2's libdevice function is missing from the
    # CPU interpreter; strict compiles raised it and the sweep called it a crash.  The C++ run
    # of the same op still matches eager, cold and warm.
    import pytest
    pytest.importorskip("triton")
    from torch.testing._internal.common_methods_invocations import op_db

    from torchfuse.tools import opinfo_sweep as sweep
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setenv("TORCHFUSE_CACHE_DIR", str(tmp_path))
    (op,) = [o for o in op_db if o.name == "atan2" and not o.variant_test_name]
    r = sweep.run_op(op, torch.float32, "cpu", 2, {"cpu_backend": "triton"}, warm=True)
    assert r.status == "skipped" and sweep.INTERPRETER_GAP in r.detail, r
    r = sweep.run_op(op, torch.float32, "cpu", 2, warm=True)
    assert r.status == "lowered", r
