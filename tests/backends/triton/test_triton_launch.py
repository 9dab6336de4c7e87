"""The direct launchers of compiled Triton binaries (backends/triton/conventions.py and their
selection in launch.py), on CPU: which launchers a binary gets and exactly what each passes.  Fake binaries and recording launchers stand
in for the GPU; tests/gpu/test_cuda.py launches real ones and compares them with eager."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from torchfuse.backends.triton import conventions as triton_conventions
from torchfuse.backends.triton import launch as triton_launch

NAMES = ["in0", "out0", "ks0", "xnumel", "rnumel", "XBLOCK", "RBLOCK", "BIG"]


def _binary(signature: dict | None = None, constants: dict | None = None, kernel_signature: bool = True,
            **metadata):
    """A compiled kernel as Triton 3.6-3.9 shape it: `src` (the ASTSource: signature by name,
    constants by (index,)), `metadata`, `run` (the launcher) and its loaded `function`."""
    calls = []
    sig = {"in0": "*fp32", "out0": "*bf16", "ks0": "i64", "xnumel": "i32", "rnumel": "constexpr",
           "XBLOCK": "constexpr", "RBLOCK": "constexpr", "BIG": "constexpr"} if signature is None else signature
    const = {(4,): 1, (5,): 1024, (6,): 1, (7,): False} if constants is None else constants
    md = dict(num_ctas=1, launch_cooperative_grid=False, launch_pdl=False, global_scratch_size=0,
              profile_scratch_size=0, num_warps=4, shared=0)
    md.update(metadata)
    run = SimpleNamespace(launch=lambda *a: calls.append(("direct", a)), global_scratch_size=0, profile_scratch_size=0,
                          launch_cooperative_grid=False, launch_pdl=False)
    if kernel_signature:
        run.kernel_signature, run.arg_annotations = "SIG", "ANN"
    src = SimpleNamespace(fn=SimpleNamespace(arg_names=NAMES), signature=sig, constants=const)
    return SimpleNamespace(src=src, metadata=SimpleNamespace(**md), run=run, function=0xF00,
                           packed_metadata="META"), calls


@pytest.fixture
def recorder(monkeypatch):
    calls = []
    monkeypatch.setattr(triton_conventions, "_static_launcher", lambda: lambda *a: calls.append(("static", a)))
    monkeypatch.setattr(triton_conventions, "_raw_stream", lambda: lambda device: 1000 + device)
    monkeypatch.setattr(triton_conventions, "_launch_hooks", lambda: False)
    return calls


def test_static_launcher_passes_the_run_time_parameters_only(recorder):
    """torch's launcher takes the binary's run-time parameters (no constexprs, no int Triton
    specialized to a constant: rnumel == 1 here) with their type codes, then the scratch
    pointers; grid, warps and shared memory bound once, the stream read per launch."""
    binary, _ = _binary()
    conventions = dict(triton_conventions.conventions(binary, (1024, 1, False), 2))
    go = conventions["static"]((5, 1, 1), (4000, 1), 3)
    go(0x1000, 0x2000, 17)
    fn, gx, gy, gz, warps, shared, types, args, stream = recorder[-1][1]
    assert (fn, gx, gy, gz, warps, shared, stream) == (0xF00, 5, 1, 1, 4, 0, 1002)
    assert types == "OOli" + "OO" and args == (0x1000, 0x2000, 17, 4000, None, None)
    try:       # the same type string as Inductor's own reading of the signature
        from torch._inductor.runtime.static_triton_launcher import StaticallyLaunchedTritonKernel
    except ImportError:
        return
    reader = StaticallyLaunchedTritonKernel.__new__(StaticallyLaunchedTritonKernel)
    assert reader.arg_ty_from_signature(binary.src) + "OO" == types


def test_static_launcher_is_not_used_where_it_cannot_launch(recorder, monkeypatch):
    for refused in (dict(global_scratch_size=256), dict(num_ctas=2), dict(launch_pdl=True),
                    dict(launch_cooperative_grid=True)):
        binary, _ = _binary(**refused)
        assert triton_conventions._static_launch(binary) is None, refused
    tensordesc = dict(_binary()[0].src.signature, in0="tensordesc<fp32[16, 16]>")
    assert triton_conventions._static_launch(_binary(signature=tensordesc)[0]) is None
    monkeypatch.setattr(triton_conventions, "_launch_hooks", lambda: True)       # a profiler's hooks: Triton's launcher
    binary, _ = _binary()
    assert dict(triton_conventions.conventions(binary, (1024, 1, False), 0))["static"] is None
    monkeypatch.setattr(triton_conventions, "_launch_hooks", lambda: False)
    monkeypatch.setattr(triton_conventions, "_static_launcher", lambda: None)   # a CPU build of torch
    assert triton_conventions._static_launch(binary) is None


def test_static_launcher_refuses_a_call_of_another_arity(recorder):
    """A launch whose argument count is not the kernel's never reaches the GPU."""
    binary, _ = _binary()
    bind = dict(triton_conventions.conventions(binary, (1024, 1, False), 0))["static"]
    with pytest.raises(ValueError):
        bind((5, 1, 1), (4000,), 3)
    assert recorder == []


