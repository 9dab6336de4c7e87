"""Triton code generation: the same fused kernels (LoopPlan) as Triton JIT functions.

Pointwise kernels are flat 1-D blocks over the merged loop nest, or 2-D [YBLOCK, XBLOCK] tiles
(`<name>_tiled`) when an input is contiguous along another dim than the output (transposes) or
when a scatter writes rows whose index is read once per row (`scatter_tile`).
A reduction whose input is contiguous across rows (column sums) is flagged (`rows_contiguous`)
so the launcher gives its looped variant several rows per tile.  Reduction kernels are 2-D
tiles [XBLOCK rows, RBLOCK reduced elements] and come in two variants in one module:
  persistent  the whole row is one tile: every stage reads the row from registers, so a softmax
              or layer norm loads its input exactly once;
  looped      rows longer than the persistent limit are walked in RBLOCK chunks per stage.
The wrapper picks the variant and block sizes at run time from the actual sizes, so kernels are
shape-generic.  fp16/bf16 are computed in fp32.
"""
from __future__ import annotations

import functools
import logging
from typing import NamedTuple, Sequence

import torch

from ...ir.buffers import split_guarded
from ...ir.nodes import Node, free_syms, load, loads, walk
from ...scheduler.loops import LoopPlan, rows_contiguous
from ...scheduler.tiling import stride_of
from ...codegen.checks import check_sites
from .emitter import TritonEmitter
from .lang import STORE_TL, TL, to_storage
from .launch import ROW_TILE_XBLOCK

log = logging.getLogger("torchfuse.triton")


def _unflatten(em: TritonEmitter, flat: str, sizes: tuple[Node, ...], prefix: str) -> None:
    """Derive per-dim vars (x0, x1, ...) from a flat index, innermost fastest."""
    stride = None
    for k in range(len(sizes) - 1, -1, -1):
        base = flat if stride is None else f"({flat} // ({stride}))"
        em.line(f"{prefix}{k} = {base}" + (f" % ({em.index(sizes[k])})" if k > 0 else ""))
        stride = em.index(sizes[k]) if stride is None else f"{stride} * {em.index(sizes[k])}"


_RED = {"sum": ("tl.sum", "0"), "prod": (None, "1"), "max": ("tl.max", "-1e999"), "min": ("tl.min", "1e999"),
        "any": ("tl.max", "0"), "all": ("tl.min", "1")}


def _init(op: str, dtype: torch.dtype) -> str:
    if op in ("max", "argmax"):
        return "-1e999" if dtype.is_floating_point else str(torch.iinfo(dtype).min if dtype != torch.bool else 0)
    if op in ("min", "argmin"):
        return "1e999" if dtype.is_floating_point else str(torch.iinfo(dtype).max if dtype != torch.bool else 1)
    return _RED[op][1]


def _init_value(op: str, dtype: torch.dtype) -> str:
    """The reduction's identity as a typed value (what masked-off lanes contribute)."""
    return f"tl.full([1], {_init(op, dtype)}, {TL[dtype]})"


