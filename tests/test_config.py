"""Options are checked up front (config.py): a wrong type or value raises a ValueError naming the
option and what it may be; extra compiler flags add to the defaults; a debug folder that cannot
be made warns once and the compile goes on."""
from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch

import torchfuse
from torchfuse.config import Config
from torchfuse.backends.cpp import build as cpp_build


def test_unknown_pass_names_raise_when_a_compiler_takes_the_config():
    """(Config itself does not import the passes: the compilers check the names.)"""
    from torchfuse.frontend.dynamo import TorchfuseBackend
    config = Config.from_options({"passes": ["dce", "fold_everything"]})
    with pytest.raises(ValueError, match="valid passes are"):
        TorchfuseBackend(config)
    with pytest.raises(ValueError, match="valid passes are"):
        torchfuse.compile(lambda x: x + 1, options={"passes": ["fold_everything"]})
    with pytest.raises(ValueError, match="valid passes are"):
        with torchfuse.lazy(options={"passes": ["fold_everything"]}):
            pass


def test_bad_pass_names_raise_through_torch_compile():
    torch._dynamo.reset()
    with pytest.raises(Exception) as err:    # Dynamo wraps it
        torch.compile(lambda x: x + 1, backend="torchfuse", options={"passes": ["dce", "fold_everything"]})(torch.randn(3))
    assert "valid passes are" in str(err.value), str(err.value)


@pytest.mark.parametrize("options, says", [
    ({"cpu_backend": "banana"}, "['cpp', 'triton']"),
    ({"cpu_backend": "interpreter"}, "['cpp', 'triton']"),
    ({"num_threads": "four"}, "must be an int"),
    ({"num_threads": -2}, "0 or more"),
    ({"fuse": "no"}, "True or False"),
    ({"strict": 1}, "True or False"),
    ({"cxx_flags": "-O2"}, "a list of strings"),
    ({"fallback_ops": ["aten.no_such_op.default"]}, "'aten.gelu.default'"),
    ({"fallback_ops": ["gelu"]}, "name no op"),
    ({"partitioner": "greedy"}, "['default', 'min_cut']"),
    ({"cache_dir": 3}, "a path"),
    ({"first_calls": "later"}, "['eager', 'wait']"),
])
def test_bad_option_values_raise_with_the_valid_ones(options, says):
    with pytest.raises(ValueError) as err:
        Config.from_options(options)
    assert next(iter(options)) in str(err.value) and says in str(err.value), str(err.value)
    torch._dynamo.reset()
    with pytest.raises(Exception) as err:    # the same check through torch.compile (Dynamo wraps it)
        torch.compile(lambda x: x + 1, backend="torchfuse", options=options)(torch.randn(3))
    assert says in str(err.value), str(err.value)


def test_first_calls_default_and_environment(monkeypatch):
    """Kernels compiling in the background make no call wait by default; TORCHFUSE_FIRST_CALLS
    (which the test session sets to "wait") changes the default, and options win over it."""
    monkeypatch.delenv("TORCHFUSE_FIRST_CALLS")
    assert Config.from_options().first_calls == "eager"
    monkeypatch.setenv("TORCHFUSE_FIRST_CALLS", "wait")
    assert Config.from_options().first_calls == "wait"
    assert Config.from_options({"first_calls": "eager"}).first_calls == "eager"
    monkeypatch.setenv("TORCHFUSE_FIRST_CALLS", "sometimes")
    with pytest.raises(ValueError, match="first_calls"):
        Config.from_options()


def test_good_option_values_are_converted():
    c = Config.from_options({"fallback_ops": ["aten.gelu.default"], "passes": ["dce"], "cache_dir": "/tmp/tf-x",
                             "extra_cxx_flags": ["-g"], "num_threads": 0, "cpu_backend": "triton"})
    assert c.fallback_ops == ("aten.gelu.default",) and c.passes == ("dce",) and c.extra_cxx_flags == ("-g",)
    assert c.cache_dir == Path("/tmp/tf-x")


def test_extra_cxx_flags_add_to_the_defaults(tmp_path):
    base = Config.from_options({"cache_dir": tmp_path})
    extra = Config.from_options({"cache_dir": tmp_path, "extra_cxx_flags": ["-DTORCHFUSE_EXTRA=1"]})
    assert cpp_build._flags(extra) == [*base.cxx_flags, "-DTORCHFUSE_EXTRA=1"]
    assert cpp_build.cache_key("int f();", base) != cpp_build.cache_key("int f();", extra)
    fn = lambda x: torch.tanh(x * 3) + 1  # noqa: E731
    x = torch.randn(37, 5)
    e = torchfuse.explain(fn, x, options={"cache_dir": tmp_path, "extra_cxx_flags": ["-DTORCHFUSE_EXTRA=1"],
                                          "strict": True})
    torch.testing.assert_close(e.output, fn(x))
    with pytest.raises(Exception) as err:     # a flag the compiler rejects: its message names the option
        torchfuse.explain(lambda x: x.sin() * 2, x, options={"cache_dir": tmp_path, "strict": True,
                                                             "extra_cxx_flags": ["-fno-such-flag-at-all"]})
    assert "extra_cxx_flags" in str(err.value)


def test_unwritable_debug_folder_warns_once_and_compiles(tmp_path, monkeypatch):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    monkeypatch.setenv("TORCHFUSE_DEBUG", str(blocker / "debug"))
    from torchfuse import pipeline as compiled_graph
    monkeypatch.setattr(compiled_graph, "_debug_warned", False)
    fn = lambda x: torch.relu(x) * 2  # noqa: E731
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for n in (3, 4):
            torch._dynamo.reset()
            x = torch.randn(n, 6)
            torch.testing.assert_close(torch.compile(fn, backend="torchfuse", dynamic=False)(x), fn(x))
    said = [w for w in caught if "debug folder" in str(w.message)]
    assert len(said) == 1 and "a-file" in str(said[0].message), [str(w.message) for w in caught]


def test_help_lists_every_option_with_its_meaning():
    import dataclasses
    doc = Config.__doc__
    for f in dataclasses.fields(Config):
        at = doc.find(f"\n{f.name}")
        assert at >= 0, f.name
        meaning = doc[at:].split("\n")[2] if len(doc[at:].split("\n")) > 2 else ""
        assert meaning.startswith("    ") and meaning.strip(), f"{f.name} has no description in help(Config)"


def test_bad_options_rejected_before_the_first_call():
    """torchfuse.compile (also as a decorator) and torchfuse.backend check options when called,
    as Inductor does at torch.compile(), not at the first call of the compiled function."""
    import pytest
    import torch

    import torchfuse
    with pytest.raises(ValueError, match="unknown option"):
        torchfuse.compile(options={"fusee": True})             # the decorator form
    with pytest.raises(ValueError, match="unknown option"):
        torch.compile(lambda x: x + 1, backend=torchfuse.backend(options={"fusee": True}))
    with pytest.raises(TypeError, match="dict of option names"):
        torchfuse.compile(lambda x: x + 1, options=["fuse"])
    with pytest.raises(TypeError, match="dict of option names"):
        torchfuse.backend(options=["fuse"])
    f = torch.compile(lambda x: x * 2 + 1, backend=torchfuse.backend(options={"fuse": True}))
    x = torch.randn(5, 3)
    torch.testing.assert_close(f(x), x * 2 + 1)
