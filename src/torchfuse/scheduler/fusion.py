"""The fusion scheduler: groups computed buffers into kernels, and says why when it refuses.

Vertical fusion of pointwise chains already happened in lowering (unrealized values compose).
Here, realized buffers that share a loop structure join one kernel:

  pointwise kernel  one loop nest over `outer`; every member is computed at each point.
  reduction kernel  a loop over `outer` (kept dims); inside it, stages in program order:
                    "reduce" members loop over `inner` (reduced dims) and accumulate,
                    "inner" members are pointwise over outer+inner (a softmax's output),
                    "outer" members are pointwise over outer alone (a layer norm's rstd).

A member may read another member of its kernel only at the same outer point (and, inside one
loop, the same inner point), so every kernel is a correct parallel loop over `outer`.

A scatter runs alone, except for a prologue: the pointwise kernel over its own loops whose values
it reads at the point it updates from (a GAT's per-edge score, stored because several scatters
read it, and the scatter amax over it) computes them in the scatter's loop (`_scatter_prologue`).

A buffer whose loops are a reshape of the kernel's (attention's [B*H, S, S] scores around a
softmax over [B, H, S] x [S]) still joins it: the kernel is re-tiled over the common refinement
of both shapes and every member's index vars are rewritten into its loop vars (tiling.py).  An
element-wise epilogue whose loops are a permutation of a row reduction's (a layer norm over a
permuted view, permuted back) joins it in the kernel's loop order (`_permuted_fits`).
"""
from __future__ import annotations

import functools
import itertools
import logging
import math
from dataclasses import dataclass, field
from typing import Iterator

from ..config import Config
from ..ir.buffers import AliasView, BufferRef, ComputedBuffer, FallbackCall, LoweredGraph
from ..ir.nodes import Node, const, loads, to_text, var, walk
from .collectives import PendingWaits
from .tiling import dim_exprs, kernel_ranges, refine, rewrite, step_of

log = logging.getLogger("torchfuse.fusion")


@dataclass
class Member:
    buffer: ComputedBuffer
    role: str                 # "pointwise" | "reduce" | "inner" | "outer"
    body: Node                # body with kernel vars x0.. (outer) and y0.. (inner)
    store: Node               # store index in kernel vars


@dataclass
class Kernel:
    name: str
    outer: tuple[Node, ...]
    inner: tuple[Node, ...]
    members: list[Member] = field(default_factory=list)
    # (symbol, Python expression) the wrapper evaluates before this kernel (a split factor that
    # depends on run-time sizes)
    bindings: list[tuple[str, str]] = field(default_factory=list)

    @property
    def kind(self) -> str:
        return "reduction" if any(m.role == "reduce" for m in self.members) else "pointwise"

    @property
    def origins(self) -> list[str]:
        return [o for m in self.members for o in m.buffer.origins]

    @property
    def scatter(self) -> ComputedBuffer | None:
        """The scatter this kernel runs (a kernel of its own: its stores go anywhere in its
        output, so nothing may read that output in the same kernel), or None."""
        return next((m.buffer for m in self.members if m.buffer.scatter is not None), None)

    def __str__(self) -> str:
        outer = ", ".join(map(to_text, self.outer))
        inner = ", ".join(map(to_text, self.inner))
        lines = [f"{self.name} ({self.kind}): outer=[{outer}] inner=[{inner}]"]
        for m in self.members:
            lines.append(f"  {m.role:9s} {m.buffer.name}[{to_text(m.store)}] = "
                         f"{(m.buffer.reduction_op + ' ') if m.buffer.reduction_op else ''}{to_text(m.body)}")
        return "\n".join(lines)


@dataclass
class Schedule:
    items: list[Kernel | FallbackCall | AliasView]
    refused: list[str]

    @property
    def kernels(self) -> list[Kernel]:
        return [k for k in self.items if isinstance(k, Kernel)]

    def __str__(self) -> str:
        out = [str(i) if isinstance(i, Kernel) else f"ATen: {i}" for i in self.items]
        if self.refused:
            out.append("refused fusions:")
            out += [f"  {r}" for r in self.refused]
        return "\n".join(out)