def kernel_source(plan: LoopPlan, dtypes: dict[str, torch.dtype],
                  checks: list | None = None, run_checks: bool = True) -> tuple[str, list[str], list[str]]:
    """Triton source for one kernel; returns (source, buffer args, symbol args).  `checks`, a
    list, gets the kernel's run-time check sites (codegen/checks.py): a kernel with any takes
    `tf_err` (int64 slots, one a site) after its buffers, where a failing check stores its value
    (none without `run_checks`: Config.runtime_checks)."""
    kernel = plan.kernel
    produced = {m.buffer.name for m in plan.members}
    written = [m.buffer.into or m.buffer.name for m in plan.members if m.buffer.name in plan.stored]
    read, syms = [], set()
    for m in plan.members:
        for n in list(walk(m.body)) + list(walk(m.store)):
            if n.op == "load" and n.arg not in read and n.arg not in produced:
                read.append(n.arg)
            if n.op == "sym":
                syms.add(n.arg)
    for s in plan.outer + plan.inner:
        syms |= free_syms(s)
    syms_list = sorted(syms)
    ranges = {f"x{j}": s for j, s in enumerate(plan.outer)} | {f"y{j}": s for j, s in enumerate(plan.inner)}
    sites = check_sites([n for m in plan.members for n in list(walk(m.body)) + list(walk(m.store))], ranges,
                        run_checks)
    if checks is not None:
        checks.extend(desc + (node.args[1] if node.op == "check_index" else None,) for node, desc in sites)
    err = ["tf_err"] if sites else []
    TritonEmitter = functools.partial(_CheckingEmitter, {node: k for k, (node, _) in enumerate(sites)}, ranges)
    params = ", ".join(read + written + err + syms_list + ["xnumel", "rnumel", "XBLOCK: tl.constexpr",
                                                            "RBLOCK: tl.constexpr", "BIG: tl.constexpr"])
    out: list[str] = []
    tile = tile_dims(plan)
    numels = {"xnumel": plan.outer, "rnumel": plan.inner}
    if tile is not None:
        numels = {"xnumel": [plan.outer[k] for k in tile.xs], "ynumel": [plan.outer[tile.y]]}
    jit = _jit(syms_list, numels)
    if tile is not None:
        params = ", ".join(read + written + err + syms_list + ["xnumel", "ynumel", "XBLOCK: tl.constexpr",
                                                                "YBLOCK: tl.constexpr", "BIG: tl.constexpr"])
        em = TritonEmitter(dtypes)
        _static_numels(em, **numels)
        _emit_tile_indices(em, plan, tile)
        em.mask = "xmask"
        _emit_values(em, plan, plan.members, "xmask")
        out.append(f"{jit}\ndef {kernel.name}_tiled({params}):\n" + "\n".join(em.lines))
    elif kernel.kind == "pointwise":
        em = TritonEmitter(dtypes)
        _static_numels(em, xnumel=plan.outer)
        em.line("pid = tl.program_id(0)")
        em.line("if BIG:   # 64-bit offsets only when some offset can pass 2**31")
        em.line("    pid = pid.to(tl.int64)")
        em.line("xindex = pid * XBLOCK + tl.arange(0, XBLOCK)")
        _emit_mask(em, "xmask", "xindex", "xnumel", "XBLOCK", "[XBLOCK]")
        em.line("xzero = tl.zeros_like(xindex)   # gives scalar addresses the block's shape")
        _unflatten(em, "xindex", plan.outer, "x")
        em.mask = "xmask"
        _emit_values(em, plan, plan.members, "xmask")
        out.append(f"{jit}\ndef {kernel.name}({params}):\n" + "\n".join(em.lines))
    else:
        columns = rows_contiguous(plan)
        for persistent in (True, False):
            em = TritonEmitter(dtypes)
            if persistent:     # the row stays in registers: values carried between loops need no store
                em.unstored = set(plan.carried)
            if kernel.scatter is not None:
                em.reduced_vars = frozenset(f"y{j}" for j in range(len(plan.inner)))
            # masked column tiles measured faster (bf16 [8192, 2304] sum(0): 12.1 vs 14.6 us
            # unmasked; probes/long_rows.py --only masks)
            em.drop_masks = not columns
            _static_numels(em, **numels)
            em.line("pid = tl.program_id(0)")
            em.line("if BIG:")
            em.line("    pid = pid.to(tl.int64)")
            em.line("xindex = pid * XBLOCK + tl.arange(0, XBLOCK)[:, None]")
            _emit_mask(em, "xmask", "xindex", "xnumel", "XBLOCK", "[XBLOCK, 1]")
            em.line("rbase = tl.arange(0, RBLOCK)[None, :]")
            em.line("xzero = tl.zeros_like(xindex)")
            _unflatten(em, "xindex", plan.outer, "x")
            _emit_reduction_body(em, plan, persistent)
            suffix = "_persistent" if persistent else "_looped"
            out.append(f"{jit}\ndef {kernel.name}{suffix}({params}):\n" + "\n".join(em.lines))
    if plan.kernel.scatter is not None or set(read) & set(written):
        # an atomic update or an in-place write gives another result when run again: never
        # timed by the autotuner (launch._tuning), which runs each candidate many times
        out.append("\n".join(f"{kernel.name}{v}._tf_no_tune = True"
                             for v in (("_tiled",) if tile is not None else ("",) if kernel.kind == "pointwise"
                                       else ("_persistent", "_looped"))))
    return "\n\n\n".join(out), read + written, syms_list


def _CheckingEmitter(checks: dict[Node, int], ranges: dict[str, Node], dtypes: dict[str, torch.dtype]) -> TritonEmitter:
    em = TritonEmitter(dtypes)
    em.checks, em.ranges = checks, ranges
    return em


def _jit(syms: list[str], numels: dict[str, Sequence[Node]]) -> str:
    """The kernel's decorator.  Triton compiles a binary per specialization of its int arguments
    (equal to 1, divisible by 16); a size symbol's value, and a numel made of one, would give a
    new batch size a new binary: a Llama compiled with a symbolic batch compiled eight kernels
    again at batch 16, ~1 s.  They are not specialized, as Inductor specializes only sizes
    known to be multiples of 16; a numel whose constant factors make it one stays specialized,
    since that holds at every size (and lets Triton prove masks uniform over vectors)."""
    unstable = list(syms)
    for name, sizes in numels.items():
        factor, symbolic = 1, False
        for size in sizes:
            size_factor, size_symbolic = _constant_factor(size)
            factor, symbolic = factor * size_factor, symbolic or size_symbolic
        if symbolic and factor % 16:
            unstable.append(name)
    return f"@triton.jit(do_not_specialize={unstable!r})" if unstable else "@triton.jit"


