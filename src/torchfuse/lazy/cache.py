"""Compiled graphs of lazy flushes, cached in two levels so that sizes are not part of the key.

* Level 1, `_EXACT`: the exact signature of a flush (ops and their scalar arguments, how nodes
  connect, dtype/size/stride/offset of every leaf) -> the compiled graph to call.  One dict
  lookup per flush: a loop that records the same step again (the common case) stops here.
* Level 2, `_SHAPES`: the same signature with the sizes left out (leaf dtypes and ranks only;
  every int of a size-like argument -- `view`/`expand` shapes, `arange` ends, slice bounds --
  lifted out of the key, see `_abstract`) -> graphs compiled with *symbolic* sizes (make_fx
  tracing_mode="symbolic").  Each holds the shape guards its tracing and compilation assumed
  (ShapeEnv.produce_guards_expression, statics included) and a pattern saying how each lifted
  int was made: taken from a leaf's size, a graph input of its own, or a constant (`_pattern`).
  A level-1 miss whose ints follow a graph's pattern and whose guards pass reuses that graph:
  a new batch size or sequence length compiles nothing and builds no kernel; only shapes that
  break a guard (e.g. a size 1 where the graph was traced with a size > 1) compile again.
* A graph the core cannot compile with symbolic sizes (a lowering that needs a static size)
  is compiled once more with static sizes and cached in level 1 only.

Both levels are LRU-bounded by the block's `Config.memory_cache_size`.  Counters:
`lazy_cache_hits` (level 1), `lazy_shape_hits` (level 2), `lazy_compiles` (graphs compiled).
"""
from __future__ import annotations

import logging
import math
import warnings
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

import torch

from ..report import Explanation
from ..config import Config
from ..counters import counters

if TYPE_CHECKING:
    from .context import LazyContext
    from .graph import LazyNode

log = logging.getLogger("torchfuse.lazy")

MAX_VARIANTS = 8        # symbolic graphs kept per size-free signature (distinct guard sets)


class Slot:
    """Placeholder for the i-th tensor argument inside a node's argument template."""
    __slots__ = ("i",)

    def __init__(self, i: int):
        self.i = i


class IntSlot:
    """Placeholder for the j-th lifted integer of a graph (a size-like argument) in a template."""
    __slots__ = ("j",)

    def __init__(self, j: int):
        self.j = j


def fill(template: Any, tensors: list, ints: tuple = ()) -> Any:
    """Put `tensors` (and lifted `ints`) back into the `Slot`s of an argument template."""
    tp = type(template)
    if tp is Slot:
        return tensors[template.i]
    if tp is list or tp is tuple:
        return tp([fill(x, tensors, ints) for x in template])
    if tp is dict:      # kwargs: always a fresh dict, callers may add to it
        return {k: fill(v, tensors, ints) for k, v in template.items()}
    if tp is IntSlot:
        return ints[template.j]
    return template


@dataclass
class Compiled:
    """One compiled aten graph.  `dynamic`: traced with symbolic sizes and called with the free
    lifted ints after the leaves; `guard`: compiled guard expression over (leaves, free ints)."""
    call: Callable
    kernels: int
    graph: str
    dynamic: bool = False
    guard: Any = None
    pattern: tuple = ()     # how each candidate int is made (see _pattern); dynamic graphs only


@dataclass
class Entry:
    """A level-1 entry: a compiled graph for one exact signature."""
    compiled: Compiled
    ints: tuple = ()                     # free lifted ints of this signature (dynamic graphs only)
    checked: bool = False                # outputs checked once (aliasing, dtype, layout)
    copy_outputs: tuple[int, ...] = ()   # outputs aliasing a leaf or another output: copied
    fixes: tuple = ()                    # (output, "dtype"/"layout") conversions eager needs
    evicted: bool = False                # dropped from the cache: flush replays must not use it
    descs: list = field(default_factory=list)

    @property
    def kernels(self) -> int:
        return self.compiled.kernels

    def call(self, leaves: list) -> list:
        args = list(leaves)
        if self.compiled.dynamic:
            args += self.ints
        return list(self.compiled.call(args))