def squeeze(sizes: tuple[Node, ...]) -> tuple[Node, ...]:
    """Loop sizes without the size-1 dims, which never change an index."""
    return tuple(s for s in sizes if not (s.op == "const" and s.arg == 1))


def _buffer_vars(buf: ComputedBuffer) -> tuple[list[Node], dict[Node, Node]]:
    """The vars of `buf`'s dims that are not size 1 (rows, then reduced), and 0 for the others,
    which never change an index."""
    used: list[Node] = []
    zeros: dict[Node, Node] = {}
    for prefix, sizes in (("i", buf.ranges), ("r", buf.reduction_ranges)):
        for k, size in enumerate(sizes):
            if size.op == "const" and size.arg == 1:
                zeros[var(f"{prefix}{k}")] = const(0)
            else:
                used.append(var(f"{prefix}{k}"))
    return used, zeros


@dataclass
class _Fit:
    """Where a buffer goes in a kernel: its role, the kernel's loops afterwards (a refinement of
    the old ones when the buffer's space is a reshape of them) and the substitutions that put the
    old members and the buffer into those loops."""
    role: str
    outer: tuple[Node, ...]
    inner: tuple[Node, ...]
    kernel_map: dict[Node, Node]     # the kernel's old x*/y* -> new kernel vars ({} if unchanged)
    buf_map: dict[Node, Node]        # the buffer's i*/r* -> kernel vars
    # a placement in permuted loops: the loops its store must be contiguous along (those the
    # kernel reads along), else it would be written across memory
    write_along: frozenset[str] = frozenset()


def _fit(role: str, kernel_dims: tuple[Node, ...], kernel_outer: int, buf: ComputedBuffer,
         buf_dims: tuple[Node, ...], nb_of: str, extra_inner: tuple[Node, ...] = ()) -> _Fit | None:
    """Refine the kernel's dims (x*, then y* from `kernel_outer` on) against the buffer's dims;
    the new inner loops start where `nb_of` ("kernel", "buffer", "all") puts the rows|reduced
    boundary.  `extra_inner` are kernel inner dims the buffer does not span (an "outer" member),
    kept as they are.  None when the spaces are not reshapes of each other, or their row
    boundaries fall at different refined dims (a row of one would be several rows of the other)."""
    ref = refine(kernel_dims, buf_dims)
    if ref is None:
        return None
    rows = sum(1 for s in buf.ranges if not (s.op == "const" and s.arg == 1))
    kb, bb = ref.boundary(ref.a, kernel_outer), ref.boundary(ref.b, rows)
    nb = {"kernel": kb, "buffer": bb, "all": len(ref.sizes)}[nb_of]
    if buf.is_reduction and nb != bb:
        return None
    sizes = ref.sizes + extra_inner
    old = [var(f"x{k}") for k in range(kernel_outer)] + \
          [var(f"y{k}") for k in range(len(kernel_dims) - kernel_outer + len(extra_inner))]
    new = dim_exprs(ref.sizes, ref.a, nb) + [var(f"y{len(ref.sizes) - nb + j}") for j in range(len(extra_inner))]
    kernel_map = {o: e for o, e in zip(old, new) if o != e}
    used, buf_map = _buffer_vars(buf)
    buf_map.update(zip(used, dim_exprs(ref.sizes, ref.b, nb)))
    return _Fit(role, sizes[:nb], sizes[nb:], kernel_map, buf_map)


