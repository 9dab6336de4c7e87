"""progress.py: a compile shows one progress line (elapsed, graphs, stage) on stderr when
stderr is a terminal, never otherwise, and not when `progress` is off."""
from __future__ import annotations

import io

import pytest
import torch

import torchfuse
from torchfuse import progress


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def _compile_something(options: dict | None = None) -> None:
    torch._dynamo.reset()
    x = torch.randn(5, 7)
    f = torch.compile(lambda a: torch.softmax(a * 2.5, -1).sum(0), backend="torchfuse", options=options or {})
    torch.testing.assert_close(f(x), torch.softmax(x * 2.5, -1).sum(0))


@pytest.mark.parametrize("stream, options, shown", [
    (_Terminal, None, True),
    (io.StringIO, None, False),                  # not a terminal (a log file, CI)
    (_Terminal, {"progress": False}, False),
])
def test_progress_line_only_on_a_terminal(monkeypatch, stream, options, shown):
    out = stream()
    monkeypatch.setattr(progress, "_stream", lambda: out)
    monkeypatch.setattr(progress, "DELAY_S", 0.0)
    _compile_something(options)
    text = out.getvalue()
    if shown:
        assert "torchfuse compile" in text and "graph 1, lowering" in text and "graph 1, build" in text, text
    else:
        assert text == ""
    assert torchfuse.counters.on_stage is None       # the scope ended


def test_short_compile_draws_nothing(monkeypatch):
    """A compile shorter than DELAY_S leaves stderr as it was (it drew a line at once that stayed)."""
    out = _Terminal()
    monkeypatch.setattr(progress, "_stream", lambda: out)
    monkeypatch.setattr(progress, "DELAY_S", 60.0)
    _compile_something()
    assert out.getvalue() == ""


def test_line_is_erased_at_the_end(monkeypatch):
    out = _Terminal()
    monkeypatch.setattr(progress, "_stream", lambda: out)
    monkeypatch.setattr(progress, "DELAY_S", 0.0)
    _compile_something()
    text = out.getvalue()
    assert "torchfuse compile" in text
    # what the terminal shows last: the line after the last carriage return, blanked
    assert text.rsplit("\r", 1)[-1].strip() == "", repr(text[-200:])
