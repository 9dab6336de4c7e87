"""Compiled graphs of lazy flushes, cached in two levels so that sizes are not part of the key.

* Level 1, `_EXACT`: the exact signature of a flush (ops and their scalar arguments, how nodes
  connect, dtype/size/stride/offset of every leaf) -> the compiled graph to call.  One dict
  lookup per flush: a loop that records the same step again (the common case) stops here.
* Level 2, `_SHAPES`: the same signature with the sizes left out (leaf dtypes and ranks only,
  and the integers of `size=`/`shape=` arguments, e.g. of `view`, lifted out of the key) ->
  graphs compiled with *symbolic* sizes (make_fx tracing_mode="symbolic"), each with the shape
  guards its tracing and compilation assumed (ShapeEnv.produce_guards_expression, statics
  included).  A level-1 miss whose guards pass reuses that graph: a new batch size compiles
  nothing and builds no kernel; only shapes that break a guard (e.g. a size 1 where the graph
  was traced with a size > 1) compile again.
* A graph the core cannot compile with symbolic sizes (a lowering that needs a static size)
  is compiled once more with static sizes and cached in level 1 only.

Both levels are LRU-bounded by the block's `Config.memory_cache_size`.  Counters:
`lazy_cache_hits` (level 1), `lazy_shape_hits` (level 2), `lazy_compiles` (graphs compiled).
"""
from __future__ import annotations

import logging
import warnings
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

import torch

from ..api import Explanation
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
    """Placeholder for the j-th lifted integer of a graph (a `size=` element) in a template."""
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
    """One compiled aten graph.  `dynamic`: traced with symbolic sizes and called with the
    lifted ints after the leaves; `guard`: compiled guard expression over (leaves, ints)."""
    call: Callable
    kernels: int
    graph: str
    dynamic: bool = False
    guard: Any = None


@dataclass
class Entry:
    """A level-1 entry: a compiled graph for one exact signature."""
    compiled: Compiled
    ints: tuple = ()                     # lifted ints of this signature (dynamic graphs only)
    checked: bool = False                # outputs checked once (aliasing, dtype, layout)
    copy_outputs: tuple[int, ...] = ()   # outputs aliasing a leaf or another output: copied
    fixes: tuple = ()                    # (output, "dtype"/"layout") conversions eager needs
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
    _EXACT.clear()
    _SHAPES.clear()
    _STATIC_ONLY.clear()
    _SEEN.clear()


def cache_sizes() -> tuple[int, int]:
    """(level-1 entries, level-2 signatures): for tests and debugging."""
    return len(_EXACT), len(_SHAPES)


def _bound(cache: OrderedDict, limit: int) -> None:
    while len(cache) > max(1, limit):
        cache.popitem(last=False)


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
    steps, ints, akey = _abstract(order, codes)
    skey = (sig[0], device, tuple((t.dtype, t.dim()) for t in leaves), akey, outs)
    variants = _SHAPES.get(skey)
    if variants is not None:
        args = [*leaves, *ints]
        for c in variants:
            if _guard_ok(c, args):
                _SHAPES.move_to_end(skey)
                counters.bump("lazy_shape_hits")
                entry = _EXACT[sig] = Entry(c, tuple(ints))
                _bound(_EXACT, limit)
                return entry, True
    # ctx.dynamic: True compiles symbolic sizes from the first size on; None ("auto", like
    # Dynamo's automatic dynamic shapes) compiles static sizes first -- faster C++ kernels --
    # and symbolic ones once a second size of the same structure shows up; False never.
    dynamic = getattr(ctx, "dynamic", True)
    symbolic = skey not in _STATIC_ONLY and (dynamic is True or (dynamic is None and skey in _SEEN))
    _SEEN[skey] = None
    _bound(_SEEN, limit)
    compiled = _compile(order, steps, outs, leaves, ints, ctx, symbolic=symbolic)
    if not compiled.dynamic and symbolic:
        # The core could not (or not correctly) compile this structure with symbolic sizes:
        # do not try again for its other sizes.
        _STATIC_ONLY[skey] = None
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


def _size_args(func: Any) -> frozenset:
    """Names of the `SymInt[] size` / `SymInt[] shape` arguments of an op (view, reshape,
    expand, new_zeros, full, ...): lifted into graph inputs so that a new batch size does not
    change the signature.  Index-like SymInts (slice bounds, select index) stay constants: the
    core lowers some of them only with static values."""
    names = _SIZE_ARGS.get(func)
    if names is None:
        names = frozenset()
        try:
            from torchgen.model import FunctionSchema
            schema = FunctionSchema.parse(str(func._schema))
            args = schema.arguments.flat_all
            names = frozenset(a.name for a in args if str(a.type) in ("SymInt[]", "SymInt[]?")
                              and a.name in ("size", "shape"))
        except Exception as e:      # an op whose schema torchgen cannot parse: lift nothing
            log.debug("lazy: schema of %s: %s", func, e)
        _SIZE_ARGS[func] = names
    return names


