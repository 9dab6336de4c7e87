"""Shared test setup for torchfuse.

* One kernel cache directory per test *session* (TORCHFUSE_CACHE_DIR, set before anything
  compiles), so identical graphs built by several tests are built once, and the user's own
  cache is never touched.
* Dynamo's caches are reset around every test, so a test never runs a graph compiled by another
  test (or with other options).
* `tf`: helpers that compile with torchfuse and compare against eager PyTorch.
* First calls wait for their kernels (TORCHFUSE_FIRST_CALLS=wait): what a test judges is the
  compiled graph, never the ATen tier that runs while kernels build (runtime/tiered.py).
"""
from __future__ import annotations

import os
import shutil
import tempfile
from typing import Any, Callable, Iterable, Mapping

import pytest
import torch

if not torch.cuda.is_available():
    # Triton kernels run on CPU tensors under Triton's interpreter; the variable must be set
    # before anything imports triton, or whichever test file imports it first decides the mode
    # for the whole session (tests/passes run alone first left later Triton tests compiled)
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Tests judge compiled graphs: a graph whose kernels still build in the background makes its first
# call wait for them, instead of running through ATen (Config.first_calls; tests/runtime/test_tiered.py
# passes first_calls="eager" where the eager tier is what it tests)
os.environ["TORCHFUSE_FIRST_CALLS"] = "wait"

import torchfuse
from torchfuse import counters

if "torchfuse" not in torch._dynamo.list_backends(exclude_tags=()):
    # the source tree on PYTHONPATH, not installed: no entry point registered the backend name
    from torchfuse.frontend.dynamo import torchfuse_backend
    torch._dynamo.register_backend(torchfuse_backend, name="torchfuse")


@pytest.fixture(scope="session", autouse=True)
def _torchfuse_cache_dir(tmp_path_factory: pytest.TempPathFactory):
    """A fresh kernel cache for this session (Config reads the variable when it is built), and
    a session temp folder for everything else the tests make through `tempfile` (build folders
    kept after a failed C++ build on purpose, private caches, subprocesses' TMPDIR); both are
    removed when the session ends.  TORCHFUSE_TEST_CACHE_DIR names a cache kept across sessions
    instead (.ci/run runs a slice twice against one, the second time warm)."""
    kept = os.environ.get("TORCHFUSE_TEST_CACHE_DIR")
    cache = kept or tmp_path_factory.mktemp("torchfuse_cache")
    scratch = tmp_path_factory.mktemp("tmp")
    old = {k: os.environ.get(k) for k in ("TORCHFUSE_CACHE_DIR", "TMPDIR")}
    old_tempdir = tempfile.tempdir
    os.environ["TORCHFUSE_CACHE_DIR"] = str(cache)
    os.environ["TMPDIR"] = tempfile.tempdir = str(scratch)
    yield
    tempfile.tempdir = old_tempdir
    for k, v in old.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
    shutil.rmtree(scratch, ignore_errors=True)
    if not kept:
        shutil.rmtree(cache, ignore_errors=True)


@pytest.fixture(autouse=True)
def _reset_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


# ----------------------------------------------------------------------------------------------
# comparison helpers
# ----------------------------------------------------------------------------------------------

# (atol, rtol) per dtype; integers and bools are compared exactly.
TOL = {
    torch.float64: (1e-7, 1e-7),
    torch.float32: (1e-5, 1e-5),
    torch.float16: (1e-2, 1e-2),
    torch.bfloat16: (2e-2, 2e-2),
}


def flatten(x: Any) -> list[Any]:
    if isinstance(x, (list, tuple)):
        return [y for item in x for y in flatten(item)]
    return [x]