def _role(kernel: Kernel, buf: ComputedBuffer) -> _Fit | str:
    """How `buf` would sit in `kernel`'s loops, or the reason it cannot.  Loops match when they
    are equal or reshapes of each other (tiling.py); the kernel is then re-tiled over both."""
    rows, red = squeeze(buf.ranges), squeeze(buf.reduction_ranges)
    n = len(kernel.outer)
    if buf.is_reduction:
        if kernel.inner == () and kernel.kind == "pointwise":
            # the pointwise kernel becomes this reduction's prologue, re-tiled as rows x reduced
            fit = _fit("reduce", kernel.outer, n, buf, rows + red, "buffer")
            return fit or f"reduction over [{_fmt(buf.reduction_ranges)}] of [{_fmt(buf.ranges)}] " \
                          f"does not tile pointwise loops [{_fmt(kernel.outer)}], even as a reshape"
        fit = _fit("reduce", kernel.outer + kernel.inner, n, buf, rows + red, "kernel")
        return fit or f"reduction loops [{_fmt(buf.ranges)}]x[{_fmt(buf.reduction_ranges)}] differ from " \
                      f"[{_fmt(kernel.outer)}]x[{_fmt(kernel.inner)}], even as a reshape with the same rows"
    if kernel.inner == ():
        fit = _fit("pointwise", kernel.outer, n, buf, rows, "all")
        return fit or f"iteration space [{_fmt(buf.ranges)}] differs from [{_fmt(kernel.outer)}], even as a reshape"
    fit = _fit("inner", kernel.outer + kernel.inner, n, buf, rows, "kernel") or \
        _fit("outer", kernel.outer, n, buf, rows, "all", kernel.inner)
    return fit or f"iteration space [{_fmt(buf.ranges)}] matches neither rows [{_fmt(kernel.outer)}] nor " \
                  f"rows x reduced [{_fmt(kernel.outer + kernel.inner)}], even as a reshape"


# Dims up to which a permuted placement is searched (each permutation is tried in turn).
_PERMUTE_DIMS = 6


def _permuted_fits(kernel: Kernel, buf: ComputedBuffer) -> Iterator[_Fit]:
    """Placements of an element-wise `buf` as an "inner" member of a reduction kernel whose
    rows x reduced loops are a permutation of `buf`'s loops: `buf` then runs in the kernel's
    order, each of its dims on the kernel loop of the same size (every order that matches the
    sizes, for the reads to decide between equal sizes).  A layer norm over a permuted view
    (ConvNeXt's LayerNorm2d: permute to [N, H, W, C], normalize over C, permute back to
    [N, C, H, W]) has its normalized output in [N, C, H, W] order after rows [N, H, W] x [C]:
    placed so, the output is computed from the row's statistics in the same kernel, where a
    kernel of its own read the row back (and its input, stored for it, was written across the
    row: 0.34 + 0.10 ms per call at [64, 96, 56, 56] bf16 on an H100, where Inductor takes 0.05)."""
    rows = squeeze(buf.ranges)
    dims = kernel.outer + kernel.inner
    if buf.is_reduction or not kernel.inner or len(rows) != len(dims) or len(dims) > _PERMUTE_DIMS:
        return
    # Only an epilogue of the kernel's results: a buffer that merely shares inputs with it would
    # tie its loops to the kernel's (a layer norm's input gradient, [N, C, H, W], put into its
    # weight gradient's column sums over [C] x [N, H, W], which then cannot be split: it belongs
    # with the row sums over [N, H, W] x [C] that it reads)
    members = {m.buffer.name for m in kernel.members}
    if not any(ld.arg in members for ld in loads(buf.body)):
        return
    # ... and of a kernel reading along its rows: over a column sum's loops ([C] x [N*H*W] of a
    # channels-last map, x * x.sum(0)) an element-wise member would be walked across memory
    along = set().union(*(_contiguous_along(m) for m in kernel.members if m.role == "reduce"))
    if not any(v.startswith("y") for v in along):
        return
    used, zeros = _buffer_vars(buf)
    loop_vars = [var(f"x{k}") for k in range(len(kernel.outer))] + [var(f"y{k}") for k in range(len(kernel.inner))]
    for order in itertools.permutations(range(len(dims))):
        if all(rows[k] == dims[order[k]] for k in range(len(rows))):
            buf_map = dict(zeros)
            buf_map.update({used[k]: loop_vars[order[k]] for k in range(len(rows))})
            yield _Fit("inner", kernel.outer, kernel.inner, {}, buf_map, frozenset(along))