@pytest.mark.parametrize("kernel_signature", [True, False])
def test_triton_launchers_calling_conventions(recorder, kernel_signature):
    """Triton's own C launcher, after the static one: Triton 3.9's shared launcher takes the
    signature and the arguments as one tuple; Triton 3.6's per-kernel launcher takes them
    spread out.  Each with the constexprs (newer) or without (older), then the Python launcher."""
    binary, direct = _binary(kernel_signature=kernel_signature)
    conventions = list(triton_conventions.conventions(binary, (1024, 1, False), 0))
    names = [n for n, _ in conventions]
    direct_names = ["direct-packed-0", "direct-packed-1"] if kernel_signature else ["direct-0", "direct-1"]
    assert names == ["static"] + direct_names + ["python-0", "python-1"]
    bind = dict(conventions)[direct_names[0]]
    bind((7, 2, 1), (4000, 1), 3)(0x1000, 0x2000, 17)
    args = (0x1000, 0x2000, 17, 4000, 1, 1024, 1, False)
    if kernel_signature:
        assert direct[-1][1] == (7, 2, 1, 1000, 0xF00, False, False, "META", None, None, None, None, None, "ANN",
                                 "SIG", args)
    else:
        assert direct[-1][1] == (7, 2, 1, 1000, 0xF00, False, False, None, None, "META", None, None, None, *args)
    dict(conventions)[direct_names[1]]((7, 2, 1), (4000, 1), 3)(0x1000, 0x2000, 17)
    assert direct[-1][1][-1] == 1 if not kernel_signature else direct[-1][1][-1] == args[:5]


def test_bound_launchers_of_one_layout_share_their_code(recorder):
    """The launcher function is generated once per layout and arity, not per kernel or class."""
    binary, _ = _binary()
    bind = dict(triton_conventions.conventions(binary, (1024, 1, False), 0))["static"]
    a, b = bind((5, 1, 1), (4000, 1), 3), bind((9, 1, 1), (8000, 1), 3)
    assert a.__code__ is b.__code__ and a is not b
    b(1, 2, 3)
    assert recorder[-1][1][1] == 9 and recorder[-1][1][7] == (1, 2, 3, 8000, None, None)