def _constant_factor(size: Node) -> tuple[int, bool]:
    """(a constant that divides `size` at every value of its symbols, whether it has any)."""
    if size.op == "const":
        return int(size.arg), False
    if size.op == "mul":
        factor = 1
        for arg in size.args:
            factor *= _constant_factor(arg)[0]
        return factor, True
    return 1, True


def _static_numels(em: TritonEmitter, **numels: Sequence[Node]) -> None:
    """Shadow a numel argument with its value when the sizes are compile-time constants.

    Triton proves a mask like `rindex < rnumel` uniform over 8 lanes (one 16-byte bf16 vector)
    only if it knows rnumel is a multiple of 8; from an argument it only learns "divisible by
    16", so rows of 1000 or 768 + 8 elements were read 2 bytes at a time.  Kernels of graphs with
    symbolic sizes keep the argument (shape-generic)."""
    for name, sizes in numels.items():
        total = 1
        for size in sizes:
            if size.op != "const":
                break
            total *= int(size.arg)
        else:
            em.line(f"{name} = {total}   # static size: exact divisibility for masks and vector loads")
            if total > 0:       # (0 % BLOCK == 0, yet an empty dim needs its mask)
                em.static.add(name)


def _emit_mask(em: TritonEmitter, mask: str, index: str, numel: str, block: str, shape: str) -> None:
    """`mask = index < numel`; with a static numel that the block divides, no mask at all (a
    constant-true one: Triton drops it).  A static `if`: Triton folds `numel % BLOCK` at compile
    time (probes/long_rows.py measures it on long layer-norm rows)."""
    if numel not in em.static or not em.drop_masks:
        em.line(f"{mask} = {index} < {numel}")
        return
    em.line(f"if {numel} % {block} == 0:")
    em.line(f"    {mask} = tl.full({shape}, 1, tl.int1)")
    em.line("else:")
    em.line(f"    {mask} = {index} < {numel}")


# Dims shorter than this are not worth a 2-D tile (most of a 16-wide tile would be masked off).
MIN_TILE_DIM = 16


def _unit_dim(index: Node, ndim: int) -> int | None:
    """The loop dim along which `index` moves by exactly one element, if any."""
    return next((k for k in range(ndim) if stride_of(index, f"x{k}") == 1), None)


class Tile(NamedTuple):
    """A 2-D [YBLOCK, XBLOCK] tile's loop dims: `y`, and `xs` (outer to inner) flattened along x.
    `xs` is one dim but for a scatter's row tile, where x may span a row's contiguous dims (a
    GAT's heads and channels)."""
    y: int
    xs: tuple[int, ...]

    @property
    def x(self) -> int:
        return self.xs[-1]


def tile_dims(plan: LoopPlan) -> Tile | None:
    """The dims of a 2-D tiled pointwise kernel, or None for the flat 1-D kernel.

    A flat block walks the output's contiguous dim, so an input that is contiguous along another
    dim (a transpose, x.permute(0, 2, 1) + y) is read with a large stride: every lane touches its
    own 32-byte sector.  A [YBLOCK, XBLOCK] tile over the output's contiguous dim (x) and the
    input's (y) lets Triton load along y and store along x, both coalesced (it converts the
    register layout through shared memory in between)."""
    n = len(plan.outer)
    if plan.kernel.kind != "pointwise" or n < 2:
        return None
    if plan.kernel.scatter is not None:
        return scatter_tile(plan)
    stored = [m for m in plan.members if m.buffer.name in plan.stored]
    xd = _unit_dim(stored[0].store, n) if stored else None
    if xd is None:
        return None
    produced = {m.buffer.name for m in plan.members}
    for m in plan.members:
        for ld in loads(m.body):
            if ld.arg in produced or stride_of(ld.args[0], f"x{xd}") == 0:
                continue            # a fused intermediate, or broadcast along x: no conflict
            yd = _unit_dim(ld.args[0], n)
            if yd is None or yd == xd:
                continue
            small = [d for d in (xd, yd) if plan.outer[d].op == "const" and plan.outer[d].arg < MIN_TILE_DIM]
            if small:
                log.debug("%s: no 2-D tile, dim %d has only %s elements", plan.kernel.name, small[0],
                          plan.outer[small[0]].arg)
                return None
            return Tile(yd, (xd,))
    return None


