"""The errors a generated kernel's run-time checks raise (codegen/checks.py), of eager's kinds.

Eager raises IndexError for an index out of range (RuntimeError for gather's) and RuntimeError
("ZeroDivisionError") for an integer division by zero; these classes are both, so code written
against either catches them."""
from __future__ import annotations

import atexit
import ctypes
import logging
from typing import Any, Sequence


class KernelIndexError(IndexError, RuntimeError):
    """An index out of range for the dim it indexes (eager: IndexError, or RuntimeError)."""


class KernelZeroDivisionError(ZeroDivisionError, RuntimeError):
    """An integer division by zero (eager: RuntimeError "ZeroDivisionError")."""


def error_for(site: tuple[str, str], value: int, size: int) -> Exception:
    kind, what = site
    if kind == "index":
        op, _, dim = what.partition(" dim ")
        return KernelIndexError(f"index {value} is out of bounds for dimension {dim or 0} with size {size} "
                                f"(torchfuse: {op})")
    return KernelZeroDivisionError(f"ZeroDivisionError (torchfuse: integer {what} by zero)")


def raise_cpp_error(sites: Sequence[tuple[str, str]], last_error: Any) -> None:
    """A C++ kernel returned non-zero: read which check failed and raise its error."""
    info = (ctypes.c_int64 * 3)()
    last_error(info)
    raise error_for(sites[info[0]], info[1], info[2])


SENTINEL = -2 ** 63      # an error slot no check has written

log = logging.getLogger("torchfuse")


class TritonErrorSlots:
    """A graph's Triton error slots: one int64 per check site of its kernels (each kernel gets a
    slice, `view`), where a failing check stores the bad value (SENTINEL: none failed).  The
    kernel itself never loads or stores outside a tensor (a bad index is replaced by 0 and, for
    a scatter, writes nothing); the slots only say which check failed, to raise eager's error.

    `after_call` runs at the end of each call of the graph.  On the CPU (Triton's interpreter)
    it reads the slots and raises at once.  On a GPU, reading them at once would synchronize the
    host with the device at every call; instead each call queues a copy of the slots into pinned
    host memory with an event behind it (no synchronization), and a later graph call, of this
    graph or of another, raises the error once that copy has arrived: a bad index raises at the
    next call, not at the call that met it (whose outputs hold the 0-index rows).  The slots
    keep a failure until it is raised, so a copy skipped while the last one is in flight loses
    nothing.  `check_kernel_errors()` waits for every copy in flight and raises (for code that
    must know before it goes on), and `sync` (Config.strict) reads the slots at every call.
    Inductor instead compiles Triton with debug=True and `tl.device_assert`s each indirect index
    (torch 2.11-2.13: config.assert_indirect_indexing, triton_heuristics' compile_meta["debug"]):
    no host cost, but a failed device assert leaves the CUDA context unusable for the rest of the
    process, where eager raises an IndexError the program can catch.  While a CUDA graph is
    being captured nothing is read (its replays are not checked)."""

    def __init__(self, slots: Any, sites: Sequence[tuple[str, str]], sync: bool = False):
        self.slots, self.sites, self.sync = slots, tuple(tuple(s) for s in sites), sync
        self._reset_pending()

    def _reset_pending(self) -> None:
        self._host: Any = None          # pinned host copy of the slots
        self._event: Any = None
        self._in_flight = False
        self._sizes: tuple = ()

    def __getstate__(self) -> dict:     # (the graph cache pickles the wrapper's constants)
        return {"slots": self.slots, "sites": self.sites, "sync": self.sync}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._reset_pending()

    def view(self, start: int, count: int) -> Any:
        """The slots of one kernel's check sites (taken where the wrapper is linked, which a
        compile does under AOTAutograd's fake mode: the slots are a real tensor)."""
        from torch._subclasses.fake_tensor import unset_fake_temporarily
        with unset_fake_temporarily():
            return self.slots[start:start + count]

    def after_call(self, sizes: tuple) -> None:
        where = self._where()
        if where == "capturing":
            return
        if where == "host" or self.sync:
            self._raise_failed(self.slots.tolist(), sizes)
            return
        if _IN_FLIGHT:
            _poll(wait=False)
        if self._in_flight:
            return
        self._copy_to_host()
        self._sizes, self._in_flight = sizes, True
        _IN_FLIGHT.append(self)

    def _where(self) -> str:
        """"host" (CPU slots: Triton's interpreter), "gpu", or "capturing" (a CUDA graph)."""
        import torch
        if not self.slots.is_cuda:
            return "host"
        return "capturing" if torch.cuda.is_current_stream_capturing() else "gpu"

    def _copy_to_host(self) -> None:
        """Queue the copy of the slots to pinned host memory, and an event behind it."""
        import torch
        if self._host is None:
            self._host = torch.empty(self.slots.shape, dtype=self.slots.dtype, pin_memory=True)
            self._event = torch.cuda.Event()
        self._host.copy_(self.slots, non_blocking=True)
        self._event.record()

    def _arrived(self, wait: bool) -> bool:
        if wait:
            self._event.synchronize()
            return True
        return self._event.query()

    def _raise_failed(self, values: list, sizes: tuple) -> None:
        for k, v in enumerate(values):
            if v != SENTINEL:
                self.slots.fill_(SENTINEL)
                raise error_for(self.sites[k], v, sizes[k])


# graphs whose slots are being copied to the host (TritonErrorSlots.after_call)
_IN_FLIGHT: list[TritonErrorSlots] = []


def _poll(wait: bool) -> None:
    """Raise the first failure among the copies that have arrived (all of them, with `wait`)."""
    for slots in list(_IN_FLIGHT):
        if slots._arrived(wait):
            _IN_FLIGHT.remove(slots)
            slots._in_flight = False
            slots._raise_failed(slots._host.tolist(), slots._sizes)


def check_kernel_errors() -> None:
    """Wait for the Triton kernels' check results still on their way to the host, and raise the
    error of a check that failed (an out-of-range index, an integer division by zero) in a
    graph call that has not raised it yet.  Without it, such an error is raised by the next call
    of a compiled graph (see TritonErrorSlots)."""
    _poll(wait=True)


@atexit.register
def _unreported() -> None:
    try:
        _poll(wait=True)
    except Exception as e:  # noqa: BLE001 - nothing to raise into at exit: say it
        log.error("torchfuse: a compiled graph's last calls met a value eager rejects, not raised "
                  "before the process ended: %s", e)
