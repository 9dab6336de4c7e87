"""The generated Python wrapper: allocate buffers, launch kernels, call ATen fallbacks, free early.

The wrapper is Python source generated per graph (printable, so it can be read in the debug
folder) and `exec`-ed once.  Per call it only does what must happen at run time: bind symbolic
sizes from the inputs, allocate outputs and stored intermediates, call kernels through ctypes,
and `del` each intermediate right after its last use.
"""
from __future__ import annotations

import functools
import operator
from typing import Any, Callable

import torch

from ..ir.buffers import AliasView, BufferRef, FallbackCall, Layout, LoweredGraph, is_row_major
from ..ir.nodes import INDEX, Node, loads as _ir_loads, py_index
from ..scheduler.collectives import collective_name, is_start, is_wait
from ..scheduler.fusion import Kernel
from ..scheduler.memory_order import returns_fresh, sink_steps, step_refs
from ..scheduler.overlap import inputs_until_wait, overlap_collectives


def _tuple(nodes) -> str:
    return "(" + "".join(py_index(n) + ", " for n in nodes) + ")"


def meta_bytes(meta: tuple | None) -> int | None:
    """A buffer's size in bytes from its (sizes, strides, dtype, device) meta; None when a size
    is symbolic or there is no dtype."""
    if meta is None:
        return None
    sizes, _, dtype, _ = meta
    if not all(s.op == "const" for s in sizes) or not isinstance(dtype, torch.dtype):
        return None
    return functools.reduce(operator.mul, (int(s.arg) for s in sizes), 1) * dtype.itemsize


class MemoryPlan:
    """Bytes the wrapper holds as it runs, for explain(): each allocation, each name that shares
    one (a view, an in-place output), each `del`.  Inputs are counted apart (`enter`): the caller
    may hold them too, but a backward graph's inputs (the saved activations) it hands over, and
    the wrapper's `del` after their last reader is what frees them.  Outputs stay.  With a
    symbolic size the plan is unknown (`known` False)."""

    def __init__(self) -> None:
        self.owner: dict[str, int] = {}        # name -> storage id
        self.first_name: dict[int, str] = {}   # storage id -> the name it was allocated under
        self.at_peak: dict[int, int] = {}      # storage id -> bytes, live at the peak (inputs too)
        self.size: dict[int, int] = {}         # live storage id -> bytes
        self.names: dict[int, int] = {}        # live storage id -> live names
        self.input_ids: set[int] = set()
        self.live = self.peak_bytes = self.allocated = self.saved = self.ids = 0
        self.inputs_live = self.input_bytes = self.inputs_freed = self.peak_with_inputs = 0
        self.known = True

    def _bytes(self, meta: tuple) -> int | None:
        n = meta_bytes(meta)
        if n is None:
            self.known = False
        return n

    def _new(self, name: str, n: int) -> int:
        self.ids += 1
        sid = self.ids
        self.owner[name], self.size[sid], self.names[sid] = sid, n, 1
        self.first_name[sid] = name
        return sid

    def _note_peak(self) -> None:
        if self.live > self.peak_bytes:
            self.peak_bytes = self.live
            self.at_peak = self.size.copy()    # (per new peak: a C-level copy, no Python loop)
        total = self.live + self.inputs_live
        if total > self.peak_with_inputs:
            self.peak_with_inputs = total

    def enter(self, name: str, meta: tuple) -> None:
        """An input, held from the start."""
        n = self._bytes(meta)
        if n is not None:
            self.input_ids.add(self._new(name, n))
            self.inputs_live += n
            self.input_bytes += n
            self._note_peak()

    def alloc(self, name: str, meta: tuple) -> None:
        n = self._bytes(meta)
        if n is None:
            return
        self._new(name, n)
        self.live += n
        self.allocated += n
        self._note_peak()

    def share(self, name: str, existing: str, reused: bool = False) -> None:
        sid = self.owner.get(existing)
        if sid is not None and sid in self.names:
            self.owner[name] = sid
            self.names[sid] += 1
            if reused:
                self.saved += self.size[sid]

    def release(self, name: str) -> None:
        sid = self.owner.pop(name, None)
        if sid is not None and sid in self.names:
            self.names[sid] -= 1
            if not self.names[sid]:
                n = self.size.pop(sid)
                del self.names[sid]
                if sid in self.input_ids:
                    self.inputs_live -= n
                    self.inputs_freed += n
                else:
                    self.live -= n

    def describe(self) -> str:
        if not self.known:
            return "planned peak: symbolic sizes"
        return (f"planned peak {_human(self.peak_bytes)} held by the wrapper, {_human(self.peak_with_inputs)} with "
                f"the inputs it holds; {_human(self.allocated)} allocated, {_human(self.saved)} written in place; "
                f"inputs {_human(self.input_bytes)}, {_human(self.inputs_freed)} of them dropped after their last reader"
                + self._peak_holders())

    def _peak_holders(self, top: int = 4) -> str:
        """The largest storages live at the peak the wrapper's own buffers reach: where to look
        when that peak is too high."""
        held = [(self.first_name[sid], n) for sid, n in self.at_peak.items() if sid not in self.input_ids]
        largest = sorted(held, key=lambda nb: -nb[1])[:top]
        if not largest:
            return ""
        more = len(held) - len(largest)
        return ("; at the peak: " + ", ".join(f"{name} {_human(n)}" for name, n in largest)
                + (f" and {more} more" if more > 0 else ""))


