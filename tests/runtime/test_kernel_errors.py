"""The Triton kernels' error slots (runtime/kernel_errors.py): on a GPU a graph call queues the
slots' copy to the host and a later call raises what it shows (no synchronization per call);
on the CPU (Triton's interpreter) and in strict mode the call that met a bad index raises.  The
GPU path is driven here with a stand-in for the copy and its event; tests/gpu runs the real one."""
from __future__ import annotations

import os
import pickle

import pytest
import torch
import torch.nn.functional as F

import torchfuse
from torchfuse.runtime import kernel_errors
from torchfuse.runtime.kernel_errors import SENTINEL, KernelIndexError, TritonErrorSlots


class _Event:
    def __init__(self):
        self.done = False

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        self.done = True


class _GpuSlots(TritonErrorSlots):
    """The GPU path on CPU tensors: the copy is made at once, its event arrives when told."""

    def _where(self) -> str:
        return "gpu"

    def _copy_to_host(self) -> None:
        self._host = self.slots.clone()
        self._event = _Event()


SITES = [("index", "embedding dim 0"), ("div", "pyfloordiv")]


@pytest.fixture(autouse=True)
def _nothing_in_flight():
    yield
    kernel_errors._IN_FLIGHT.clear()


def test_gpu_path_raises_at_a_later_call():
    slots = _GpuSlots(torch.full((2,), SENTINEL, dtype=torch.int64), SITES)
    slots.after_call((11, 0))                       # a clean call: a copy in flight
    assert kernel_errors._IN_FLIGHT == [slots]
    slots.slots[0] = 13                             # the next call's kernel meets index 13
    slots.after_call((11, 0))                       # the first copy has not arrived: no new one
    slots._event.done = True
    slots.after_call((11, 0))                       # it arrived clean; this call copies the 13
    slots._event.done = True
    with pytest.raises(KernelIndexError, match="index 13 is out of bounds for dimension 0 with size 11"):
        slots.after_call((11, 0))
    assert slots.slots.tolist() == [SENTINEL, SENTINEL]      # raised once, then clean again
    slots.after_call((11, 0))
    torchfuse.check_kernel_errors()                 # (waits for the copy: nothing failed)
    assert kernel_errors._IN_FLIGHT == []


def test_check_kernel_errors_waits_for_the_copy():
    slots = _GpuSlots(torch.full((2,), SENTINEL, dtype=torch.int64), SITES)
    slots.slots[1] = 1                              # a division by zero
    slots.after_call((11, 0))
    with pytest.raises(ZeroDivisionError):
        torchfuse.check_kernel_errors()


def test_another_graphs_call_raises_it():
    a = _GpuSlots(torch.full((2,), SENTINEL, dtype=torch.int64), SITES)
    b = _GpuSlots(torch.full((1,), SENTINEL, dtype=torch.int64), SITES[:1])
    a.slots[0] = -12
    a.after_call((11, 0))
    a._event.done = True
    with pytest.raises(IndexError, match="index -12"):
        b.after_call((5,))


def test_strict_reads_at_the_call_and_slots_pickle():
    slots = _GpuSlots(torch.full((2,), SENTINEL, dtype=torch.int64), SITES, sync=True)
    slots.slots[0] = 40
    with pytest.raises(IndexError, match="index 40"):
        slots.after_call((11, 0))
    assert kernel_errors._IN_FLIGHT == []
    again = pickle.loads(pickle.dumps(TritonErrorSlots(slots.slots, SITES, sync=True)))
    assert again.sync and again.sites == tuple(SITES) and again._host is None
    torch.testing.assert_close(again.view(1, 1), slots.slots[1:])


def test_triton_interpreter_raises_at_the_call_cold_and_warm(tmp_path, monkeypatch):
    """Under TRITON_INTERPRET (CPU slots) the call that met the bad index raises, also when the
    graph comes from the graph cache (its slots restored, the kernels' slices taken again)."""
    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", os.environ.get("TRITON_INTERPRET", "1"))
    monkeypatch.setenv("TORCHFUSE_CACHE_DIR", str(tmp_path))

    def fn(t, i):
        return F.gelu(F.embedding(i, t)) + t[i.flip(0) % 3].sum(-1, keepdim=True)
    t = torch.randn(13, 6)
    good, bad = torch.tensor([4, 0, 12, 7, 3]), torch.tensor([4, 0, 13, 7, 3])
    hits = torchfuse.counters["graph_cache_hits"]
    for _ in range(2):
        torch._dynamo.reset()
        f = torch.compile(fn, backend="torchfuse", options={"cpu_backend": "triton"})
        torch.testing.assert_close(f(t, good), fn(t, good))
        with pytest.raises(IndexError):
            fn(t, bad)
        with pytest.raises(IndexError, match="index 13 is out of bounds for dimension 0 with size 13"):
            f(t, bad)
        torch.testing.assert_close(f(t, good), fn(t, good))
    assert torchfuse.counters["graph_cache_hits"] > hits


@pytest.mark.parametrize("options, sync", [({}, False), ({"strict": True}, True),
                                           ({"strict": True, "sync_checks": False}, False),
                                           ({"sync_checks": True}, True)])
def test_sync_checks_follows_strict_unless_set(monkeypatch, tmp_path, options, sync):
    """`sync_checks` (None: as `strict`) decides whether a graph's slots are read after every
    call: the zoo times strict compiles without that synchronization."""
    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", os.environ.get("TRITON_INTERPRET", "1"))
    monkeypatch.setenv("TORCHFUSE_CACHE_DIR", str(tmp_path))
    made = []
    init = TritonErrorSlots.__init__

    def recording_init(self, *args, **kwargs):
        init(self, *args, **kwargs)
        made.append(self.sync)
    monkeypatch.setattr(TritonErrorSlots, "__init__", recording_init)
    torch._dynamo.reset()

    def fn(t, i):
        return t[i] * 2
    t, i = torch.randn(7, 3), torch.tensor([6, 0, -1])
    f = torch.compile(fn, backend="torchfuse", options={"cpu_backend": "triton", "graph_cache": False, **options})
    torch.testing.assert_close(f(t, i), fn(t, i))
    assert made and all(s is sync for s in made), made
    torch._dynamo.reset()


def test_sync_checks_option_is_checked():
    with pytest.raises(ValueError, match="sync_checks"):
        torchfuse.compile(lambda x: x + 1, options={"sync_checks": "yes"})(torch.randn(3))