def scatter_tile(plan: LoopPlan) -> Tile | None:
    """The tile of a scatter kernel that writes whole rows (a GNN's messages summed into their
    nodes, an embedding's gradient): x the row's contiguous dim, y a dim the scatter's index is
    read along.  A flat block reads the index once per element (the same address for a whole
    row: issue slots, and a `//` per lane); a [YBLOCK, XBLOCK] tile reads it once per row (a
    [YBLOCK, 1] load) and its atomics still vectorize along x, as Inductor tiles them.  Dims
    just outside x that continue the row contiguously (a GAT's heads around its channels) join
    x up to ROW_TILE_XBLOCK elements: as a dim of their own, outside the tile, each head's
    slice of a row was a separate pass over the edges (GAT training 1.55 against 1.10 ms a
    scatter, H200).  None: the flat kernel (rows narrower than MIN_TILE_DIM, or no index)."""
    n = len(plan.outer)
    offsets = [split_guarded(m.store)[0] for m in plan.members if m.buffer.scatter is not None]
    dims = {_unit_dim(off, n) for off in offsets}
    if len(dims) != 1 or None in dims:
        return None
    xd = dims.pop()
    width = plan.outer[xd]
    if width.op != "const" or width.arg < MIN_TILE_DIM:
        return None
    along = {int(v.arg[1:]) for off in offsets for ld in walk(off) if ld.op == "load"
             for v in walk(ld.args[0]) if v.op == "var" and v.arg[:1] == "x"} - {xd}
    if not along:
        return None
    yd = max(along)
    xs, span = [xd], int(width.arg)
    for k in range(xd - 1, -1, -1):
        size = plan.outer[k]
        if k == yd or size.op != "const" or span * int(size.arg) > ROW_TILE_XBLOCK or \
                any(stride_of(off, f"x{k}") != span for off in offsets):
            break
        xs.insert(0, k)
        span *= int(size.arg)
    return Tile(yd, tuple(xs))


def _emit_tile_indices(em: TritonEmitter, plan: LoopPlan, tile: Tile) -> None:
    """Program id -> (tile along x, tile along y, the other dims), x tiles fastest."""
    yd, xd = tile.y, tile.x
    em.line("pid = tl.program_id(0)")
    em.line("if BIG:")
    em.line("    pid = pid.to(tl.int64)")
    em.line("xtiles = (xnumel + XBLOCK - 1) // XBLOCK")
    em.line("ytiles = (ynumel + YBLOCK - 1) // YBLOCK")
    row = f"x{xd}" if len(tile.xs) == 1 else "xrow"     # (several dims: unflattened below)
    em.line(f"{row} = (pid % xtiles) * XBLOCK + tl.arange(0, XBLOCK)[None, :]")
    em.line(f"x{yd} = ((pid // xtiles) % ytiles) * YBLOCK + tl.arange(0, YBLOCK)[:, None]")
    em.line(f"xmask = ({row} < xnumel) & (x{yd} < ynumel)")
    inner = 1
    for k in reversed(tile.xs if len(tile.xs) > 1 else ()):
        size = int(plan.outer[k].arg)
        base = "xrow" if inner == 1 else f"(xrow // {inner})"
        em.line(f"x{k} = {base}" + (f" % {size}" if k != tile.xs[0] else ""))
        inner *= size
    em.line("xzero = tl.zeros([YBLOCK, XBLOCK], tl.int32)   # gives scalar addresses the tile's shape")
    if plan.kernel.scatter is not None:
        # loads that do not move along x (the scatter's index, a per-row weight) are read
        # once per row of the tile: [YBLOCK, 1] (TritonEmitter.row_vars)
        em.line(f"ymask = x{yd} < ynumel")
        em.line("yzero = tl.zeros([YBLOCK, 1], tl.int32)")
        em.row_vars = frozenset(f"x{k}" for k in tile.xs)
    rest = [k for k in range(len(plan.outer)) if k != yd and k not in tile.xs]
    if rest:
        # Triton's interpreter fails a mask that combines the tile's mask with a comparison of
        # a program-id scalar (`xmask & (x1 < s0)`, a cat along a dim outside the tile:
        # "mask has unsupported dtype"); there the scalar gets the tile's shape
        em.line("zindex = pid // (xtiles * ytiles)" + (" + xzero" if em.interpreter else ""))
        stride = None
        for k in reversed(rest):
            base = "zindex" if stride is None else f"(zindex // ({stride}))"
            em.line(f"x{k} = {base}" + (f" % ({em.index(plan.outer[k])})" if k != rest[0] else ""))
            stride = em.index(plan.outer[k]) if stride is None else f"{stride} * {em.index(plan.outer[k])}"