def _fmt(sizes: tuple[Node, ...]) -> str:
    return ", ".join(map(to_text, sizes))


def _place(kernel: Kernel, buf: ComputedBuffer, fit: _Fit) -> tuple[Kernel, Member]:
    """The kernel re-tiled to `fit`'s loops (a new Kernel, so a refusal leaves the old one as it
    was) and `buf` as a member of it."""
    ranges = kernel_ranges(fit.outer + fit.inner, len(fit.outer))
    new = kernel
    if fit.kernel_map or (fit.outer, fit.inner) != (kernel.outer, kernel.inner):
        new = Kernel(kernel.name, fit.outer, fit.inner, bindings=list(kernel.bindings))
        # a pointwise kernel that becomes a reduction's prologue runs per element of each row
        prologue = kernel.kind == "pointwise" and fit.role == "reduce" and fit.inner != ()
        for m in kernel.members:
            body, store = (rewrite(e, fit.kernel_map, ranges) for e in (m.body, m.store))
            new.members.append(Member(m.buffer, "inner" if prologue else m.role, body, store))
    member = Member(buf, fit.role, rewrite(buf.body, fit.buf_map, ranges),
                    rewrite(buf.store_index(), fit.buf_map, ranges))
    return new, member


def _reads_ok(kernel: Kernel, member: Member) -> str:
    """Empty if every read of a kernel member by `member` is at the point that member wrote."""
    written = {m.buffer.name: m for m in kernel.members}
    for ld in loads(member.body):
        producer = written.get(ld.arg)
        if producer is None:
            continue
        if ld.args[0] != producer.store:
            return f"reads {ld.arg} at [{to_text(ld.args[0])}] but it is written at [{to_text(producer.store)}]"
        if member.role == "outer" and producer.role in ("inner", "pointwise"):
            return f"a per-row value cannot read the per-element {ld.arg}"
        if member.role == "reduce" and producer.role == "reduce" and producer.buffer is member.buffer:
            return "self reference"
    return ""


# How many kernels back a buffer that does not fit the open kernel may look for one it fits.
LOOK_BACK = 3
# a buffer at least this large does not join a kernel before an ATen call that allocates
# (_join_earlier): the memory it would hold across the call outweighs the launch saved
EARLY_ALLOCATION_BYTES = 1 << 20


def _nbytes(step: ComputedBuffer) -> int:
    """The buffer's size in bytes, a symbolic size counted as 1 (a lower bound: the shape-generic
    graphs of `torchfuse.lazy` keep their small buffers' fusions)."""
    n = step.dtype.itemsize
    for size in step.layout.sizes:
        if size.op == "const" and isinstance(size.arg, int):
            n *= size.arg
    return n


def _defines(item: Kernel | FallbackCall | AliasView) -> set[str]:
    if isinstance(item, Kernel):
        return {m.buffer.name for m in item.members}
    if isinstance(item, FallbackCall):
        return {o for o in item.outputs if o}
    return {item.name}


@functools.lru_cache(maxsize=1 << 14)
def _unit_vars(index: Node) -> frozenset[str]:
    """The loop vars that move `index` by one element (remembered: every candidate kernel asks
    again about the same members)."""
    return frozenset(n.arg for n in walk(index) if n.op == "var" and abs(step_of(index, n.arg)) == 1)


def _contiguous_along(member: Member) -> set[str]:
    """The loops along which a member's memory is contiguous: where an element-wise member
    writes, where a reduction reads (a per-row store or value says nothing about that)."""
    if member.role in ("pointwise", "inner"):
        return _unit_vars(member.store)
    if member.role == "reduce":
        # the loads that span every loop of the member: a broadcast operand (a norm's weight
        # [hidden] read by a column sum over [tokens, hidden]) is small and says nothing
        indices = [ld.args[0] for ld in loads(member.body)]
        spans = [_vars_of(i) for i in indices]
        every = set().union(*spans)
        return set().union(*(_unit_vars(i) for i, v in zip(indices, spans) if v == every))
    return set()