_EXACT: "OrderedDict[tuple, Entry]" = OrderedDict()
_SHAPES: "OrderedDict[tuple, list[Compiled]]" = OrderedDict()
_STATIC_ONLY: "OrderedDict[tuple, None]" = OrderedDict()   # size-free keys compiled static
_SEEN: "OrderedDict[tuple, None]" = OrderedDict()          # size-free keys compiled before
_CONFIG_TOKENS: dict[Config, int] = {}


def config_token(config: Config) -> int:
    """A small int per distinct Config, so cache keys do not hash the whole Config every flush."""
    return _CONFIG_TOKENS.setdefault(config, len(_CONFIG_TOKENS))


def clear() -> None:
    for entry in _EXACT.values():
        entry.evicted = True
    _EXACT.clear()
    _SHAPES.clear()
    _STATIC_ONLY.clear()
    _SEEN.clear()


def cache_sizes() -> tuple[int, int]:
    """(level-1 entries, level-2 signatures): for tests and debugging."""
    return len(_EXACT), len(_SHAPES)


def _bound(cache: OrderedDict, limit: int) -> None:
    while len(cache) > max(1, limit):
        _, value = cache.popitem(last=False)
        if type(value) is Entry:
            value.evicted = True


def lookup(sig: tuple, order: list["LazyNode"], codes: list[list], outs: tuple, leaves: list,
           device: torch.device, ctx: "LazyContext") -> tuple[Entry, bool]:
    """The level-1 entry for `sig`, compiling (or taking a symbolic graph from level 2) on a
    miss.  Returns (entry, cache hit)."""
    entry = _EXACT.get(sig)
    if entry is not None:
        _EXACT.move_to_end(sig)
        counters.bump("lazy_cache_hits")
        return entry, True
    limit = ctx.config.memory_cache_size
    steps, cands, akey = _abstract(order, codes)
    skey = (sig[0], device, tuple((t.dtype, t.dim()) for t in leaves), akey, outs)
    variants = _SHAPES.get(skey)
    if variants is not None:
        for c in variants:
            ints = _free_ints(c.pattern, cands, leaves)
            if ints is not None and _guard_ok(c, [*leaves, *ints]):
                _SHAPES.move_to_end(skey)
                counters.bump("lazy_shape_hits")
                entry = _EXACT[sig] = Entry(c, tuple(ints))
                _bound(_EXACT, limit)
                return entry, True
    # ctx.dynamic: True compiles symbolic sizes from the first size on; None ("auto", like
    # Dynamo's automatic dynamic shapes) compiles static sizes first -- faster C++ kernels --
    # and symbolic ones once a second size of the same structure shows up; False never.
    pattern = _pattern(cands, leaves)
    ints = _free_ints(pattern, cands, leaves) or []
    dynamic = getattr(ctx, "dynamic", True)
    static_key = (skey, pattern)
    symbolic = static_key not in _STATIC_ONLY and (dynamic is True or (dynamic is None and skey in _SEEN))
    _SEEN[skey] = None
    _bound(_SEEN, limit)
    compiled = _compile(order, steps, outs, leaves, pattern, ints, ctx, symbolic=symbolic)
    if not compiled.dynamic and symbolic:
        # The core could not (or not correctly) compile this structure with symbolic sizes:
        # do not try again for its other sizes.
        _STATIC_ONLY[static_key] = None
        _bound(_STATIC_ONLY, limit)
    if compiled.dynamic and compiled.guard is not None:
        variants = _SHAPES.setdefault(skey, [])
        variants.append(compiled)
        del variants[:-MAX_VARIANTS]
        _SHAPES.move_to_end(skey)
        _bound(_SHAPES, limit)
    entry = _EXACT[sig] = Entry(compiled, tuple(ints) if compiled.dynamic else ())
    _bound(_EXACT, limit)
    return entry, False


# --------------------------------------------------------------------------------------------
# size-free signatures: lifting `size=` integers out of the argument templates
# --------------------------------------------------------------------------------------------