def test_site_launches_through_the_static_launcher(recorder, monkeypatch):
    """End to end on CPU: a call site whose helper returns a direct launcher built by
    `_make_fast`'s `fast_for` binds it per class and calls torch's launcher with int pointers."""
    binary, _ = _binary()
    bind = dict(triton_conventions.conventions(binary, (1024, 1, False), 0))["static"]

    def fast(grid, args):
        bind(grid, (), len(args))(*map(triton_launch._pointer, args))
    fast.bind = bind

    def helper(kernel, xnumel, big, *args):
        return fast, (kernel, (-(-xnumel // 1024), 1, 1), (xnumel, 1), (1024, 1, big), 4, ())

    site = triton_launch.make_site(helper, ("k",), 2, 2, 1)
    x, y = torch.randn(4000), torch.randn(4000)
    site(4000, False, x, y, 17)          # first: the helper (here: nothing launched)
    assert recorder == []
    site(4000, False, x, y, 17)
    assert recorder[-1][1][1:4] == (4, 1, 1) and recorder[-1][1][7] == (x.data_ptr(), y.data_ptr(), 17, 4000, None,
                                                                         None)


def test_site_binds_misaligned_views_as_a_class_of_their_own(recorder):
    """A view at an odd offset (Triton compiles another binary for it) is bound per alignment
    pattern: its later calls skip the helper, as aligned ones do, and never get the aligned
    class's launcher (nor the aligned calls its)."""
    binary, _ = _binary()
    bind = dict(triton_conventions.conventions(binary, (1024, 1, False), 0))["static"]
    helped = []

    def helper(kernel, xnumel, big, *args):
        aligned = all(a.data_ptr() % 16 == 0 for a in args if isinstance(a, torch.Tensor))
        helped.append(aligned)

        def fast(grid, args):
            bind(grid, (), len(args))(*map(triton_launch._pointer, args))
        fast.bind = lambda grid, tail, n: (lambda *p: recorder.append(("bound", aligned, p)))
        return fast, (kernel, (-(-xnumel // 1024), 1, 1), (xnumel, 1), (1024, 1, big), 4, ())

    site = triton_launch.make_site(helper, ("k",), 2, 2, 0)
    base, y = torch.randn(4001), torch.randn(4000)
    x, odd = base[:4000], base[1:]
    for _ in range(3):
        site(4000, False, x, y)
        site(4000, False, odd, y)
    assert helped == [True, False]       # once per class; before: every misaligned call
    assert [r[1] for r in recorder] == [True, False, True, False]
    assert recorder[-1][2] == (odd.data_ptr(), y.data_ptr())
    assert len(site._tf_bound) == 2


def _fake_conventions(log: list, tensors: dict, factors: dict):
    """Conventions whose launch computes out = inp * factor on CPU tensors found by address
    (the launchers take pointers as ints), factor None: the convention does not apply."""
    def conventions(binary, constexprs, device):
        for name, factor in factors.items():
            if factor is None:
                yield name, None
                continue

            def bind(grid, tail, n_args, name=name, factor=factor):
                def go(p_in, p_out, n):
                    log.append(name)
                    if factor == "raise":
                        raise TypeError("wrong arity")
                    tensors[p_out].copy_(tensors[p_in] * factor)
                return go
            yield name, bind
    return conventions


def test_launcher_selection_verifies_and_trusts_by_name(monkeypatch):
    """The first convention that reproduces the launch is used; when that is torch's static
    launcher, one of Triton's own is verified as well (for binaries the static launcher refuses);
    wrong or failing conventions are skipped and what they wrote is undone.  A later binary
    adopts a trusted convention unverified, one that applies to it."""
    monkeypatch.setattr(triton_launch, "_trusted", {})
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    x, y = torch.randn(37), torch.randn(37)
    tensors = {x.data_ptr(): x, y.data_ptr(): y}
    before = [x.clone(), y.clone()]
    y.copy_(x * 2)                     # what Triton's own launch wrote
    log = []
    binary, _ = _binary()
    monkeypatch.setattr(triton_launch, "_conventions", _fake_conventions(
        log, tensors, {"static": 2, "direct-0": 3, "direct-1": "raise", "python-0": 2, "python-1": 2}))
    fast = triton_launch._make_fast(binary, (x, y, 37), (), (1, 1, 1), before)
    assert log == ["static", "direct-0", "direct-1", "python-0"]
    assert triton_launch._trusted == {triton_launch._launcher_kind(binary): {"static", "python-0"}}
    torch.testing.assert_close(y, x * 2, rtol=0, atol=0)       # direct-0's x * 3 undone
    log.clear()
    fast((1, 1, 1), (x, y, 37))
    assert log == ["static"]

    # a binary torch's launcher cannot take: the trusted Triton convention, not verified again
    log.clear()
    monkeypatch.setattr(triton_launch, "_conventions", _fake_conventions(
        log, tensors, {"static": None, "direct-0": 3, "direct-1": "raise", "python-0": 2, "python-1": 2}))
    fast = triton_launch._make_fast(binary, (x, y, 37), (), (1, 1, 1), None)
    assert log == []
    fast((1, 1, 1), (x, y, 37))
    assert log == ["python-0"]


def test_launcher_selection_without_a_working_convention(monkeypatch):
    """No convention reproduces the launch: False (the kernel keeps Triton's own launch), the
    outputs as Triton's launch left them, nothing trusted."""
    monkeypatch.setattr(triton_launch, "_trusted", {})
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    x, y = torch.randn(37), torch.randn(37)
    tensors = {x.data_ptr(): x, y.data_ptr(): y}
    before = [x.clone(), y.clone()]
    y.copy_(x * 2)
    monkeypatch.setattr(triton_launch, "_conventions", _fake_conventions(
        [], tensors, {"static": 3, "direct-0": "raise", "python-0": 5}))
    assert triton_launch._make_fast(_binary()[0], (x, y, 37), (), (1, 1, 1), before) is False
    torch.testing.assert_close(y, x * 2, rtol=0, atol=0)
    assert triton_launch._trusted == {}
