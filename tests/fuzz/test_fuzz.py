"""The random-program fuzzer (torchfuse.tools.fuzz) in CI: a fixed seed and a bounded number of
small programs.  A failure is shrunk and written to tests/fuzz/regressions/ as its own test.

TORCHFUSE_FUZZ_EXAMPLES and TORCHFUSE_FUZZ_SEED (an int, or "random") override the defaults."""
from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("hypothesis")

from torchfuse.tools import fuzz  # noqa: E402


def test_fuzz_programs():
    examples = int(os.environ.get("TORCHFUSE_FUZZ_EXAMPLES", "40"))
    seed_env = os.environ.get("TORCHFUSE_FUZZ_SEED", "0")
    seed = None if seed_env == "random" else int(seed_env)
    r = fuzz.run_fuzz(examples, seed=seed, max_ops=6)
    assert r.failure is None, (f"torchfuse disagrees with eager on this program (regression test written to "
                               f"{r.regression}):\n{r.failure}\n{r.error[:3000]}")


def test_fuzz_programs_with_symbolic_sizes():
    """The same programs compiled with dynamic=True: symbolic sizes reach every lowering and the
    generated code (a size that substitution makes constant, a size-1 dim specialized)."""
    examples = int(os.environ.get("TORCHFUSE_FUZZ_EXAMPLES", "40")) // 2
    r = fuzz.run_fuzz(examples, seed=1, max_ops=6, options={"dynamic": True})
    assert r.failure is None, (f"torchfuse disagrees with eager on this program (regression test written to "
                               f"{r.regression}):\n{r.failure}\n{r.error[:3000]}")


def test_fuzz_real_model_programs():
    """Programs drawn mostly from what real models bring (tools/fuzz_real.py): scalar inputs,
    typed literals in every position, computed indices, grid_sample/interpolate, topk/sort."""
    examples = int(os.environ.get("TORCHFUSE_FUZZ_EXAMPLES", "40")) // 2
    r = fuzz.run_fuzz(examples, seed=2, max_ops=6, real_models=True)
    assert r.failure is None, (f"torchfuse disagrees with eager on this program (regression test written to "
                               f"{r.regression}):\n{r.failure}\n{r.error[:3000]}")


def test_fuzz_real_model_programs_with_symbolic_sizes():
    """The same with dynamic=True: Python ints become size symbols, Python floats 0-d CPU tensors."""
    examples = int(os.environ.get("TORCHFUSE_FUZZ_EXAMPLES", "40")) // 4
    r = fuzz.run_fuzz(examples, seed=3, max_ops=6, real_models=True, options={"dynamic": True})
    assert r.failure is None, (f"torchfuse disagrees with eager on this program (regression test written to "
                               f"{r.regression}):\n{r.failure}\n{r.error[:3000]}")


def test_fuzz_real_model_programs_on_the_triton_backend():
    """A few under Triton's interpreter: its literals and casts are typed differently from C++'s."""
    pytest.importorskip("triton")
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("needs Triton's interpreter (TRITON_INTERPRET=1 before triton is imported)")
    examples = int(os.environ.get("TORCHFUSE_FUZZ_EXAMPLES", "40")) // 8
    r = fuzz.run_fuzz(examples, seed=4, max_ops=5, real_models=True, options={"cpu_backend": "triton"})
    assert r.failure is None, (f"torchfuse disagrees with eager on this program (regression test written to "
                               f"{r.regression}):\n{r.failure}\n{r.error[:3000]}")