# Triton's atomic read-modify-writes by scatter mode (plain tl.store for "store"), and the
# dtypes each takes: no atomic multiply, no max/min of fp16/bf16 (those run in fp32 kernels),
# and a 16-bit add only where the device has one (Features.half_atomic_add)
SCATTER_ATOMICS = {"sum": "tl.atomic_add", "amax": "tl.atomic_max", "amin": "tl.atomic_min"}
_ATOMIC_INTS = frozenset({torch.int32, torch.int64})
# fp16 and bf16 sums accumulate in an fp32 buffer (Features.scatter_wide_sums): an atomic add
# would round each update to 16 bits, where CUDA's embedding backward and accumulating index_put
# sum in fp32 (5x eager's error measured on an H100 for an embedding gradient of 20 rows a token).
# The ops whose CUDA kernels add atomically in 16 bits themselves (scatter_add, index_add,
# scatter_reduce sum) add in 16 bits here too where the device can (Features.half_atomic_add,
# __init__.half_atomic_adds)
SCATTER_DTYPES = {"sum": frozenset({torch.float32, torch.float64}) | _ATOMIC_INTS,
                  "amax": frozenset({torch.float32, torch.float64}) | _ATOMIC_INTS,
                  "amin": frozenset({torch.float32, torch.float64}) | _ATOMIC_INTS}


def _emit_scatter(em: TritonEmitter, m, mask: str) -> None:
    """`into[offset] (op)= value` per lane, masked off where the index is out of range or
    skipped.  Where lanes collide, atomics serialize; a plain store's winner is unspecified,
    as in eager.

    The address is the bare offset and the lane's validity a mask of its own (split_guarded):
    Triton vectorizes an atomic or a store (`red.global.add.v4.f32`, `.v8.bf16` on sm_90) only
    when the address is contiguous and the mask constant along the features, and a validity
    that tests the loaded index is constant along them, where `tl.where(ok, offset, 0)` or a
    mask `offset >= 0` made every add a scalar one.  A masked-off lane touches no memory, on a
    GPU and under the interpreter alike, whatever its offset."""
    buf = m.buffer
    v = em.value(m.body)
    offset, valid = split_guarded(m.store)
    off = em.tmp(em.index(offset))
    ok = mask if valid is None else em.tmp(f"{mask} & ({em.value(valid)})")
    ptr = f"{buf.into} + {off} + xzero"
    # (a constant value, scatter.value's, is a Python literal: given the block's shape first)
    value = f"(tl.zeros_like(xzero).to({STORE_TL[buf.dtype]}) + {v}).to({STORE_TL[buf.dtype]})"
    if buf.scatter == "store":
        em.line(f"tl.store({ptr}, {value}, {ok})")
    else:
        # relaxed: a scatter's updates need atomicity, not ordering against other memory
        # operations; Triton's default (acq_rel) fences every update (a GCN layer's gather-scatter
        # kernel took 2.5x Inductor's time on an H100, which passes sem='relaxed' too)
        em.line(f"{SCATTER_ATOMICS[buf.scatter]}({ptr}, {value}, {ok}, sem='relaxed')")


def _emit_values(em: TritonEmitter, plan: LoopPlan, members, mask: str) -> None:
    for m in members:
        if m.buffer.scatter is not None:
            _emit_scatter(em, m, mask)
            continue
        v = em.value(m.body)
        em.bind_local(m.buffer.name, m.store, v)
        if m.buffer.name in plan.stored and m.buffer.name not in em.unstored:
            em.line(f"tl.store({m.buffer.name} + ({em.index(m.store)}) + xzero, {to_storage(v, m.buffer.dtype)}, {mask})")


def _open_row_loop(em: TritonEmitter, plan: LoopPlan) -> None:
    """Start a loop over the reduced dim in RBLOCK chunks (the looped variant's stages)."""
    em.line("for roffset in range(0, rnumel, RBLOCK):")
    em.indent += 1
    em.push()
    em.line("rindex = roffset + rbase")
    _emit_mask(em, "rmask", "rindex", "rnumel", "RBLOCK", "[1, RBLOCK]")
    _unflatten(em, "rindex", plan.inner, "y")


def _close_row_loop(em: TritonEmitter) -> None:
    em.pop()
    em.indent -= 1


def _online_pair(stage, nxt) -> bool:
    """A max stage followed by a sum of exp(x - max) over the same x (softmax, log-softmax,
    cross entropy): the looped variant computes both in one pass over the row."""
    if nxt is None or stage.kind != "reduce" or nxt.kind != "reduce" or len(stage.members) != 1 \
            or len(nxt.members) != 1:
        return False
    m, n = stage.members[0], nxt.members[0]
    # fp32 throughout: a max rounded to a low-precision buffer would differ from the one the
    # online sum was scaled by
    if m.buffer.reduction_op != "max" or n.buffer.reduction_op != "sum" or \
            any(t != torch.float32 for t in (m.body.dtype, n.body.dtype, m.buffer.dtype, n.buffer.dtype)):
        return False
    e = n.body
    if e.op != "exp" or e.args[0].op != "sub":
        return False
    x, r = e.args[0].args
    return x == m.body and r.op == "load" and r.arg == m.buffer.name and r.args[0] == m.store