_SIZE_ARGS: dict[Any, frozenset] = {}
# Integer arguments that may carry a size: `SymInt[] size/shape` (view, reshape, expand, full,
# new_zeros, ...), SymInt slice/narrow/select bounds, and arange's `end` (a Scalar).
_LIFTABLE = {"size", "shape", "start", "end", "length", "index"}
_LIFTABLE_TYPES = ("SymInt[]", "SymInt[]?", "SymInt", "SymInt?")


def _size_args(func: Any) -> frozenset:
    """Names of the arguments of an op whose integers may be sizes (see _LIFTABLE)."""
    names = _SIZE_ARGS.get(func)
    if names is None:
        names = frozenset()
        try:
            from torchgen.model import FunctionSchema
            schema = FunctionSchema.parse(str(func._schema))
            arange = schema.name.name.base == "arange"
            names = frozenset(a.name for a in schema.arguments.flat_all if a.name in _LIFTABLE and (
                str(a.type) in _LIFTABLE_TYPES or (arange and str(a.type) == "Scalar")))
        except Exception as e:      # an op whose schema torchgen cannot parse: lift nothing
            log.debug("lazy: schema of %s: %s", func, e)
        _SIZE_ARGS[func] = names
    return names


# Scalar arguments that are a size when they equal one: a mean's backward divides by the
# number of elements it averaged (`div.Scalar(grad, b * n)`), a new constant at every batch
# size.  Lifted only as a leaf's size (never a graph input of its own: `x / 3` stays 3).
_SCALAR_SIZES = {torch.ops.aten.div.Scalar: "other"}


def _lift(value: Any, cands: list, index: bool, free_ok: bool = True) -> Any:
    """Replace every int of a size-like argument by an IntSlot; record (value, whether it may
    become a graph input of its own, whether it is an index or bound rather than a size).
    Not free: ints inside a size list that infers a dim from -1, where a free symbol gives
    strides such as Max(1, 64 // s3), evaluated at run time in every index."""
    tp = type(value)
    if tp is int:
        cands.append((value, free_ok, index))
        return IntSlot(len(cands) - 1)
    if tp is list or tp is tuple:
        free_ok = free_ok and -1 not in value
        return tp([_lift(x, cands, index, free_ok) for x in value])
    return value


_INDEX_ARGS = {"start", "end", "index"}
_MAX_FREE = 1 << 31      # larger ints (a slice's "to the end") stay constants