def _vars_of(index: Node) -> set[str]:
    return {n.arg for n in walk(index) if n.op == "var"}


def _keeps_contiguity(candidate: Kernel, member: Member) -> str:
    """Empty, or why the kernel's loops cannot serve `member` and its members at once: their
    memory is contiguous along different loops, so one of them would be walked with a stride,
    and `member` shares no data with them, so one kernel would save no byte.
    - A reduction fixes which loop is fast (along rows for a column sum, along the row for a row
      sum); two buffers of equal size but different layouts tile each other only with the
      contiguous dim of one split across rows and reduced dims (a channels-last [N, 256, 28, 28]
      against a [1024 channels] x [N*14*14] sum): a ResNet-50 backward spent 4.5 ms of 28 in two
      such kernels.  Sharing is reading an element the kernel reads or writes: reading one layout
      and writing another is then the computation itself (a softmax over a transposed view).
    - A pointwise kernel walks all its stores in one order: a Llama MLP's backward wrote the SiLU
      gradient once by rows and, for the weight gradient's transposed operand, twice by columns,
      in one kernel (0.30 ms per call on 2 CPU cores, where separate kernels vectorize).  Sharing
      is reading what the kernel writes, or an element one of its members loads."""
    mine = _contiguous_along(member)
    theirs = set().union(*(_contiguous_along(m) for m in candidate.members))
    if not mine or not theirs or mine & theirs:
        return ""
    written = {m.buffer.name for m in candidate.members}
    their_loads = [ld for m in candidate.members for ld in loads(m.body)]
    if candidate.kind == "reduction" or member.role == "reduce":
        # sharing is reading the same element of a buffer the kernel writes or reads.  Reading
        # one contiguous along a common loop is not enough: Swin's patch-embedding layer-norm
        # input gradient, re-tiled into its weight gradient's column sums, read the input it
        # shared at other elements, and its own operands and NCHW store with a stride of 96.
        # A transposed read shares no cache line per step (an RMSNorm backward's row sums of
        # g*w*x and the weight gradient's column sums of g*x_hat, [tokens, hidden] with
        # tokens == hidden, read the same g and x across each other: one kernel gathered every
        # load of both and vectorized neither)
        # Only reads of the member's whole space count: a per-row statistic or a per-channel
        # weight both read (a layer norm backward's rstd) is small, whatever order it is read in
        # (ConvNeXt's layer-norm input gradient, channels-last, was re-tiled into its weight
        # gradient's column sums, 1.15 ms per call where a kernel of its own takes 0.08).
        seen: dict[str, list[Node]] = {}
        for m in candidate.members:
            seen.setdefault(m.buffer.name, []).append(m.store)
        for ld in their_loads:
            seen.setdefault(ld.arg, []).append(ld.args[0])
        whole = _vars_of(member.store) if member.role != "reduce" else \
            set().union(*(_vars_of(ld.args[0]) for ld in loads(member.body)))
        for ld in loads(member.body):
            if not whole <= _vars_of(ld.args[0]):
                continue
            if ld.args[0] in seen.get(ld.arg, ()):
                return ""
        return (f"{member.buffer.name} is contiguous along loops {sorted(mine)}, the kernel's members along "
                f"{sorted(theirs)}: one of them would be read and written uncoalesced")
    same = {(ld.arg, ld.args[0]) for ld in their_loads}
    if any(ld.arg in written or (ld.arg, ld.args[0]) in same for ld in loads(member.body)):
        return ""
    return (f"{member.buffer.name} is written contiguously along loops {sorted(mine)}, the kernel's members "
            f"along {sorted(theirs)}, and they share no element: one would be walked with a stride")