def _emit_online(em: TritonEmitter, plan: LoopPlan, stage, nxt) -> None:
    """Online softmax (Milakov & Gimelshein): per lane a running max m and a running sum s of
    exp(x - m), rescaled when m grows; the row's sum is sum(s * exp(m - M)) for the row max M.
    A lane whose max is still -inf has seen only -inf (or masked) values: it adds 0, and the
    final 0 * exp(-inf - M) is 0 for a finite M and NaN for an all -inf row, as in eager mode
    (x - max is NaN there).  NaN and +inf propagate as in the two-pass form."""
    m, n = stage.members[0], nxt.members[0]
    acc_m, acc_s = f"acc_{m.buffer.name}", f"acc_{n.buffer.name}"
    em.line(f"{acc_m} = tl.full([XBLOCK, RBLOCK], -1e999, tl.float32)")
    em.line(f"{acc_s} = tl.full([XBLOCK, RBLOCK], 0, tl.float32)")
    _open_row_loop(em, plan)
    em.mask = "xmask & rmask"
    v = em.tmp(f"tl.where(xmask & rmask, {em.value(m.body)}, -1e999)")
    new = em.tmp(f"_max_nan({acc_m}, {v})")
    scale = em.tmp(f"tl.where({new} == {acc_m}, 1.0, {em.exp_fn}({acc_m} - {new}))")
    term = em.tmp(f"tl.where({new} == -1e999, 0.0, {em.exp_fn}({v} - {new}))")
    em.line(f"{acc_s} = {acc_s} * {scale} + {term}")
    em.line(f"{acc_m} = {new}")
    _close_row_loop(em)
    _finish_reduction(em, plan, m, None, acc_m)
    row_max = em.local_of(load(m.buffer.name, m.store, torch.float32))
    _finish_reduction(em, plan, n, None, None, result=f"tl.sum({acc_s} * {em.exp_fn}({acc_m} - {row_max}), 1)[:, None]")


def _variance_pair(stage, nxt):
    """`nxt` is one sum of (x - a) * (x - a), where x is the body of a sum in `stage` (so it can
    be computed in that stage's loop) and a is a per-row value of `stage` (the mean of a
    variance or layer norm).  Returns (member, x, a) when the looped variant can get the sum
    from `stage`'s pass over the row (see _emit_shifted_sums), else None."""
    if nxt is None or stage.kind != "reduce" or nxt.kind != "reduce" or len(nxt.members) != 1:
        return None
    n = nxt.members[0]
    d = n.body
    if n.buffer.reduction_op != "sum" or d.dtype != torch.float32 or n.buffer.dtype != torch.float32 \
            or d.op != "mul" or d.args[0] != d.args[1] or d.args[0].op != "sub":
        return None
    x, a = d.args[0].args
    if not any(m.buffer.reduction_op == "sum" and m.body == x for m in stage.members) or any(v.op == "var" and v.arg.startswith("y") for v in walk(a)):
        return None
    return n, x, a


def _emit_shifted_sums(em: TritonEmitter, x: str, acc: str) -> None:
    """Per lane, sums of d = x - k and d * d, k being the lane's first element (loaded before
    the loop by _emit_shift).  Sums of x and x * x would cancel catastrophically for rows far
    from 0 (mean 1e4, std 1e-3); a running Welford mean in fp32 rounds to the mean's ulp at
    every step, and divides per element.  d is exact for rows of similar values, and nothing
    below cancels by more than a small factor.  Three flops per element: a layer norm's first
    pass stays memory-bound in bf16 (probes/long_rows.py)."""
    d = em.tmp(f"tl.where(xmask & rmask, {x} - {acc}_k, 0.0)")
    em.line(f"{acc}_s1 = {acc}_s1 + {d}")
    em.line(f"{acc}_s2 = {acc}_s2 + {d} * {d}")


def _emit_shift(em: TritonEmitter, plan: LoopPlan, x, acc: str) -> None:
    """Before the loop: k = x at each lane's first element (0 where the lane has none), and the
    lanes' zeroed sums.  The first chunk is read again by the loop's first step, from L2."""
    em.push()       # the values computed here are this chunk's: the loop must not reuse them
    em.line("rindex = rbase")
    _emit_mask(em, "rmask", "rindex", "rnumel", "RBLOCK", "[1, RBLOCK]")
    _unflatten(em, "rindex", plan.inner, "y")
    em.mask = "xmask & rmask"
    em.line(f"{acc}_k = tl.where(xmask & rmask, {em.value(x)}, 0.0)")
    em.pop()
    for part in ("s1", "s2"):
        em.line(f"{acc}_{part} = tl.full([XBLOCK, RBLOCK], 0, tl.float32)")


