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
import time
from typing import Any, Iterator

from .config import Config
from .counters import counters

DELAY_S = 2.0


class _Open(threading.local):
    def __init__(self) -> None:
        self.bar: Any = None            # the tqdm line, once drawn
        self.scope: Any = None          # the open scope: (stream, start time)
        self.graphs_at_start = 0


_open = _Open()


def _stream() -> Any:
    return sys.stderr


@contextlib.contextmanager
def compiling(config: Config) -> Iterator[None]:
    """Show progress for the compile inside this scope (see the module docstring)."""
    if _open.scope is not None or not config.progress:
        yield
        return
    stream = _stream()
    try:
        interactive = stream.isatty()
    except (AttributeError, ValueError):    # a closed or replaced stream
        interactive = False
    if not interactive:
        yield
        return
    # The line is made (drawn) only at a stage that starts DELAY_S into the compile: tqdm's own
    # `delay` is not honoured by a refreshing set_postfix_str, and its close() erases only a
    # line drawn through that delay, so a 0.3 s compile left a line behind.
    _open.scope, _open.graphs_at_start = (stream, time.perf_counter()), counters["graphs_compiled"]
    counters.on_stage = _stage
    try:
        yield
    finally:
        counters.on_stage = None
        bar, _open.bar, _open.scope = _open.bar, None, None
        if bar is not None:
            bar.close()                     # (leave=False: erases the line)


def _stage(stage: str) -> None:
    if _open.scope is None:
        return
    stream, start = _open.scope
    if _open.bar is None:
        if time.perf_counter() - start < DELAY_S:
            return
        try:
            from tqdm import tqdm
        except ImportError:                 # tqdm is a dependency; without it, no progress line
            return
        _open.bar = tqdm(desc="torchfuse compile", file=stream, leave=False, total=None, initial=0,
                         bar_format="{desc}: {elapsed}{postfix}")
        _open.bar.start_t = start          # (elapsed counts from the compile's start)
    graphs = counters["graphs_compiled"] - _open.graphs_at_start
    _open.bar.set_postfix_str(f"graph {graphs}, {stage}", refresh=True)