def _try_join(kernel: Kernel, step: ComputedBuffer) -> tuple[Kernel | None, str]:
    """`kernel` with `step` fused in (a new Kernel), or None and the reason it cannot be."""
    if kernel.scatter is not None or step.scatter is not None:
        return None, "a scatter runs alone: its output is complete only when its kernel ends"
    first = _role(kernel, step)
    reason = first if isinstance(first, str) else ""
    # a reshape placement first; where it fails, the loops in another order (a generator: only
    # searched when reached)
    for fit in itertools.chain(() if reason else (first,), _permuted_fits(kernel, step)):
        candidate, member = _place(kernel, step, fit)
        refused = _reads_ok(candidate, member) or _keeps_contiguity(candidate, member)
        if not refused and fit.write_along and not _unit_vars(member.store) & fit.write_along:
            refused = f"in the kernel's loops, reordered, {step.name} would be written across memory"
        if not refused:
            candidate.members.append(member)
            return candidate, ""
        reason = reason or refused
    return None, reason


def _scatter_prologue(kernel: Kernel, step: ComputedBuffer) -> tuple[Member | None, str]:
    """The scatter `step` as the last member of the open pointwise `kernel`, whose values it reads
    at the point it updates from (a GAT's per-edge score, stored for its other readers, and the
    scatter amax over it: one loop over the edges, as Inductor's), or (None, why not; "" where it
    reads none of them).  The kernel closes after it: nothing may read a scatter's output in the
    loop that updates it, nor may the loop write or read the buffer it updates."""
    written = {m.buffer.name for m in kernel.members}
    reads = [ld for ld in loads(step.body) + loads(step.store_index()) if ld.arg in written]
    if kernel.scatter is not None:      # (a scatter's output is complete after its loop)
        return None, ""
    if kernel.kind != "pointwise" or kernel.inner or kernel.outer != squeeze(step.ranges):
        if not reads:
            return None, ""
        return None, (f"a scatter takes as its prologue only a pointwise kernel over its own domain "
                      f"[{_fmt(squeeze(step.ranges))}], not [{_fmt(kernel.outer + kernel.inner)}]")
    if step.into in written or any(ld.arg == step.into for m in kernel.members for ld in loads(m.body)):
        return None, f"the kernel writes or reads {step.into}, which the scatter updates"
    _, member = _place(kernel, step, _fit("pointwise", kernel.outer, len(kernel.outer), step, kernel.outer,
                                          "kernel"))
    stores = {m.buffer.name: m.store for m in kernel.members}
    for ld in loads(member.body) + loads(member.store):
        if ld.arg in stores and ld.args[0] != stores[ld.arg]:
            return None, f"reads {ld.arg} at [{to_text(ld.args[0])}] but it is written at [{to_text(stores[ld.arg])}]"
    return member, ""


# Fewest rows (when static) of a reduction that takes a scatter in: a kernel with a scatter is
# never split into partials (scheduler/split.py), and a few long rows must stay splittable (a
# GPU splits below 2 x its SMs' rows: 264 on an H200; symbolic row counts are never split).
SCATTER_HOST_MIN_ROWS = 512


def _scatter_in_reduction(kernel: Kernel, step: ComputedBuffer) -> Member | None:
    """The scatter `step` as a per-element member of the reduction `kernel`, when its domain is
    the kernel's rows x reduced loops and it loads what a reduction of the kernel loads (a GAT
    backward's attention gradient, the row sums of grad[dst] * x[src], and its message gradient,
    grad[dst] * alpha added into the nodes at src: one pass over the gathered rows, as Inductor's
    persistent reduction, where two kernels gathered them twice).  None where it reads a
    per-row value of the kernel (complete only after the row's loop), the buffer it updates is
    the kernel's, or the two share no load (nothing to gain: the atomics would only slow the
    reduction down).  Only for backends whose reduction kernels can update (Features.
    scatter_in_reductions)."""
    if kernel.kind != "reduction" or kernel.scatter is not None or not kernel.inner:
        return None
    if all(s.op == "const" for s in kernel.outer) and math.prod(s.arg for s in kernel.outer) < SCATTER_HOST_MIN_ROWS:
        return None
    fit = _fit("inner", kernel.outer + kernel.inner, len(kernel.outer), step, squeeze(step.ranges), "kernel")
    if fit is None or fit.kernel_map or (fit.outer, fit.inner) != (kernel.outer, kernel.inner):
        return None
    if any(m.buffer.name == step.into or any(ld.arg == step.into for ld in loads(m.body)) for m in kernel.members):
        return None
    _, member = _place(kernel, step, fit)
    producers = {m.buffer.name: m for m in kernel.members}
    for ld in loads(member.body) + loads(member.store):
        producer = producers.get(ld.arg)
        if producer is not None and (producer.role != "inner" or ld.args[0] != producer.store):
            return None
    shared = {(ld.arg, ld.args[0]) for m in kernel.members if m.role == "reduce" for ld in loads(m.body)}
    if not any((ld.arg, ld.args[0]) in shared for ld in loads(member.body)):
        return None
    return member


