"""Minimal repros of bugs found by the OpInfo sweep and the fuzzer whose fix lies outside the op
lowerings (lowering.py / wrapper.py); the unfixed ones stay xfailed (opinfo_sweep.KNOWN_FAILURES lists the
OpInfos they break).  Each test passes once its bug is fixed: then drop the mark."""
from __future__ import annotations

import torch

import torchfuse


def _check(fn, *args):
    expected = fn(*args)
    got = torchfuse.explain(fn, *args, options={"strict": True}).output
    for a, e in zip(got, expected):
        torch.testing.assert_close(a, e)


def test_outputs_viewing_one_unrealized_value():
    _check(lambda x: (lambda y: (y[:2], y[2:]))(x * 2), torch.randn(4, 3))


def test_output_and_its_view():
    _check(lambda x: (lambda y: (y[0], y))(x.neg()), torch.randn(5, 5))


def test_outputs_viewing_one_unrealized_value_wrong_values():
    _check(lambda a, b: (lambda y: (y[:, ::2], y.t()))(a + b), torch.randn(1, 5), torch.randn(1, 5))


def test_split_of_unrealized_value():
    _check(lambda x: torch.split(x.sin(), 2), torch.randn(4, 3))


def test_fallback_returning_one_element_list():
    _check(lambda x: torch.unsafe_split(x, 4), torch.randn(4, 3))


def test_effect_token_input():
    x = torch.randn(3, 3) + 3 * torch.eye(3)
    _check(lambda x: (torch.linalg.inv(x),), x)


def test_fallback_output_dtype_differs_from_fake():
    """PyTorch's fake _batch_norm_with_update_functional says fp32 running stats for fp16 inputs,
    eager returns fp16; the wrapper now casts an ATen fallback output to the dtype the kernels were
    generated for (codegen/wrapper.py WrapperBuilder._fallback) instead of misreading it."""
    torch.manual_seed(0)
    x, w, b = torch.randn(4, 5, 3).half(), torch.randn(5).half(), torch.randn(5).half()
    rm, rv = torch.randn(5).half(), torch.rand(5).half()
    fn = lambda x, w, b, rm, rv: torch.ops.aten._batch_norm_with_update(x, w, b, rm, rv, 0.5, 1e-5)  # noqa: E731
    rm_e, rv_e = rm.clone(), rv.clone()
    fn(x, w, b, rm_e, rv_e)
    torchfuse.explain(fn, x, w, b, rm, rv, options={"strict": True})
    torch.testing.assert_close(rm, rm_e)
    torch.testing.assert_close(rv, rv_e)