def _finish_shifted_sums(em: TritonEmitter, plan: LoopPlan, total, member, a, acc: str) -> None:
    """The row's sum of x (`total`, when the stage has one) is sum(k n + s1) over lanes, n being
    a lane's element count; sum((x - a)^2) over a lane = s2 + 2 (k - a) s1 + n (k - a)^2,
    exact for any per-row a."""
    n = em.tmp("((rnumel - rbase + RBLOCK - 1) // RBLOCK).to(tl.float32)")   # >= 0: rbase < RBLOCK
    if total is not None:
        _finish_reduction(em, plan, total, None, None, result=f"tl.sum({acc}_k * {n} + {acc}_s1, 1)[:, None]")
    c = em.tmp(f"{acc}_k - {em.value(a)}")
    lanes = em.tmp(f"tl.where({n} > 0, {acc}_s2 + {c} * (2.0 * {acc}_s1 + {n} * {c}), 0.0)")
    _finish_reduction(em, plan, member, None, None, result=f"tl.sum({lanes}, 1)[:, None]")


def _stage_loads(stage) -> set[str]:
    return {n.arg for m in stage.members for n in walk(m.body) if n.op == "load"}


def _eviction(stages: list, i: int, merged: int) -> dict[str, str] | None:
    """L2 hints for the loop of stages[i] (merged with the next `merged` stages) of a kernel
    with several loops over the row: a buffer read again by a later loop is kept
    (`evict_last`: a row's second pass then finds it in L2), one read for the last time goes
    first.  Loads that are the same for every row (a layer norm's weight) are always kept
    (TritonEmitter._expr).  A kernel with one loop (a plain sum) gets no hints."""
    loops = [s for s in stages if s.kind != "outer"]
    if len(loops) <= 1 + merged:
        return None
    later = set().union(*(_stage_loads(s) for s in stages[i + 1 + merged:] if s.kind != "outer"))
    here = set().union(*(_stage_loads(s) for s in stages[i:i + 1 + merged]))
    return {name: "evict_last" if name in later else "evict_first" for name in here}


def _emit_reduction_body(em: TritonEmitter, plan: LoopPlan, persistent: bool) -> None:
    full_mask = "xmask & rmask"
    if persistent:
        em.line("rindex = rbase")
        _emit_mask(em, "rmask", "rindex", "rnumel", "RBLOCK", "[1, RBLOCK]")
        _unflatten(em, "rindex", plan.inner, "y")
    stages = list(plan.stages)
    skip = False
    for i, stage in enumerate(stages):
        if skip:
            skip = False
            continue
        nxt = stages[i + 1] if i + 1 < len(stages) else None
        if not persistent and _online_pair(stage, nxt):
            em.evict = _eviction(stages, i, 1)
            _emit_online(em, plan, stage, nxt)
            em.evict = None
            skip = True
            continue
        if stage.kind == "outer":
            em.mask = "xmask"
            if persistent:
                # A persistent kernel computes the reduced body for the whole [XBLOCK, RBLOCK]
                # tile in this scope, a load that does not depend on r included (the sum of an
                # expanded value): reused by a per-row member, its [XBLOCK, RBLOCK] shape would be
                # stored through a [XBLOCK, 1] pointer.  Per-row members compute their own values
                # (the looped variant's row loop has its own scope already).
                tile_values, em.scopes[-1] = em.scopes[-1], {}
                _emit_values(em, plan, stage.members, "xmask")
                em.scopes[-1] = {**tile_values, **em.scopes[-1]}
            else:
                _emit_values(em, plan, stage.members, "xmask")
            continue
        variance = None if persistent else _variance_pair(stage, nxt)
        if not persistent:
            members = stage.members if stage.kind == "reduce" else []
            total = None
            em.evict = _eviction(stages, i, 1 if variance else 0)
            if variance:
                vacc = f"acc_{variance[0].buffer.name}"
                # the stage's sum of x comes from the shifted sums (_finish_shifted_sums)
                total = next((m for m in members if m.buffer.reduction_op == "sum" and m.body == variance[1]
                              and m.body.dtype == torch.float32), None)
                members = [m for m in members if m is not total]
                keep, em.evict = em.evict, {**(em.evict or {}), **{b: "evict_last" for b in _stage_loads(stage)}}
                _emit_shift(em, plan, variance[1], vacc)
                em.evict = keep
            accs = _open_accumulators(em, members)
            _open_row_loop(em, plan)
        em.mask = full_mask
        if stage.kind == "inner":
            _emit_values(em, plan, stage.members, full_mask)
        elif persistent:
            for m in stage.members:
                _finish_reduction(em, plan, m, em.value(m.body), None)
        else:
            for m, acc in accs:
                _accumulate(em, m, em.value(m.body), acc)
            if variance:
                _emit_shifted_sums(em, em.value(variance[1]), vacc)
        if not persistent:
            _close_row_loop(em)
            em.evict = None
            for m, acc in accs:
                _finish_reduction(em, plan, m, None, acc)
            if variance:
                _finish_shifted_sums(em, plan, total, variance[0], variance[2], vacc)
                skip = True