def _join_earlier(items: list, current: Kernel | None, step: ComputedBuffer, config: Config) -> bool:
    """Fuse `step` into one of the last LOOK_BACK kernels if it fits there and reads nothing made
    after it (`current`, the open kernel, comes after all `items`).  Moving a buffer earlier is
    safe: everything after that kernel precedes `step` in program order, so nothing there reads
    it.  (A layer norm backward's input gradient joins the row sums it needs, past the kernel of
    its weight gradient's column sums that came between.)

    A large buffer that reads nothing of a kernel does not join it past an ATen call that
    returns a tensor: it would then be allocated before that call's output and live beside it,
    to save one launch.  GIN's next-layer scatter accumulator (zeros, 100 MB) joined the
    activation kernel before the layer's matmul, and at the matmul three activation-sized
    buffers were alive where two suffice (+15% peak memory).  A step that reads the kernel's
    values still joins it: that saves reading them again."""
    reads = {ld.arg for ld in loads(step.body)}
    later = _defines(current) if current is not None else set()
    seen = 1 if current is not None else 0
    large = _nbytes(step) >= EARLY_ALLOCATION_BYTES
    crossed = False               # past an ATen call that allocates its output
    for pos in range(len(items) - 1, -1, -1):
        item = items[pos]
        if isinstance(item, FallbackCall):
            if item.binds:
                return False      # sizes known only after that call
            crossed = crossed or any(o is not None for o in item.outputs)
        if isinstance(item, Kernel):
            if seen == LOOK_BACK:
                return False
            seen += 1
            if large and crossed and not reads & _defines(item):
                log.debug("%s not joined to %s before an ATen call: its %d bytes would be alive across the call",
                          step.name, item.name, _nbytes(step))
            elif not reads & later and len(item.members) < config.max_fusion_size:
                joined, _ = _try_join(item, step)
                if joined is not None:
                    items[pos] = joined
                    return True
        later |= _defines(item)
    return False