def _lift(value: Any, ints: list) -> Any:
    tp = type(value)
    if tp is int:
        ints.append(value)
        return IntSlot(len(ints) - 1)
    if tp is list or tp is tuple:
        return tp([_lift(x, ints) for x in value])
    return value


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


def _abstract(order: list["LazyNode"], codes: list[list]) -> tuple[list, list[int], tuple]:
    """Replay steps with lifted size integers, the lifted integers, and the size-free key."""
    ints: list[int] = []
    steps = []
    key = []
    for n, refs in zip(order, codes):
        targs, tkwargs = n.targs, n.tkwargs
        names = _size_args(n.func)
        if names:
            positional = [a.name for a in n.func._schema.arguments if not a.kwarg_only]
            targs = tuple(_lift(a, ints) if i < len(positional) and positional[i] in names else a
                          for i, a in enumerate(targs))
            tkwargs = {k: _lift(v, ints) if k in names else v for k, v in tkwargs.items()}
        steps.append((n.func, targs, tkwargs, n.container, refs))
        key.append((n.func, _tkey(targs), _tkey(tkwargs), tuple(refs)))
    return steps, ints, tuple(key)


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
             ints: list[int], ctx: "LazyContext", symbolic: bool = True) -> Compiled:
    """Trace the replay of the pending ops into an aten graph and compile it with torchfuse:
    with symbolic sizes if the core can, else with static sizes."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from ..frontend.decompositions import decomposition_table
    from ..runtime.compiled_graph import compile_graph
    counters.bump("lazy_compiles")
    nleaves = len(leaves)

    def replay_of(steps: list) -> Callable:
        # The replay holds only the ops and their constant arguments (no tensors), so the
        # cached entry built from it keeps no leaf alive.
        def replay(*vals: Any) -> tuple:
            leaf_vals, int_vals = vals[:nleaves], vals[nleaves:]
            env: list[list] = []
            for func, targs, tkwargs, container, refs in steps:
                tensors = [env[r[0]][r[1]] if type(r) is tuple else leaf_vals[r] for r in refs]
                out = func(*fill(targs, tensors, int_vals), **fill(tkwargs, tensors, int_vals))
                env.append([out] if container is None else list(out))
            return tuple(env[i][k] for i, k in outs)
        return replay

    def traced(mode: str, steps: list, args: list) -> Any:
        with torch.no_grad():
            return make_fx(replay_of(steps), decomposition_table=decomposition_table(), tracing_mode=mode)(*args)

    # 1. symbolic sizes: one graph for every size its guards accept
    report = Explanation()
    try:
        if not symbolic:
            raise RuntimeError("compiled with static sizes before")
        gm = traced("symbolic", steps, [*leaves, *ints])
        vals = [n.meta.get("val") for n in gm.graph.nodes if n.op == "placeholder"]
        before = counters["eager_fallbacks"]
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            call = compile_graph(gm, ctx.config, inference=True, kind="lazy", report=report)
        if counters["eager_fallbacks"] != before:
            # not final: the static attempt below decides
            counters.bump("eager_fallbacks", before - counters["eager_fallbacks"])
            raise RuntimeError("; ".join(str(w.message) for w in caught) or "eager fallback")
        for w in caught:
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
        guard = _guards(vals)
        static_steps = [(n.func, n.targs, n.tkwargs, n.container, st[4]) for n, st in zip(order, steps)]
        _validate(call, replay_of(static_steps), leaves, ints)
        return _done(Compiled(call, len(report.kernels), _name(report), True, guard), report, order, ctx)
    except Exception as e:
        # Also in strict mode: only the static attempt's failure is final.
        if symbolic:
            log.info("torchfuse.lazy: a graph of %d op(s) is compiled with static sizes (symbolic: %s)",
                     len(order), e)

    # 2. static sizes: this exact signature only (the nodes' own templates, nothing lifted)
    report = Explanation()
    steps = [(n.func, n.targs, n.tkwargs, n.container, step[4]) for n, step in zip(order, steps)]
    replay = replay_of(steps)
    try:
        gm = traced("fake", steps, list(leaves))
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
    """Compiled guard expression over the placeholders (t0.. = leaves, then lifted ints)."""
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