def _pattern(cands: list, leaves: list[torch.Tensor]) -> tuple:
    """How each lifted int is made in a symbolic graph compiled for this call, in order of
    preference:

    * ("leaf", dims, off): the int is a size of a leaf (or a product of adjacent sizes:
      `view(b * s, ...)`) plus `off` (0; for indices and bounds also -1/+1: `x[:, s - 1]`,
      `mask[..., :s + 1]`): the batch or sequence length flowing from the inputs into
      `view`, `arange` or slicing, traced as the leaf's own symbol;
    * ("same", j, off): an earlier lifted int plus `off` (the same length used twice in a
      graph with no input tensor to take it from: `arange(s)` then `expand(b, s)`);
    * ("free",): a graph input of its own (`view(2 * b, ...)`, `arange(n)`);
    * ("const", v): -1, 0, 1, huge ints, and ints equal to a size of a parameter that are not
      a leaf's size (a model's width: `view(b, s, 3 * hidden)`; as a symbol it would be unified
      with the weight's size: guards and run-time Max/FloorDiv in indices) -- in a size list
      with a -1, even when they are a leaf's size too.

    A constant that merely equals a size in this call (a head count equal to the batch) is
    read as a size; `_free_ints` checks a pattern against every later call, so such a
    coincidence only costs a miss, never a wrong hit.  Parameters keep their sizes from call
    to call: they are never the source."""
    sizes: dict[int, tuple] = {}
    fixed: set[int] = set()            # sizes of parameters: a model's widths
    for i, t in enumerate(leaves):
        if type(t) is torch.nn.Parameter:
            fixed.update(t.shape)
        else:
            shape = t.shape
            for span in range(1, len(shape) + 1):
                for d in range(len(shape) - span + 1):
                    n = math.prod(shape[d:d + span])
                    if n >= 2 and n not in sizes:
                        sizes[n] = tuple((i, e) for e in range(d, d + span))
    seen: dict[int, int] = {}          # value -> first lifted (non-constant) int with it
    out: list[tuple] = []
    for j, (value, free_ok, index) in enumerate(cands):
        how: tuple = ("const", value)
        # Beside a -1 (`x.view(-1, x.size(-1))`: the -1 takes the batch dims) an int equal to
        # a model's width is that width: read as a leaf's size (GPT-2's 128 when batch x seq is
        # also 128) it would tie the weights' sizes to the batch in the guards, and kernels
        # over that width would loop over a symbolic size (slower, not vectorized).  Elsewhere a
        # leaf's size wins (a batch of 4 beside 4 channels per group).  Either way a
        # coincidence costs a compile, never a wrong hit.
        if 2 <= value < _MAX_FREE and (free_ok or value not in fixed):
            # (offsets only for indices: small sizes +-1 would match head counts too often)
            for off in (0, -1, 1) if index else (0,):
                if value - off in sizes:
                    how = ("leaf", sizes[value - off], off)
                    break
                if value - off in seen:
                    how = ("same", seen[value - off], off)
                    break
            else:
                if free_ok and value not in fixed:
                    how = ("free",)
        if how[0] != "const" and value not in seen:
            seen[value] = j
        out.append(how)
    return tuple(out)


def _int_values(pattern: tuple, leaf_sizes: Callable[[int, int], Any], free: Any) -> list:
    """The ints of a pattern: leaf sizes from `leaf_sizes(leaf, dim)` (symbolic while
    tracing), free ones from the iterator `free`."""
    vals: list = []
    for how in pattern:
        kind = how[0]
        if kind == "const":
            vals.append(how[1])
        elif kind == "free":
            vals.append(next(free))
        elif kind == "leaf":
            vals.append(math.prod(leaf_sizes(i, d) for i, d in how[1]) + how[2])
        else:
            vals.append(vals[how[1]] + how[2])
    return vals


def _free_ints(pattern: tuple, cands: list, leaves: list) -> list[int] | None:
    """The free ints of this call under `pattern`, or None if the call's ints do not follow it
    (a constant that differs, an int that is no longer that size)."""
    free = [c[0] for how, c in zip(pattern, cands) if how[0] == "free"]
    if any(v < 2 for v in free):          # traced as >= 2
        return None
    want = _int_values(pattern, lambda i, d: leaves[i].shape[d], iter(free))
    if len(want) != len(cands) or any(w != c[0] for w, c in zip(want, cands)):
        return None
    return free


def _tkey(template: Any) -> Any:
    """A hashable key of an argument template (Slots and IntSlots by kind, scalars by value)."""
    tp = type(template)
    if tp is Slot:
        return "\x00T"
    if tp is IntSlot:
        return "\x00I"
    if tp is list or tp is tuple:
        return (tp is list, tuple([_tkey(x) for x in template]))
    if tp is dict:
        return tuple((k, _tkey(v)) for k, v in template.items())
    if tp is float:
        return repr(template)
    return (tp, template)


def _abstract(order: list["LazyNode"], codes: list[list]) -> tuple[list, list, tuple]:
    """Replay steps with every int of a size-like argument lifted into an IntSlot, those ints
    (see _lift), and the size-free key."""
    cands: list = []
    steps = []
    key = []
    for n, refs in zip(order, codes):
        targs, tkwargs = n.targs, n.tkwargs
        names = _size_args(n.func)
        scalar = _SCALAR_SIZES.get(n.func)
        if names or scalar:
            positional = [a.name for a in n.func._schema.arguments if not a.kwarg_only]

            def lift(name: str, a: Any) -> Any:
                if name == scalar:
                    return _lift(a, cands, False, free_ok=False) if type(a) is int else a
                return _lift(a, cands, name in _INDEX_ARGS) if name in names else a
            targs = tuple(lift(positional[i], a) if i < len(positional) else a for i, a in enumerate(targs))
            tkwargs = {k: lift(k, v) for k, v in tkwargs.items()}
        steps.append((n.func, targs, tkwargs, n.container, refs))
        key.append((n.func, _tkey(targs), _tkey(tkwargs), tuple(refs)))
    return steps, cands, tuple(key)