def schedule(program: LoweredGraph, config: Config, *, scatter_in_reductions: bool = False) -> Schedule:
    """The lowered program's steps grouped into kernels, in one pass (a step joins the open
    kernel, or one of the last few, or opens its own), with the reason for every refused fusion.
    `scatter_in_reductions`: the backend's reduction kernels may run a scatter as a per-element
    member (Features.scatter_in_reductions)."""
    items: list[Kernel | FallbackCall | AliasView] = []
    refused: list[str] = []
    current: Kernel | None = None
    count = 0

    def close() -> None:
        nonlocal current
        if current is not None:
            items.append(current)
            current = None

    # A collective's wait is emitted only when a step reads its result, right before the kernel
    # that step joins: kernels not reading it overlap the communication, and the wait never
    # splits a fusion group (scheduler/overlap.py)
    waits = PendingWaits()
    for step in program.steps:
        if waits.hold(step):
            continue
        needed = waits.needed_by(step)
        if needed:
            if (isinstance(step, ComputedBuffer) and step.scatter is None and current is not None and config.fuse
                    and len(current.members) < config.max_fusion_size):
                joined, _ = _try_join(current, step)
                if joined is not None:
                    items.extend(needed)       # (before `current`, which is appended when closed)
                    current = joined
                    continue
            close()
            items.extend(needed)
        if not isinstance(step, ComputedBuffer):
            close()
            items.append(step)
            continue
        if step.stored_because:
            refused.append(f"{step.name} ({', '.join(step.origins)}) not inlined into its readers: "
                           f"{step.stored_because}")
        if step.scatter is not None:
            if current is not None and config.fuse and len(current.members) < config.max_fusion_size:
                target = current
                # the kernel before the open one, when the open one does not depend on it (it
                # initialises the scatter's output): the open one may then run first
                before = items[-1] if items and isinstance(items[-1], Kernel) and \
                    not _defines(items[-1]) & {ld.arg for m in current.members for ld in loads(m.body)} else None
                member, reason = _scatter_prologue(current, step)
                if member is None and not reason and before is not None:
                    # what it reads is the kernel's before
                    target = before
                    member, reason = _scatter_prologue(target, step)
                    if member is not None:
                        items[-1], current = current, target
                if member is None and scatter_in_reductions:
                    # a reduction over the scatter's domain, the open kernel or the one before it
                    for host in [current] + ([before] if before is not None else []):
                        member = _scatter_in_reduction(host, step)
                        if member is not None:
                            if host is not current:
                                items[-1], current = current, host
                            break
                if member is not None:
                    current.members.append(member)
                    close()
                    continue
                if reason:
                    refused.append(f"{step.name} ({', '.join(step.origins)}) not fused into {target.name} "
                                   f"({', '.join(target.origins)}): {reason}")
            close()
            current = Kernel(f"kernel{count}", squeeze(step.ranges), ())
            count += 1
            _, member = _place(current, step, _fit("pointwise", current.outer, len(current.outer), step,
                                                   current.outer, "kernel"))
            current.members.append(member)
            close()
            continue
        if current is None and config.fuse and _join_earlier(items, None, step, config):
            continue
        if current is not None and config.fuse and len(current.members) < config.max_fusion_size:
            joined, reason = _try_join(current, step)
            if joined is not None:
                current = joined
                continue
            if _join_earlier(items, current, step, config):
                continue
            refused.append(f"{step.name} ({', '.join(step.origins)}) not fused into {current.name} "
                           f"({', '.join(current.origins)}): {reason}")
            log.debug(refused[-1])
        elif current is not None:
            refused.append(f"{step.name} not fused into {current.name}: "
                           + ("fusion disabled" if not config.fuse else "kernel size limit"))
        close()
        current = Kernel(f"kernel{count}", squeeze(step.ranges), squeeze(step.reduction_ranges))
        count += 1
        _, member = _place(current, step, _fit("reduce" if step.is_reduction else "pointwise",
                                               current.outer + current.inner, len(current.outer), step,
                                               current.outer + current.inner, "kernel"))
        current.members.append(member)
    close()
    items.extend(waits.rest())
    return Schedule(items, refused)


def buffer_readers(sched: Schedule, program: LoweredGraph) -> dict[str, set[str]]:
    """For each buffer, who reads it: kernel names, "aten" for fallbacks/views, "output"."""
    readers: dict[str, set[str]] = {}
    for item in sched.items:
        if isinstance(item, Kernel):
            for m in item.members:
                for ld in loads(m.body) + loads(m.store):
                    readers.setdefault(ld.arg, set()).add(item.name)
                if m.buffer.into is not None:        # updated in place: stored before
                    readers.setdefault(m.buffer.into, set()).add(item.name)
        elif isinstance(item, FallbackCall):
            def visit(a):
                if isinstance(a, BufferRef):
                    readers.setdefault(a.buffer, set()).add("aten")
                elif isinstance(a, (list, tuple)):
                    for x in a:
                        visit(x)
            visit(item.args)
            visit(list(item.kwargs.values()))
        elif isinstance(item, AliasView):
            for name in (item.base, *item.after):     # (a cat's parts: stored, never in registers)
                readers.setdefault(name, set()).add("aten")
    for o in program.outputs:
        if isinstance(o, str):
            readers.setdefault(o, set()).add("output")
    return readers