def assert_same(actual: Any, expected: Any, *, atol: float | None = None, rtol: float | None = None,
                check_stride: bool = False, signed_zeros: bool = False, what: str = "") -> None:
    """torchfuse's outputs equal eager's: structure, shape, dtype, then values (NaN == NaN)."""
    act, exp = flatten(actual), flatten(expected)
    assert len(act) == len(exp), f"{what}: {len(act)} outputs, eager has {len(exp)}"
    for k, (a, e) in enumerate(zip(act, exp)):
        label = f"{what}output {k}"
        if not isinstance(e, torch.Tensor):
            assert not isinstance(a, torch.Tensor) or a.numel() == 1, label
            assert a == e or (a != a and e != e), f"{label}: {a!r} != {e!r}"
            continue
        assert isinstance(a, torch.Tensor), f"{label}: got {type(a)}"
        assert a.shape == e.shape, f"{label}: shape {tuple(a.shape)} != eager {tuple(e.shape)}"
        assert a.dtype == e.dtype, f"{label}: dtype {a.dtype} != eager {e.dtype}"
        if check_stride and e.numel() > 1:
            assert a.stride() == e.stride(), f"{label}: stride {a.stride()} != eager {e.stride()}"
        if e.dtype.is_floating_point:
            d_atol, d_rtol = TOL.get(e.dtype, (1e-5, 1e-5))
            torch.testing.assert_close(a, e, atol=d_atol if atol is None else atol,
                                       rtol=d_rtol if rtol is None else rtol, equal_nan=True,
                                       msg=lambda m: f"{label}: {m}")
            if signed_zeros:
                zeros = e == 0
                assert torch.equal(a[zeros].signbit(), e[zeros].signbit()), f"{label}: sign of zero differs"
        else:
            torch.testing.assert_close(a, e, atol=0, rtol=0, msg=lambda m: f"{label}: {m}")


# ----------------------------------------------------------------------------------------------
# input factories
# ----------------------------------------------------------------------------------------------

def rand(shape: Iterable[int], dtype: torch.dtype = torch.float32, *, low: float = -3.0, high: float = 3.0,
         nonzero: bool = True, gen: torch.Generator | None = None) -> torch.Tensor:
    """Random data of any dtype, never exactly zero (unless `nonzero=False`)."""
    shape = tuple(shape)
    if dtype == torch.bool:
        return torch.rand(shape, generator=gen) > 0.5
    if dtype.is_floating_point:
        x = torch.empty(shape, dtype=torch.float64).uniform_(low, high, generator=gen)
        if nonzero:
            x = torch.where(x.abs() < 1e-3, torch.full_like(x, 0.5), x)
        return x.to(dtype)
    lo, hi = int(low), int(high) + 1
    x = torch.randint(lo, hi, shape, generator=gen, dtype=torch.int64)
    if nonzero:
        x = torch.where(x == 0, torch.ones_like(x), x)
    return x.to(dtype)


def layouts(dtype: torch.dtype = torch.float32, *, low: float = -3.0, high: float = 3.0,
            nonzero: bool = True) -> dict[str, torch.Tensor]:
    """The same op checked on: contiguous odd sizes, transposed, step-sliced, 3-d with a size-1
    dim, 0-d, and empty."""
    r = lambda *s: rand(s, dtype, low=low, high=high, nonzero=nonzero)  # noqa: E731
    return {
        "contig": r(7, 13),
        "transposed": r(13, 7).t(),
        "sliced": r(9, 26)[1::2, ::3],
        "size1": r(3, 1, 11),
        "scalar": r(),
        "empty": r(0, 5),
    }