def _guard_ok(c: Compiled, args: list) -> bool:
    from torch.fx.experimental.symbolic_shapes import SYMPY_INTERP
    try:
        return bool(eval(c.guard, SYMPY_INTERP, {"L": {f"t{i}": a for i, a in enumerate(args)}}))
    except Exception as e:        # a guard we cannot evaluate: compile afresh
        log.debug("lazy: guard evaluation failed: %s", e)
        return False


# --------------------------------------------------------------------------------------------
# compiling
# --------------------------------------------------------------------------------------------

def _compile(order: list["LazyNode"], steps: list, outs: tuple, leaves: list[torch.Tensor],
             pattern: tuple, ints: list[int], ctx: "LazyContext", symbolic: bool = True) -> Compiled:
    """Trace the replay of the pending ops into an aten graph and compile it with torchfuse:
    with symbolic sizes if the core can, else with static sizes."""
    from torch.fx.experimental.proxy_tensor import make_fx

    # imported at the first compile: `import torchfuse` does not load the compiler
    from ..frontend.decompositions import decomposition_table
    from ..pipeline import compile_graph, eager_fallback, try_compile_graph
    counters.bump("lazy_compiles")
    nleaves = len(leaves)

    def replay_of(steps: list, pattern: tuple = ()) -> Callable:
        # The replay holds only the ops and their constant arguments (no tensors), so the
        # cached entry built from it keeps no leaf alive.
        def replay(*vals: Any) -> tuple:
            leaf_vals, free = vals[:nleaves], iter(vals[nleaves:])
            for v in vals[nleaves:]:
                # free ints are >= 2 (see _pattern, _free_ints), like a tensor's sizes
                torch._check(v >= 2)
            int_vals = _int_values(pattern, lambda i, d: leaf_vals[i].shape[d], free)
            env: list[list] = []
            for func, targs, tkwargs, container, refs in steps:
                tensors = [env[r[0]][r[1]] if type(r) is tuple else leaf_vals[r] for r in refs]
                out = func(*fill(targs, tensors, int_vals), **fill(tkwargs, tensors, int_vals))
                env.append([out] if container is None else list(out))
            return tuple(env[i][k] for i, k in outs)
        return replay

    def traced(mode: str, replay: Callable, args: list) -> Any:
        with torch.no_grad(), _no_duck_shapes():
            # Detached: faking a parameter also fakes its `.grad`, which in a training step is
            # a LazyTensor still pending in the graph being compiled here.
            args = [a.detach() if isinstance(a, torch.Tensor) else a for a in args]
            return make_fx(replay, decomposition_table=decomposition_table(), tracing_mode=mode)(*args)

    # the nodes' own templates, nothing lifted: the static graph and the eager check of a symbolic one
    static_steps = [(n.func, n.targs, n.tkwargs, n.container, st[4]) for n, st in zip(order, steps)]
    replay = replay_of(static_steps)

    # 1. symbolic sizes: one graph for every size its guards accept
    report = Explanation()
    try:
        if not symbolic:
            raise RuntimeError("compiled with static sizes before")
        gm = traced("symbolic", replay_of(steps, pattern), [*leaves, *ints])
        vals = [n.meta.get("val") for n in gm.graph.nodes if n.op == "placeholder"]
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            call = try_compile_graph(gm, ctx.config, inference=True, kind="lazy", report=report)
        fallback = eager_fallback(call)
        if fallback is not None:
            raise RuntimeError(fallback.message)     # not final: the static attempt below decides
        for w in caught:
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
        guard = _guards(vals)
        _validate(call, replay, leaves, ints)
        return _done(Compiled(call, len(report.kernels), _name(report), True, guard, pattern), report, order, ctx)
    except Exception as e:
        # Also in strict mode: only the static attempt's failure is final.
        if symbolic:
            log.info("torchfuse.lazy: a graph of %d op(s) is compiled with static sizes (symbolic: %s)",
                     len(order), e)

    # 2. static sizes: this exact signature only (the nodes' own templates, nothing lifted)
    report = Explanation()
    try:
        gm = traced("fake", replay, list(leaves))
        call = compile_graph(gm, ctx.config, inference=True, kind="lazy", report=report)
    except Exception as e:
        if ctx.config.strict:
            raise
        # Tracing failed (a decomposition or meta function we do not handle): run the ops
        # eagerly, so the block still computes the right values, and say so once per graph.
        warnings.warn(f"torchfuse.lazy: a pending graph of {len(order)} op(s) runs eagerly: "
                      f"{type(e).__name__}: {e}")
        counters.bump("eager_fallbacks")

        def call(args: list) -> tuple:
            vals = list(args)
            args.clear()
            return replay(*vals)
        return Compiled(call, 0, "eager")
    return _done(Compiled(call, len(report.kernels), _name(report)), report, order, ctx)


