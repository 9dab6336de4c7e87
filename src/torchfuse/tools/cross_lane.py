"""Generated Triton kernels that read another lane's store of the same launch.

A kernel may read back a value it stored only at the index it stored it: the same thread wrote
it (a looped reduction reloading, in a later loop over the row, what its first loop stored).
A load of a buffer the same kernel stores, at another index, reads what another thread (or
program) of the launch writes, and a GPU orders no store of one thread before another's load:
the load may see the memory as it was before the launch.  Triton's interpreter runs a
program's statements in order, so such a kernel computes the right answer there and a wrong
one on a GPU (mobilevitv2's split group norm loaded each chunk's shift that way: 24x eager's
error against fp32 on an H100).

    from torchfuse.tools.cross_lane import cross_lane_loads, stale_cross_lane_loads
    assert not cross_lane_loads(report.kernels[0].source)
    with stale_cross_lane_loads(0.0):     # under the interpreter: such loads return 0.0
        out = torch.compile(fn, backend="torchfuse", options={"cpu_backend": "triton"})(x)

The check reads the source the Triton emitter writes (`tl.store(buf + (index) + xzero, ...)`),
so it only knows that form; a fresh kernel cache is needed for the emulation to see a kernel
(a cached module is not generated again).
"""
from __future__ import annotations

import contextlib
import re
from typing import Iterator

_FUNCTION = re.compile(r"(?=@triton.jit)")
_STORE = re.compile(r"tl\.store\((\w+) \+ (.*?) \+ xzero")
_LOAD = re.compile(r"tl\.load\((\w+) \+ (.*?) \+ xzero")


def cross_lane_loads(source: str) -> list[str]:
    """`buffer[index] in function` for each load, in the Triton module `source`, of a buffer the
    same @triton.jit function stores at another index."""
    found = []
    for fn in _FUNCTION.split(source):
        name = re.search(r"def (\w+)", fn)
        stores: dict[str, set[str]] = {}
        for buf, index in _STORE.findall(fn):
            stores.setdefault(buf, set()).add(index)
        for buf, index in _LOAD.findall(fn):
            if buf in stores and index not in stores[buf]:
                found.append(f"{buf}[{index}] in {name.group(1) if name else '?'}")
    return found


def _stale(source: str, value: float) -> str:
    """`source` with each cross-lane load's result replaced by `value` (its address still read)."""
    out = []
    for fn in _FUNCTION.split(source):
        stores: dict[str, set[str]] = {}
        for buf, index in _STORE.findall(fn):
            stores.setdefault(buf, set()).add(index)
        lines = []
        for line in fn.split("\n"):
            m = _LOAD.search(line)
            if m and m.group(1) in stores and m.group(2) not in stores[m.group(1)] and " = " in line:
                name, expr = line.split(" = ", 1)
                line = f"{name} = tl.zeros_like({expr}) + {float(value)!r}"
            lines.append(line)
        out.append("\n".join(lines))
    return "".join(out)


@contextlib.contextmanager
def stale_cross_lane_loads(value: float = 0.0) -> Iterator[None]:
    """Triton modules generated inside the block read `value` wherever a kernel loads another
    lane's store (what a GPU may read: memory before the launch), to show under the interpreter
    what such a kernel does to a result."""
    from ..backends.triton import module

    original = module.module_source

    def stale(kernel_sources: list[str], interpreter: bool = False) -> str:
        return original([_stale(s, value) for s in kernel_sources], interpreter)

    module.module_source = stale
    try:
        yield
    finally:
        module.module_source = original