class TF:
    """Compile with torchfuse, run once, compare with eager; see `check`."""

    TOL = TOL
    assert_same = staticmethod(assert_same)
    flatten = staticmethod(flatten)
    rand = staticmethod(rand)
    layouts = staticmethod(layouts)
    LAYOUTS = ("contig", "transposed", "sliced", "size1", "scalar", "empty")

    @staticmethod
    def explain(fn: Callable, *args: Any, options: Mapping[str, Any] | None = None) -> torchfuse.Explanation:
        """torchfuse.explain in strict mode (a C++ build error raises instead of running eagerly),
        and the whole graph must have gone through torchfuse (no silent eager fallback)."""
        opts = {"strict": True, **dict(options or {})}
        before = counters["eager_fallbacks"]
        e = torchfuse.explain(fn, *args, options=opts)
        assert counters["eager_fallbacks"] == before, "the graph ran eagerly instead of through torchfuse"
        return e

    @classmethod
    def check(cls, fn: Callable, *args: Any, options: Mapping[str, Any] | None = None,
              allow_fallbacks: Iterable[str] = (), kernels: int | None = None, min_kernels: int = 1,
              atol: float | None = None, rtol: float | None = None, check_stride: bool = False,
              signed_zeros: bool = False) -> torchfuse.Explanation:
        """Run `fn` through torchfuse and eagerly on the same inputs and compare the outputs.

        Every op must have been lowered (ATen fallbacks only for the ops in `allow_fallbacks`) and at
        least `min_kernels` kernels generated (exactly `kernels` if given), so that a test cannot pass
        by running eager code on both sides.
        """
        expected = fn(*args)
        e = cls.explain(fn, *args, options=options)
        allowed = set(allow_fallbacks)
        bad = [f"{f.op} ({f.reason})" for f in e.fallbacks if f.op not in allowed]
        assert not bad, f"unexpected ATen fallbacks: {bad}\n{e}"
        if kernels is not None:
            assert len(e.kernels) == kernels, f"expected {kernels} kernel(s), got {len(e.kernels)}\n{e}"
        else:
            assert len(e.kernels) >= min_kernels, f"expected at least {min_kernels} kernel(s)\n{e}"
        assert_same(e.output, expected, atol=atol, rtol=rtol, check_stride=check_stride,
                    signed_zeros=signed_zeros)
        return e

    @staticmethod
    def check_dynamic(fn: Callable, arg_sets: list[tuple], *, fallbacks: int = 0, atol: float | None = None,
                      rtol: float | None = None) -> None:
        """Compile with dynamic shapes once and run every argument tuple: one graph, no recompiles,
        `fallbacks` ATen ops per run (counted by torchfuse.counters), results equal eager."""
        compiled = torchfuse.compile(fn, dynamic=True, options={"strict": True})
        graphs, fb, eager = counters["graphs_compiled"], counters["fallback_ops"], counters["eager_fallbacks"]
        for args in arg_sets:
            assert_same(compiled(*args), fn(*args), atol=atol, rtol=rtol)
        assert counters["eager_fallbacks"] == eager, "the graph ran eagerly"
        assert counters["graphs_compiled"] - graphs == 1, "expected one dynamic-shape graph for all the shapes"
        assert counters["fallback_ops"] - fb == fallbacks, "unexpected ATen fallbacks"

    @classmethod
    def check_grad(cls, fn: Callable, *args: Any, allow_fallbacks: Iterable[str] = (),
                   atol: float | None = None, rtol: float | None = None,
                   options: Mapping[str, Any] | None = None) -> torchfuse.Explanation:
        """Forward and backward through torchfuse vs eager: outputs and the grads of every input that
        requires grad (the backward graph must be compiled by torchfuse and generate kernels)."""
        def clone(a: Any) -> Any:
            return a.detach().clone().requires_grad_(a.requires_grad) if isinstance(a, torch.Tensor) else a
        eager_args, tf_args = [clone(a) for a in args], [clone(a) for a in args]
        expected = fn(*eager_args)
        gen = torch.Generator().manual_seed(1)
        outs = [o for o in flatten(expected) if isinstance(o, torch.Tensor) and o.requires_grad]
        grads_out = [torch.randn(o.shape, generator=gen, dtype=torch.float64).to(o.dtype) for o in outs]
        torch.autograd.backward(outs, grads_out)
        e = cls.explain(fn, *tf_args, options=options)
        got = [o for o in flatten(e.output) if isinstance(o, torch.Tensor) and o.requires_grad]
        assert len(got) == len(outs), "outputs that require grad differ from eager"
        torch.autograd.backward(got, grads_out)
        assert any(k.graph.endswith("_backward") for k in e.kernels), f"the backward graph generated no kernels\n{e}"
        bad = [f"{f.op} ({f.reason})" for f in e.fallbacks if f.op not in set(allow_fallbacks)]
        assert not bad, f"unexpected ATen fallbacks: {bad}\n{e}"
        assert_same(e.output, expected, atol=atol, rtol=rtol, what="forward ")
        for k, (a, b) in enumerate(zip(tf_args, eager_args)):
            if isinstance(b, torch.Tensor) and b.requires_grad:
                assert a.grad is not None, f"input {k} got no grad"
                assert_same(a.grad, b.grad, atol=atol, rtol=rtol, what=f"grad of input {k}: ")
        return e


@pytest.fixture
def tf() -> type[TF]:
    return TF


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