def test_scalar_inputs_and_devices():
    """Python-number inputs are deterministic and replay from a regression file; with a device,
    0-d tensors stay on the host; a result on the wrong device is a mismatch."""
    specs = [fuzz.InputSpec((), "pyfloat", seed=1), fuzz.InputSpec((), "pyint", seed=2),
             fuzz.InputSpec((), "float64", seed=3), fuzz.InputSpec((2, 3), "float32", seed=4)]
    a, b = fuzz.make_inputs(specs), fuzz.make_inputs(specs)
    assert isinstance(a[0], float) and isinstance(a[1], int) and a[0] != 0 and a[1] != 0
    assert a[:2] == b[:2] and torch.equal(a[3], b[3])
    moved = fuzz.make_inputs(specs, device="meta")
    assert moved[2].device.type == "cpu" and moved[3].device.type == "meta"
    with pytest.raises(fuzz.Mismatch, match="device"):
        fuzz.compare([torch.zeros(2, device="meta")], [torch.zeros(2)], "output")


def test_real_model_regression_file_roundtrip(tmp_path):
    prog = fuzz.Program([fuzz.InputSpec((3, 4), "float32"), fuzz.InputSpec((), "pyfloat", seed=1)],
                        ["v0 = torch.where(a0 > a1, torch.zeros_like(a0, dtype=torch.int64), 2 ** 40)",
                         "v1 = a0.index_select(1, a0.flatten().argsort()[:3] % 4)"], ["v0", "v1"])
    path = fuzz.write_regression(prog, "Mismatch: example", tmp_path)
    env: dict = {}
    exec(compile(path.read_text(), str(path), "exec"), env)
    env[f"test_case_{prog.digest()}"]()


def test_triton_regression_files_run_under_the_interpreter(tmp_path):
    """A program found with the Triton backend replays as a test that turns Triton's interpreter
    on before triton is imported, and says so instead of failing when it cannot."""
    prog = fuzz.Program([fuzz.InputSpec((4, 3), "float32")], ["v0 = torch.neg(a0)", "v1 = v0.sum(1)"], ["v1"])
    prog.options = {"dynamic": True, "cpu_backend": "triton"}
    source = fuzz.regression_source(prog, "Mismatch: example")
    assert 'os.environ.setdefault("TRITON_INTERPRET", "1")' in source and 'pytest.importorskip("triton")' in source
    if os.environ.get("TRITON_INTERPRET") != "1":
        with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
            fuzz.check_program(prog)


def test_check_catches_a_wrong_kernel(monkeypatch):
    """The harness is not vacuous: a code generator that emits `+` for `-` is caught."""
    from torchfuse.backends.cpp import codegen as cpp
    monkeypatch.setitem(cpp._INFIX, "sub", "+")
    prog = fuzz.Program([fuzz.InputSpec((3, 5), "float32", "transposed")], ["v0 = torch.sub(a0, 1.5)"], ["v0"])
    with pytest.raises(fuzz.Mismatch):
        fuzz.check_program(prog)


def test_input_layouts():
    for layout in fuzz.LAYOUTS:
        x = fuzz.make_input(fuzz.InputSpec((3, 4), "float32", layout, seed=1))
        assert x.shape == (3, 4)
        assert torch.equal(x, fuzz.make_input(fuzz.InputSpec((3, 4), "float32", layout, seed=1)))
    assert not fuzz.make_input(fuzz.InputSpec((3, 4), "int64", "transposed")).is_contiguous()
    assert fuzz.make_input(fuzz.InputSpec((3, 4), "bool", "expanded")).stride()[0] == 0


def test_regression_file_roundtrip(tmp_path):
    """A written regression file is a standalone test that runs the program."""
    prog = fuzz.Program([fuzz.InputSpec((2, 3), "float32", "strided"), fuzz.InputSpec((3,), "int64")],
                        ["v0 = torch.add(a0, a1)", "v1 = v0.sum(0)", "a0.mul_(2)"], ["v1", "v0"])
    path = fuzz.write_regression(prog, "Mismatch: example", tmp_path)
    assert path.name == f"test_case_{prog.digest()}.py"
    env: dict = {}
    exec(compile(path.read_text(), str(path), "exec"), env)
    env[f"test_case_{prog.digest()}"]()