def _no_duck_shapes() -> Any:
    """Trace with one symbol per input size even where two sizes are equal in this call
    (duck shaping would merge a batch of 4 with a head count of 4 and guard on their equality,
    so the next batch size misses the cache)."""
    import contextlib

    import torch.fx.experimental._config as fx_config
    if hasattr(fx_config, "use_duck_shape"):
        return fx_config.patch(use_duck_shape=False)
    return contextlib.nullcontext()


def _validate(call: Callable, replay: Callable, leaves: list, ints: list) -> None:
    """Run a freshly compiled symbolic graph once against the eager replay of its ops and raise
    if they disagree: symbolic sizes take code paths of the core that static sizes do not (e.g.
    negative slice starts on a symbolic dim), and a wrong kernel here would be reused for every
    size.  One eager run per compiled graph; the caller then compiles static sizes instead."""
    with torch.no_grad():
        got = list(call([*leaves, *ints]))
        want = replay(*leaves)
    for i, (a, b) in enumerate(zip(got, want)):
        if a.shape != b.shape or a.dtype != b.dtype:
            raise RuntimeError(f"symbolic graph output {i}: {a.dtype}{list(a.shape)}, eager {b.dtype}{list(b.shape)}")
        if a.numel() == 0:
            continue
        if a.is_floating_point():
            scale = float(b.detach().abs().nan_to_num(0, 0, 0).max())
            ok = torch.allclose(a, b, rtol=1e-3, atol=1e-4 * max(1.0, scale), equal_nan=True)
        else:
            ok = torch.equal(a, b)
        if not ok:
            raise RuntimeError(f"symbolic graph output {i} differs from eager")


def _guards(vals: list) -> Any:
    """Compiled guard expression over the placeholders (t0.. = leaves, then free lifted ints)."""
    shape_env = None
    for v in vals:
        if isinstance(v, torch.Tensor) and getattr(v, "fake_mode", None) is not None:
            shape_env = v.fake_mode.shape_env
            break
        if isinstance(v, torch.SymInt):
            shape_env = v.node.shape_env
            break
    if shape_env is None:
        return None
    code = shape_env.produce_guards_expression(vals, ignore_static=False)
    return compile(code or "True", "<torchfuse.lazy guards>", "eval")


def _name(report: Explanation) -> str:
    return report.graphs[0].split(":")[0].lstrip("# ") if report.graphs else "graph"


def _done(c: Compiled, report: Explanation, order: list, ctx: "LazyContext") -> Compiled:
    ctx._log_compile(report)
    log.debug("lazy: compiled %s with %d op(s), %d kernel(s)%s", c.graph, len(order), c.kernels,
              " (symbolic sizes)" if c.dynamic else "")
    return c