def _open_accumulators(em: TritonEmitter, members) -> list:
    accs = []
    for m in members:
        op, dt = m.buffer.reduction_op, m.body.dtype
        acc = f"acc_{m.buffer.name}"
        em.line(f"{acc} = tl.full([XBLOCK, RBLOCK], {_init(op, dt)}, {TL[dt]})")
        if op in ("argmax", "argmin"):
            em.line(f"{acc}_i = tl.full([XBLOCK, RBLOCK], 0, tl.int64)")
        accs.append((m, acc))
    return accs


def _accumulate(em: TritonEmitter, m, v: str, acc: str) -> None:
    op, dt = m.buffer.reduction_op, m.body.dtype
    v = f"tl.where(xmask & rmask, {v}, {_init_value(op, dt)})"
    if op == "sum":
        em.line(f"{acc} = {acc} + {v}")
    elif op == "prod":
        em.line(f"{acc} = {acc} * {v}")
    elif op in ("max", "any"):
        em.line(f"{acc} = _max_nan({acc}, {v})" if dt.is_floating_point else f"{acc} = tl.maximum({acc}, {v})")
    elif op in ("min", "all"):
        em.line(f"{acc} = _min_nan({acc}, {v})" if dt.is_floating_point else f"{acc} = tl.minimum({acc}, {v})")
    else:
        tv = em.tmp(v)
        cmp = ">" if op == "argmax" else "<"
        nan = f" | (({tv} != {tv}) & ({acc} == {acc}))" if dt.is_floating_point else ""
        better = em.tmp(f"({tv} {cmp} {acc}){nan}")
        em.line(f"{acc} = tl.where({better}, {tv}, {acc})")
        em.line(f"{acc}_i = tl.where({better}, rindex, {acc}_i)")


def _row_reduce(op: str, dt: torch.dtype, v: str, em: TritonEmitter) -> str:
    if op == "sum":
        return f"tl.sum({v}, 1)[:, None]"
    if op == "prod":
        return f"tl.reduce({v}, 1, _mul_combine)[:, None]"
    if op in ("max", "any", "min", "all"):
        fn = "tl.max" if op in ("max", "any") else "tl.min"
        if dt == torch.bool:
            return f"{fn}({v}.to(tl.int8), 1)[:, None] != 0"
        if dt.is_floating_point:   # one NaN-propagating tree reduction (not max + a NaN flag)
            return f"tl.reduce({v}, 1, {'_max_nan' if op in ('max', 'any') else '_min_nan'})[:, None]"
        return f"{fn}({v}, 1)[:, None]"
    raise NotImplementedError(op)


def _finish_reduction(em: TritonEmitter, plan: LoopPlan, m, v: str | None, acc: str | None,
                      result: str | None = None) -> None:
    op, dt = m.buffer.reduction_op, m.body.dtype
    if result is not None:          # computed by the caller (online softmax)
        result = em.tmp(result)
    elif acc is None:
        acc = em.tmp(f"tl.where(xmask & rmask, {v}, {_init_value(op, dt)})")
        idx = "rindex"
    else:
        idx = f"{acc}_i"
    if op in ("argmax", "argmin"):
        # first index among the lanes holding the best value; a NaN beats every value, as in
        # eager's argmax and argmin alike (also an infinity, and also for argmin)
        best_fn = "tl.max" if op == "argmax" else "tl.min"
        idx_full = em.tmp(f"tl.broadcast_to({idx}, [XBLOCK, RBLOCK])" if idx == "rindex" else idx)
        key = em.tmp(f"tl.where({acc} != {acc}, {_init_value(op, dt)}, {acc})" if dt.is_floating_point else acc)
        best = em.tmp(f"{best_fn}({key}, 1)[:, None]")
        result = em.tmp(f"tl.min(tl.where({key} == {best}, {idx_full}, 2147483647), 1)[:, None]")
        if dt.is_floating_point:
            first_nan = em.tmp(f"tl.min(tl.where({acc} != {acc}, {idx_full}, 2147483647), 1)[:, None]")
            result = em.tmp(f"tl.where({first_nan} < 2147483647, {first_nan}, {result})")
        result = em.tmp(f"{result}.to(tl.int64)")
    elif result is None:
        result = em.tmp(_row_reduce(op, dt, acc, em))
    value = em.tmp(f"{to_storage(result, m.buffer.dtype)}.to({TL[m.buffer.dtype]})")
    em.bind_local(m.buffer.name, m.store, value)
    if m.buffer.name in plan.stored and m.buffer.name not in em.unstored:
        em.line(f"tl.store({m.buffer.name} + ({em.index(m.store)}) + xzero, {to_storage(value, m.buffer.dtype)}, xmask)")