def _human(n: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"


class WrapperBuilder:
    def __init__(self, program: LoweredGraph, items: list, kernel_args: dict[str, tuple[list[str], list[str]]],
                 stored: set[str], kernel_calls: dict[str, str] | None = None,
                 register_only: set[str] | frozenset[str] = frozenset(),
                 reductions_in_place: bool = False, kernel_checks: dict[str, list] | None = None,
                 triton_checks: dict[str, tuple] | None = None, sync_checks: bool = False):
        self.program = program
        # C++ kernels that check values at run time (codegen/checks.py): the call's non-zero
        # result raises eager's error
        self.kernel_checks = kernel_checks or {}
        # Triton kernels' error slots (name, sites, size expressions, device), slices of one
        # runtime.kernel_errors.TritonErrorSlots per device, looked at once the graph's kernels
        # have run (on a GPU without a synchronization, unless `sync_checks`)
        self.triton_checks = triton_checks or {}
        self.sync_checks = sync_checks
        self.kernel_args = kernel_args
        # collectives' starts early and waits late (scheduler/overlap.py), then steps later where that
        # lowers the peak (never across a collective)
        items = overlap_collectives(items, kernel_args, program.slices)
        self.items = _input_copies_last(sink_steps(items, kernel_args, lambda b: meta_bytes(program.buffer_meta.get(b))), kernel_args)
        self.outputs = {o for o in program.outputs if isinstance(o, str)}
        self.reused = 0
        self.kernel_calls = kernel_calls or {}
        self.stored = stored
        # stored by a kernel's looped variant only; the variant that always runs keeps them in
        # registers, so they get a one-element placeholder of their dtype instead of memory
        self.register_only = register_only
        # a reduction kernel's row-wise output may take the storage of a row-wise input (generated
        # Triton: each row is read whole before any of it is written, see _in_place_donor)
        self.reductions_in_place = reductions_in_place
        from ..scheduler.split import split_factor
        self.globals: dict[str, Any] = {"torch": torch, "aten": torch.ops.aten, "_split_factor": split_factor}
        self.lines: list[str] = []
        self.memory = MemoryPlan()
        self.labels: dict[int, str] = {}     # line index -> profiler label (kernel calls)
        # views of graph inputs that ATen calls read more than once (an RNN's transposed weight,
        # read by the matmul of every time step): made once, named, dropped after the last reader
        self.shared_views: dict[str, tuple[str, int]] = {}     # view text -> (name, last step)
        self.views_made: set[str] = set()
        self.slice_bases: set[str] = set()    # concatenation buffers allocated so far (_alloc_slice)
        self.copies_in_place: set[str] = set()

    def const(self, value: Any) -> str:
        if value is None or isinstance(value, (bool, int, float, str)):
            if isinstance(value, float) and (value != value or value in (float("inf"), float("-inf"))):
                pass
            else:
                return repr(value)
        name = f"_c{len(self.globals)}"
        self.globals[name] = value
        return name

    def arg(self, a: Any) -> str:
        if isinstance(a, BufferRef):
            if a.layout is None:
                return a.buffer
            text = self.view(a.buffer, a.layout)
            shared = self.shared_views.get(text)
            if shared is None:
                return text
            if shared[0] not in self.views_made:     # first reader: made just before its call
                self.views_made.add(shared[0])
                self.lines.append(f"    {shared[0]} = {text}")
            return shared[0]
        if isinstance(a, Node):
            return py_index(a) if a.dtype == INDEX else self.const(a)
        if isinstance(a, list):
            return "[" + ", ".join(self.arg(x) for x in a) + "]"
        if isinstance(a, tuple):
            return "(" + "".join(self.arg(x) + ", " for x in a) + ")"
        return self.const(a)

    def view(self, base: str, layout: Layout) -> str:
        return f"_reinterpret({base}, {_tuple(layout.sizes)}, {_tuple(layout.strides)}, {py_index(layout.offset)})"

    def build(self) -> str:
        p = self.program
        L = self.lines
        L.append("def call(args):")
        names = [f"in{i}" for i in range(len(p.inputs))]
        if names:
            L.append(f"    {', '.join(names)}, = args")
        for sym_name, (pos, kind, dim) in sorted(p.symbols.items()):
            if kind == "runtime":
                continue          # bound by the fallback that produces it
            src = f"in{pos}.size({dim})" if kind == "size" else f"in{pos}.stride({dim})" if kind == "stride" \
                else f"int(in{pos})"
            L.append(f"    {sym_name} = {src}")
        L.append("    args.clear()")
        used = self._used_buffers()
        for i, (_, val) in enumerate(p.inputs):
            if isinstance(val, torch.Tensor) and val.ndim > 0 and f"in{i}" in used:
                # Kernels index inputs with the strides they were traced with; Dynamo guards user
                # inputs, but tensors handed over between graphs (saved for backward) may differ.
                sizes, strides, _, _ = p.buffer_meta[f"in{i}"]
                dims = [d for d, s in enumerate(sizes) if not (s.op == "const" and s.arg == 1)]
                if not dims:
                    continue
                # one .stride() call per input (a tuple compare), not one per dim: ~0.4 vs ~1.6 us
                if len(dims) == len(sizes):
                    got, want = f"in{i}.stride()", _tuple(strides)
                else:     # (itemgetter of one index gives a scalar)
                    got = f"{self.const(operator.itemgetter(*dims))}(in{i}.stride())"
                    want = _tuple([strides[d] for d in dims]) if len(dims) > 1 else py_index(strides[dims[0]])
                # (an input traced as a tensor may be None at run time: AOTAutograd effect tokens)
                L.append(f"    if in{i} is not None and {got} != {want}: "
                         f"in{i} = _restride(in{i}, {_tuple(sizes)}, {_tuple(strides)})")
        for i, (_, val) in enumerate(p.inputs):
            if isinstance(val, torch.Tensor) and f"in{i}" in p.buffer_meta:
                self.memory.enter(f"in{i}", p.buffer_meta[f"in{i}"])
        last_use = self._last_uses()
        self.shared_views = self._shared_input_views(set(names))
        # Inputs are dropped after their last reader like any buffer: a backward graph's inputs
        # are the activations the forward saved, and the caller cleared its list (boxed call),
        # so each is freed as soon as the backward is done with it, not when the graph returns.
        unread = [n for n in names if n not in last_use and n not in self.outputs]
        if unread:
            L.append(f"    del {', '.join(unread)}")
            for n in unread:
                self.memory.release(n)
        reusable = self._reusable()
        into_input, skipped_copies = self._mutations_in_place(last_use)
        # input mutations whose copy back is a no-op (the kernel wrote the input): not fallbacks
        self.copies_in_place = {item.node_name for item in self.items if id(item) in skipped_copies}
        for buf, inp in sorted(into_input.items()):
            L.append(f"    _mutated_{inp} = {inp}   # written in place by the kernel storing {buf}")
        for pos, item in enumerate(self.items):
            if isinstance(item, Kernel):
                bufs, syms = self.kernel_args[item.name]
                for sym_name, expr in item.bindings:     # e.g. a split factor from run-time sizes
                    L.append(f"    {sym_name} = {expr}")
                donor = self._in_place_donor(item, pos, last_use, reusable)
                for m in item.members:
                    if m.buffer.into is not None:
                        continue                # writes into a buffer that exists already
                    if m.buffer.name in into_input:
                        L.append(f"    {m.buffer.name} = {into_input[m.buffer.name]}   # the input it updates")
                    elif m.buffer.name in self.register_only:
                        _, _, dtype, device = self.program.buffer_meta[m.buffer.name]
                        L.append(f"    {m.buffer.name} = {self.const(_placeholder)}({self.const(device)}, "
                                 f"{self.const(dtype)})   # held in registers, never written")
                    elif m.buffer.name in p.slices:
                        self._alloc_slice(m.buffer.name)
                    elif m.buffer.name in self.stored:
                        if donor is not None and m.buffer.name == donor[0]:
                            L.append(f"    {m.buffer.name} = {donor[1]}   # in place: {donor[1]} dies here")
                            self.memory.share(m.buffer.name, donor[1], reused=True)
                            reusable.add(m.buffer.name)
                            self.reused += 1
                        else:
                            self._alloc(m.buffer.name)
                            reusable.add(m.buffer.name)
                self.labels[len(L)] = item.name
                if item.name in self.kernel_calls:
                    L.append(f"    {self.kernel_calls[item.name]}")
                else:
                    call_args = [f"{b}.data_ptr()" for b in bufs] + list(syms)
                    if item.name in self.kernel_checks:
                        from ..runtime.kernel_errors import raise_cpp_error
                        sites = self.const(tuple(tuple(s) for s in self.kernel_checks[item.name]))
                        L.append(f"    if {item.name}({', '.join(call_args)}): "
                                 f"{self.const(raise_cpp_error)}({sites}, _tf_last_error)")
                    else:
                        L.append(f"    {item.name}({', '.join(call_args)})")
                scattered = item.scatter
                if scattered is not None:      # the scatter updated its `into` buffer in place
                    L.append(f"    {scattered.name} = {scattered.into}")
                    self.memory.share(scattered.name, scattered.into)
            elif isinstance(item, AliasView):
                L.append(f"    {item.name} = {self.view(item.base, item.layout)}")
                self.memory.share(item.name, item.base)
            elif isinstance(item, FallbackCall) and id(item) in skipped_copies:
                inp = item.args[0].buffer
                # the kernel wrote the input itself, unless the input was restrided to a copy
                L.append(f"    if _mutated_{inp} is not {inp}: _mutated_{inp}.copy_({inp})")
                for o in item.outputs:
                    if o is not None:
                        L.append(f"    {o} = _mutated_{inp}")
            elif isinstance(item, FallbackCall):
                self._fallback(item)
                for o in item.outputs:
                    if o is not None and o in p.buffer_meta:
                        if returns_fresh(item.target) and not is_wait(item):   # (a wait returns its input)
                            self.memory.alloc(o, p.buffer_meta[o])
                        elif item.args and isinstance(item.args[0], BufferRef):
                            self.memory.share(o, item.args[0].buffer)
            dead = [b for b, last in last_use.items() if last == pos and b not in self.outputs]
            dead_views = [name for name, last in self.shared_views.values() if last == pos and name in self.views_made]
            if dead_views:
                L.append(f"    del {', '.join(sorted(dead_views))}")
            if dead:
                L.append(f"    del {', '.join(sorted(dead))}")
                for b in dead:
                    self.memory.release(b)
        outs = []
        for o in p.outputs:
            if o is None:
                outs.append("None")
            elif isinstance(o, str):
                outs.append(o)
            elif o[0] == "sym":
                outs.append(py_index(o[1]))
            else:
                outs.append(self.const(o[1]))
        prologue = self._error_slots() if self.triton_checks else ""
        L.append(f"    return ({''.join(x + ', ' for x in outs)})")
        return prologue + self._with_profiled_variant()

    def _error_slots(self) -> str:
        """One TritonErrorSlots per device for the graph's Triton kernels with checks, each
        kernel's slots a slice of it (one copy to the host per call, not one per kernel); the
        slices are taken again where the wrapper is linked (the module-level lines returned),
        since a graph cache entry restores the constants unpickled one by one."""
        from torch._subclasses.fake_tensor import unset_fake_temporarily

        from ..runtime.kernel_errors import SENTINEL, TritonErrorSlots
        by_device: dict[str, list[tuple]] = {}
        for entry in self.triton_checks.values():
            by_device.setdefault(str(entry[3]), []).append(entry)
        lines = []
        for kernels in by_device.values():
            with unset_fake_temporarily():       # (compiles run under AOTAutograd's fake mode)
                base = torch.full((sum(len(k[1]) for k in kernels),), SENTINEL, dtype=torch.int64,
                                  device=kernels[0][3])
            slots = TritonErrorSlots(base, [s for k in kernels for s in k[1]], sync=self.sync_checks)
            c = self.const(slots)
            start = 0
            for name, sites, _, _ in kernels:
                self.globals[name] = slots.view(start, len(sites))
                lines.append(f"{name} = {c}.view({start}, {len(sites)})")
                start += len(sites)
            sizes = "".join(x + ", " for k in kernels for x in k[2])
            self.lines.append(f"    {c}.after_call(({sizes}))")
        return "\n".join(lines) + "\n\n\n"

    def _with_profiled_variant(self) -> str:
        """`call`, plus `call_profiled`: the same steps with every kernel call inside a
        `record_function` named after the kernel, so that torch.profiler shows C++ kernels (and
        Triton launches' host time) by name.  `call` switches to it while a profiler runs: one
        check per graph call, nothing per kernel."""
        plain = ["def call(args):", "    if _profiling(): return call_profiled(args)"] + self.lines[1:]
        profiled = ["", "", "# the same, with each kernel call named for torch.profiler",
                    "def call_profiled(args):"]
        for i, line in enumerate(self.lines[1:], start=1):
            label = self.labels.get(i)
            if label is None:
                profiled.append(line)
            else:
                profiled += [f"    with _record_function({label!r}):", "    " + line]
        return "\n".join(plain + profiled) + "\n"

    def _used_buffers(self) -> set[str]:
        """Buffers some step reads or the graph returns (an input read by nothing, a parameter
        only a hoisted computation used, needs no stride check)."""
        used = set(self.outputs)
        for item in self.items:
            used.update(step_refs(item, self.kernel_args))
        return used

    def _reusable(self) -> set[str]:
        """Buffers whose storage nothing else can see: not inputs or outputs, not the base of a
        view, not handed to an ATen op that may return an alias of it.  Filled as the wrapper
        is built (a kernel's allocated buffers; fallback outputs that are fresh tensors)."""
        self._shared: set[str] = set(self.outputs)
        for item in self.items:
            if isinstance(item, AliasView):
                self._shared |= {item.base, item.name, *item.after}
            elif isinstance(item, FallbackCall) and not returns_fresh(item.target):
                self._shared |= set(step_refs(item, self.kernel_args)) | {o for o in item.outputs if o is not None}
        fresh = {o for item in self.items if isinstance(item, FallbackCall) and returns_fresh(item.target)
                 for o in item.outputs if o is not None and o in self.program.buffer_meta}
        return fresh - self._shared

    def _mutations_in_place(self, last_use: dict[str, int]) -> tuple[dict[str, str], set[int]]:
        """Input mutations (AOTAutograd's `copy_(input, new_value)`, e.g. batch norm's running
        statistics) written by the kernel that computes the new value, straight into the input:
        {buffer: input} and the copies that become no-ops.  Only when the input is read by
        nothing after that kernel, has no views, and the kernel reads it only in the member that
        stores the new value, at the element it stores (read before written, as in place)."""
        kernel_of: dict[str, tuple[int, Kernel]] = {}
        readers: dict[str, list[int]] = {}
        for pos, item in enumerate(self.items):
            if isinstance(item, Kernel):
                for m in item.members:
                    kernel_of[m.buffer.name] = (pos, item)
            for b in step_refs(item, self.kernel_args):
                readers.setdefault(b, []).append(pos)
        into: dict[str, str] = {}
        skipped: set[int] = set()
        for cpos, item in enumerate(self.items):
            if not (isinstance(item, FallbackCall) and item.target is torch.ops.aten.copy_.default
                    and len(item.args) == 2 and not item.kwargs):
                continue
            dst, src = item.args
            if not (isinstance(dst, BufferRef) and isinstance(src, BufferRef) and dst.layout is None
                    and src.layout is None and dst.buffer.startswith("in") and src.buffer in kernel_of):
                continue
            inp, buf = dst.buffer, src.buffer
            kpos, kernel = kernel_of[buf]
            if kernel.scatter is not None:
                if kernel.scatter.into == inp:     # it wrote the input's rows itself (lowering/scatter.py)
                    into[buf] = inp
                    skipped.add(id(item))
                continue
            if (buf not in self.stored or buf in self.outputs or buf in into or inp in into.values()
                    or buf in self.program.slices
                    or last_use.get(buf) != cpos or not set(readers.get(buf, ())) <= {kpos, cpos}
                    or any(r > kpos and r != cpos for r in readers.get(inp, ()))
                    or any(isinstance(it, AliasView) and it.base == inp for it in self.items)
                    or self.program.buffer_meta[buf][:3] != self.program.buffer_meta[inp][:3]):
                continue
            target = next(m for m in kernel.members if m.buffer.name == buf)
            ok = True
            for m in kernel.members:
                for ld in _ir_loads(m.body):
                    if ld.arg == inp and (m is not target or ld.args[0] != target.store):
                        ok = False
            if ok:
                into[buf] = inp
                skipped.add(id(item))
        return into, skipped

    def _in_place_donor(self, kernel: Kernel, pos: int, last_use: dict[str, int],
                        reusable: set[str]) -> tuple[str, str] | None:
        """(buffer, donor): the kernel's last stored buffer may take the storage of a buffer
        that dies at this kernel, when it has the same layout and dtype and the kernel reads it
        only at the element it writes (a pointwise kernel: each element is read before it is
        overwritten, by the same thread).  Saves an allocation and, on CPU, the page faults of
        touching fresh memory; on GPU the allocator's peak."""
        if (kernel.kind != "pointwise" and not self.reductions_in_place) or kernel.scatter is not None:
            return None
        # the last stored member: every load of the kernel is emitted before its store.  A
        # concatenation's slice takes no storage: in a pointwise kernel the stored member before
        # it may (an LSTM step stores c, then h into the stack), if no member after it loads
        # the donor, which it has overwritten by then
        stored = [m for m in kernel.members if m.buffer.name in self.stored]
        while stored and stored[-1].buffer.name in self.program.slices and kernel.kind == "pointwise":
            stored.pop()
        if not stored or stored[-1].buffer.name in self.program.slices:
            return None
        target = stored[-1]
        loaded_later = {ld.arg for m in kernel.members[kernel.members.index(target) + 1:] for ld in _ir_loads(m.body)}
        if kernel.kind != "pointwise" and target.role != "inner":
            return None
        # (A reduction's elementwise output, a softmax's probabilities over its scores: a row is
        # owned by one program, and every store of it depends on the row's reduced values, so
        # no load of the row's input can come after its store in any loop order.)
        meta = self.program.buffer_meta[target.buffer.name]
        reads: dict[str, set] = {}
        for m in kernel.members:
            for ld in _ir_loads(m.body):
                reads.setdefault(ld.arg, set()).add(ld.args[0])
        # the stored value must depend on the donor's element (a load in its own body), so no
        # compiler may move the store ahead of the donor's load (C++ pointers are __restrict__)
        own = {ld.arg for ld in _ir_loads(target.body)}
        if kernel.kind != "pointwise":
            # through the kernel's other members: softmax(scores + bias) stores exp(s - max) / sum
            # of s = scores + bias, a member of its own (kept in registers)
            members = {m.buffer.name: m for m in kernel.members}
            frontier = [n for n in own if n in members]
            while frontier:
                for ld in _ir_loads(members[frontier.pop()].body):
                    if ld.arg not in own:
                        own.add(ld.arg)
                        if ld.arg in members:
                            frontier.append(ld.arg)
            # only an output computed from the row's reduced values is stored after the last
            # pass over the row (an elementwise member stored in an earlier pass would overwrite
            # what a later pass reads again)
            if not any(members[n].role == "reduce" for n in own if n in members):
                return None
        for name, indices in reads.items():
            if (name in own and name in reusable and name not in self._shared and last_use.get(name) == pos
                    and name not in loaded_later
                    and indices == {target.store} and self.program.buffer_meta.get(name) == meta):
                return target.buffer.name, name
        return None

    def _alloc_slice(self, name: str) -> None:
        """A buffer stored into its slice of a concatenation's buffer (allocated here by the first
        of its parts that is written): a view, never a donor or taker of storage."""
        base, offset = self.program.slices[name]
        if base not in self.slice_bases:
            self.slice_bases.add(base)
            self._alloc(base)
        sizes, strides, _, _ = self.program.buffer_meta[name]
        self.lines.append(f"    {name} = {self.view(base, Layout(sizes, strides, offset))}")
        self.memory.share(name, base)

    def _alloc(self, name: str) -> None:
        self.memory.alloc(name, self.program.buffer_meta[name])
        sizes, strides, dtype, device = self.program.buffer_meta[name]
        self.lines.append(f"    {name} = {self.const(_allocator(device))}({_tuple(sizes)}, {_tuple(strides)}, "
                          f"{self.const(dtype)})")

    def _binding(self, item: FallbackCall) -> Any:
        if item.target is torch.ops.aten.convolution.default and len(item.args) == 9 and not item.kwargs \
                and item.outputs[0] in self.program.buffer_meta:
            # a channels-last CPU convolution: its weight reordered for oneDNN once (runtime/cpu_conv.py)
            from ..runtime import cpu_conv
            sizes, strides, dtype, device = self.program.buffer_meta[item.outputs[0]]
            w = item.args[1]
            w_sizes = (w.layout.sizes if w.layout is not None else self.program.buffer_meta[w.buffer][0]) \
                if isinstance(w, BufferRef) and (w.layout is not None or w.buffer in self.program.buffer_meta) else ()
            # a weight the graph computes (a training step's channels-last copy) is new in
            # every call: only graph inputs (parameters, hoisted copies) are worth keeping
            graph_input = isinstance(w, BufferRef) and w.buffer in {f"in{i}" for i in range(len(self.program.inputs))}
            if graph_input and cpu_conv.use_packed(sizes, strides, device, w_sizes, dtype):
                return cpu_conv.convolution
        return python_binding(item.target, len(item.args), frozenset(item.kwargs))

    def _fallback(self, item: FallbackCall) -> None:
        L = self.lines
        if item.target == "get_attr":
            L.append(f"    {item.outputs[0]} = {self.const(item.args[0])}")
            return
        fn = self.const(self._binding(item))
        args = ", ".join(self.arg(a) for a in item.args)
        kwargs = ", ".join(f"{k}={self.arg(v)}" for k, v in item.kwargs.items())
        call = f"{fn}({args}{', ' if args and kwargs else ''}{kwargs})"
        tensors = [o for o in item.outputs if o is not None and o in self.program.buffer_meta]
        named = [o for o in item.outputs if o is not None]
        if is_start(item):        # (named in the wrapper, which is read to see the overlap)
            call += f"   # {collective_name(item)} starts"
        elif is_wait(item):
            call += "   # wait for the collective"
        if len(item.outputs) == 1 and named and not item.multi:
            L.append(f"    {named[0]} = {call}")
        elif named:
            tmp = f"_r_{item.node_name}"
            L.append(f"    {tmp} = {call}")
            for k, o in enumerate(item.outputs):
                if o is not None:
                    L.append(f"    {o} = {tmp}[{k}]")
            L.append(f"    del {tmp}")   # the tuple would keep outputs alive past their last use
        else:
            L.append(f"    {call}")
        for sym_name, buf, dim in item.binds:
            L.append(f"    {sym_name} = {buf}.size({dim})")
        if is_start(item):
            return      # its result is not ready: a copy would read it too early (the wait's result is checked)
        if item.target in _DENSE_RESULTS and len(tensors) == 1 and \
                is_row_major(*self.program.buffer_meta[tensors[0]][:2]):
            return      # (no check: a host-bound graph of many small matmuls pays ~0.5 us each)
        for o in tensors:
            # Kernels index this buffer with the strides the fake tensor predicted; ATen almost
            # always agrees, and when it does not we restride once rather than read garbage.
            sizes, strides, dtype, _ = self.program.buffer_meta[o]
            none_ok = f"{o} is not None and " if len(item.outputs) > 1 else ""   # undefined optional outputs
            # The same for the dtype: a few ops' fake kernels disagree with eager (fp16 batch norm
            # running stats come back fp16 where the fake says fp32); kernels would misread them.
            if isinstance(dtype, torch.dtype):
                L.append(f"    if {none_ok}{o}.dtype is not {self.const(dtype)}: {o} = {o}.to({self.const(dtype)})")
            L.append(f"    if {none_ok}{o}.stride() != {_tuple(strides)}: {o} = _restride({o}, {_tuple(sizes)}, {_tuple(strides)})")

    def _shared_input_views(self, inputs: set[str]) -> dict[str, tuple[str, int]]:
        """Views of graph inputs that ATen calls take at two or more steps, by their text: a name
        for each and the last step reading it.  (Only inputs: their names are bound once, so the
        view made at the first reader is the one every later reader would make.)"""
        uses: dict[str, list[int]] = {}

        def visit(a: Any, pos: int) -> None:
            if isinstance(a, BufferRef):
                if a.layout is not None and a.buffer in inputs:
                    uses.setdefault(self.view(a.buffer, a.layout), []).append(pos)
            elif isinstance(a, (list, tuple)):
                for x in a:
                    visit(x, pos)

        for pos, item in enumerate(self.items):
            if isinstance(item, FallbackCall):
                visit(item.args, pos)
                visit(list(item.kwargs.values()), pos)
        return {text: (f"_view{k}", max(steps)) for k, (text, steps) in
                enumerate(t for t in uses.items() if len(t[1]) > 1)}

    def _last_uses(self) -> dict[str, int]:
        last: dict[str, int] = {}

        def visit(a: Any, pos: int) -> None:
            if isinstance(a, BufferRef):
                last[a.buffer] = pos
            elif isinstance(a, (list, tuple)):
                for x in a:
                    visit(x, pos)

        for pos, item in enumerate(self.items):
            if isinstance(item, Kernel):
                bufs, _ = self.kernel_args[item.name]
                for b in bufs:
                    last[b] = pos
            elif isinstance(item, AliasView):
                for name in (item.base, item.name, *item.after):
                    last[name] = pos
            elif isinstance(item, FallbackCall):
                visit(item.args, pos)
                visit(list(item.kwargs.values()), pos)
                for o in item.outputs:
                    if o is not None and o in self.program.buffer_meta:
                        last.setdefault(o, pos)
                        last[o] = max(last[o], pos)
        # a collective reads its inputs until its wait: no del, no in-place reuse before it
        for pos, inputs in inputs_until_wait(self.items).items():
            for b in inputs:
                last[b] = max(last.get(b, pos), pos)
        return last


# ATen ops whose result is always a new row-major tensor of their inputs' dtype (allocated with
# at::empty of the result's sizes on every device): the wrapper does not check what they return.
_DENSE_RESULTS = frozenset({torch.ops.aten.mm.default, torch.ops.aten.addmm.default,
                            torch.ops.aten.bmm.default, torch.ops.aten.baddbmm.default})


def _input_copies_last(items: list, kernel_args: dict[str, tuple[list[str], list[str]]]) -> list:
    """AOTAutograd's kept input mutations (`copy_(input, new value)`) moved after every other
    step.  In the functional graph every read of an input means its value on entry, but kernels
    inline cheap values by re-reading their inputs (x + x, read again by a later kernel), so an
    input must not change before its last reader ran.  Copies whose result a step reads stay
    (one the graph returns moves: it is read at the return)."""
    read = {b for item in items for b in step_refs(item, kernel_args)}

    def is_input_copy(item: Any) -> bool:
        return (isinstance(item, FallbackCall) and item.target is torch.ops.aten.copy_.default
                and isinstance(item.args[0], BufferRef) and item.args[0].buffer.startswith("in")
                and not any(o is not None and o in read for o in item.outputs))
    copies = [item for item in items if is_input_copy(item)]
    return [item for item in items if not is_input_copy(item)] + copies if copies else list(items)


def _could_bind(schema: Any, n_positional: int, keywords: frozenset[str]) -> bool:
    """Could a call with `n_positional` positional arguments and these keyword names bind to
    `schema`?  (Counts and names only, not types: a conservative yes.)"""
    positional = [a for a in schema.arguments if not a.kwarg_only]
    kw_only = [a for a in schema.arguments if a.kwarg_only]
    if any(a.is_out for a in schema.arguments) and not any(a.is_out and a.name in keywords for a in schema.arguments):
        return False
    required = sum(1 for a in positional if not a.has_default_value())
    return (required <= n_positional <= len(positional)
            and all(a.name in keywords for a in kw_only if not a.has_default_value())
            and keywords <= {a.name for a in schema.arguments})


def _in_place_method(op: Any) -> Any:
    """The Tensor method of an in-place aten op (`index_copy_`), or None."""
    schema = op._schema
    args = schema.arguments
    if (not schema.name.split("::")[-1].endswith("_") or not args or args[0].name != "self"
            or args[0].alias_info is None or not args[0].alias_info.is_write
            or any(a.is_out for a in args) or any(a.alias_info is not None and a.alias_info.is_write for a in args[1:])):
        return None
    return getattr(torch._C.TensorBase, op.overloadpacket.__name__, None)


@functools.lru_cache(maxsize=None)
def python_binding(op: Any, n_positional: int, keywords: frozenset[str] = frozenset()) -> Any:
    """The generated Python binding of an aten op (`torch.convolution` for
    `aten.convolution.default`, the Tensor method `index_copy_` for an in-place op) where calling
    it with these arguments is certain to run that same overload; else the op itself.

    Calling an OpOverload boxes every argument through the op's schema: ~2 us more per call
    than the binding for `mm`, ~5 us for a convolution's nine arguments, and a model's matmuls,
    convolutions and attention run through here every forward (Inductor's wrappers call the
    bindings too).  The binding picks its overload from the arguments given, so it is only used
    when no other overload of the op could take a call with this many positional arguments and
    these keywords."""
    if not isinstance(op, torch._ops.OpOverload) or op.namespace != "aten":
        return op
    packet = op.overloadpacket
    binding = (_in_place_method(op) if op._schema.is_mutable
               else getattr(torch._C._VariableFunctions, packet.__name__, None))
    if binding is None or not _could_bind(op._schema, n_positional, keywords):
        return op
    for name in packet.overloads():
        other = getattr(packet, name)
        if other is not op and _could_bind(other._schema, n_positional, keywords):
            return op
    return binding


# The allocation and reinterpretation helpers Inductor's wrappers use: C++ entry points that skip
# the dispatcher (~1 us instead of ~2.7 us per call, and a model makes hundreds of calls).
try:
    from torch._C._dynamo.guards import _empty_strided_cpu, _empty_strided_cuda, _reinterpret_tensor
except ImportError:              # older/odd builds: the public (slower) equivalents
    _empty_strided_cpu = _empty_strided_cuda = None
    _reinterpret_tensor = None


def _reinterpret(base: torch.Tensor, size, stride, offset: int) -> torch.Tensor:
    """A view of `base`'s storage with `size`/`stride`, `offset` elements past base's own offset."""
    return torch.as_strided(base, size, stride, base.storage_offset() + offset)


if _reinterpret_tensor is not None:
    _reinterpret = _reinterpret_tensor   # noqa: F811  (same signature and meaning)


@functools.lru_cache(maxsize=None)
def _placeholder(device: torch.device | None, dtype: torch.dtype) -> torch.Tensor:
    """A one-element tensor standing for a kernel argument the kernel never touches (a value
    held in registers): it gives Triton the argument's pointer type, and costs no allocation
    per call.  Never written, so one per device and dtype serves every graph."""
    return _allocator(device)((1,), (1,), dtype)


@functools.lru_cache(maxsize=None)
def _allocator(device: torch.device | None) -> Callable[..., torch.Tensor]:
    """`alloc(size, stride, dtype)` for `device` (None: the default device, as torch.empty_strided).
    The closures carry `_tf_reduce`, how a saved wrapper's constants pickle them: as this call."""
    alloc = _make_allocator(device)
    if not hasattr(alloc, "__self__"):          # (a torch builtin pickles by name)
        alloc._tf_reduce = (_allocator, (device,))  # type: ignore[attr-defined]
    return alloc


def _make_allocator(device: torch.device | None) -> Callable[..., torch.Tensor]:
    if device is None:
        return lambda size, stride, dtype: torch.empty_strided(size, stride, dtype=dtype)
    device = torch.device(device)
    if device.type == "cpu" and _empty_strided_cpu is not None:
        return _empty_strided_cpu
    if device.type == "cuda" and _empty_strided_cuda is not None:
        index = device.index if device.index is not None else torch.cuda.current_device()
        get_device = torch._C._cuda_getDevice      # the raw call: torch.cuda.current_device() costs ~3 us

        def alloc_cuda(size, stride, dtype, _index: int = index) -> torch.Tensor:
            # _empty_strided_cuda allocates on the *current* device
            if get_device() == _index:
                return _empty_strided_cuda(size, stride, dtype)
            return torch.empty_strided(size, stride, dtype=dtype, device=device)
        return alloc_cuda
    return lambda size, stride, dtype: torch.empty_strided(size, stride, dtype=dtype, device=device)


def _restride(t: torch.Tensor, size, stride) -> torch.Tensor:
    """A copy of `t` laid out with exactly `stride` (which kernels were generated for)."""
    expanded = [d for d, (sz, st) in enumerate(zip(size, stride)) if st == 0 and sz > 1]
    if not expanded:
        out = torch.empty_strided(size, stride, dtype=t.dtype, device=t.device)
        out.copy_(t)
        return out
    # An expanded (stride-0) layout: keep one copy of the repeated values and expand it again.
    src = t
    for d in expanded:
        src = src.narrow(d, 0, 1)
    compact = torch.empty_strided(src.shape, [1 if d in expanded else st for d, st in enumerate(stride)],
                                  dtype=t.dtype, device=t.device)
    compact.copy_(src)
    return compact.expand(size)


def make_callable(source: str, globals_: dict[str, Any], kernels: dict[str, Callable]) -> Callable:
    scope = dict(globals_)
    scope.update(kernels)
    scope["_restride"] = _restride
    scope["_profiling"] = torch._C._autograd._profiler_enabled
    scope["_record_function"] = torch.profiler.record_function
    scope["_reinterpret"] = _reinterpret
    exec(compile(source, "<torchfuse wrapper>", "exec"), scope)
    return scope["call"]
