"""Compile progress on stderr: one line, shown once a compile has run for DELAY_S seconds.

    torchfuse compile: 12 s, graph 3, lowering

A Dynamo graph's compile (AOTAutograd, then every torchfuse stage of its forward and backward
graphs) or a lazy block's graph compile opens a `compiling` scope; `Counters.timed` tells it
each stage as it starts, and the line shows the elapsed time, the aten graphs compiled in the
scope and the stage.  Drawn by tqdm, only when stderr is a terminal and `Config.progress` is on
(the default; `options={"progress": False}` turns it off); the line is erased when the scope ends.
Nested scopes (AOTAutograd compiling the graphs of one Dynamo graph) share the outer one.
"""
from __future__ import annotations

import contextlib
import sys
import threading
from typing import Any, Iterator

from .config import Config
from .counters import counters

DELAY_S = 2.0


class _Open(threading.local):
    def __init__(self) -> None:
        self.bar: Any = None
        self.graphs_at_start = 0


_open = _Open()


def _stream() -> Any:
    return sys.stderr


@contextlib.contextmanager
def compiling(config: Config) -> Iterator[None]:
    """Show progress for the compile inside this scope (see the module docstring)."""
    if _open.bar is not None or not config.progress:
        yield
        return
    stream = _stream()
    try:
        interactive = stream.isatty()
    except (AttributeError, ValueError):    # a closed or replaced stream
        interactive = False
    bar = None
    if interactive:
        try:
            from tqdm import tqdm
            bar = tqdm(desc="torchfuse compile", file=stream, delay=DELAY_S, leave=False, total=None,
                       bar_format="{desc}: {elapsed}{postfix}")
        except ImportError:                 # tqdm is a dependency; without it, no progress line
            bar = None
    if bar is None:
        yield
        return
    _open.bar, _open.graphs_at_start = bar, counters["graphs_compiled"]
    counters.on_stage = _stage
    try:
        yield
    finally:
        counters.on_stage = None
        _open.bar = None
        bar.close()


def _stage(stage: str) -> None:
    bar = _open.bar
    if bar is not None:
        graphs = counters["graphs_compiled"] - _open.graphs_at_start
        bar.set_postfix_str(f"graph {graphs}, {stage}", refresh=True)
