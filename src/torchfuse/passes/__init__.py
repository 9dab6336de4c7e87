"""Aten graph passes: cleanups on the aten-level FX graph before it is lowered to loop IR.

    records = run_passes(gm, ("dce", "cse", "constant_fold", "simplify", "conv_bn_fold", "dce"),
                         PassContext(inference=True))

Every pass is a function `(gm, ctx) -> number of changes` that rewrites `gm.graph` in place
and keeps `node.meta["val"]` correct on every node it creates (the lowering reads it).
`run_passes` is the tiny pass manager: it times each pass, records node counts, logs each
record at DEBUG on the "torchfuse.passes" logger, and lints and recompiles the module at the end.
"""
from __future__ import annotations

import logging
import time
import warnings
from typing import Any, Callable, Sequence

import torch.fx

from ..config import Config

# Imported under private names so that `torchfuse.passes.cse` etc. stay the submodules.
from .channels_last import channels_last_convs as _channels_last_convs
from .constant_fold import constant_fold as _constant_fold
from .context import PassContext, PassRecord
from .conv_bn_fold import conv_bn_fold as _conv_bn_fold
from .cse import cse as _cse
from .dce import dce as _dce
from .index_add import accumulate_by_index_add as _accumulate_by_index_add
from .merge_step_sums import merge_step_sums as _merge_step_sums
from .pad_mm import pad_mm as _pad_mm
from .unfuse_bias import unfuse_addmm as _unfuse_addmm
from .unfuse_bias import unfuse_conv_bias as _unfuse_conv_bias
from .simplify import simplify as _simplify
from .strided_1x1_grads import strided_1x1_grads as _strided_1x1_grads

__all__ = ["REGISTRY", "PassContext", "PassRecord", "run_passes", "DEFAULT_PIPELINE"]

log = logging.getLogger("torchfuse.passes")

Pass = Callable[[torch.fx.GraphModule, PassContext], int]

REGISTRY: dict[str, Pass] = {
    "dce": _dce,
    "cse": _cse,
    "constant_fold": _constant_fold,
    "simplify": _simplify,
    "merge_step_sums": _merge_step_sums,
    "conv_bn_fold": _conv_bn_fold,
    "channels_last_convs": _channels_last_convs,
    "pad_mm": _pad_mm,
    "unfuse_addmm": _unfuse_addmm,
    "unfuse_conv_bias": _unfuse_conv_bias,
    "strided_1x1_grads": _strided_1x1_grads,
    "accumulate_by_index_add": _accumulate_by_index_add,
}

def check_names(passes: tuple) -> None:
    """Raise ValueError for a pass name that is neither built in nor registered (`passes`:
    Config.passes, names and callables)."""
    unknown = [v for v in passes if isinstance(v, str) and v not in REGISTRY]
    if unknown:
        raise ValueError(f"torchfuse: option passes: unknown pass(es) {unknown}; valid passes are {sorted(REGISTRY)}")


# the pipeline a default Config runs (one list: Config.passes)
DEFAULT_PIPELINE: tuple[str, ...] = Config.passes


def run_passes(gm: torch.fx.GraphModule, names: Sequence[Any], ctx: PassContext) -> list[PassRecord]:
    """Run the passes `names` (registered names, callables `(gm, ctx) -> changes`, or
    torch.fx PassBase instances), in order, on `gm`; return one record per pass run.  A pass
    that is not one of torchfuse's own and raises or breaks the graph is undone, with a warning."""
    if isinstance(names, str):  # a bare string would otherwise be run letter by letter
        names = (names,)
    unknown = [n for n in names if isinstance(n, str) and n not in REGISTRY]
    if unknown:  # check everything up front so that a typo never leaves a half-rewritten graph
        raise ValueError(f"torchfuse: unknown graph pass(es) {unknown}; valid passes are {sorted(REGISTRY)}")
    records: list[PassRecord] = []
    for item in names:
        name, fn = _resolve(item)
        before = len(gm.graph.nodes)
        start = time.perf_counter()
        if fn in _OWN:
            changes = fn(gm, ctx)
        else:
            changes = _run_user_pass(name, fn, gm, ctx)
        record = PassRecord(name, time.perf_counter() - start, before, len(gm.graph.nodes), int(changes))
        log.debug("%s", record)
        records.append(record)
    gm.graph.lint()
    gm.recompile()
    return records


_OWN = frozenset(REGISTRY.values())


def _resolve(item: Any) -> tuple[str, Callable]:
    """(name, fn(gm, ctx) -> changes) for a pass given by name, as a callable, or as a PassBase."""
    if isinstance(item, str):
        return item, REGISTRY[item]
    from torch.fx.passes.infra.pass_base import PassBase
    if isinstance(item, PassBase):
        def run(gm: torch.fx.GraphModule, ctx: PassContext, p: PassBase = item) -> int:
            result = p(gm)
            if result is not None and result.graph_module is not gm:     # a new module: take its graph
                gm.graph = result.graph_module.graph
            return int(bool(result.modified)) if result is not None else 0
        return type(item).__name__, run
    if callable(item):
        return getattr(item, "__name__", type(item).__name__), item
    raise ValueError(f"torchfuse: a graph pass must be a registered name, a callable (gm, ctx) -> changes or a "
                     f"torch.fx PassBase, not {item!r}")


def _run_user_pass(name: str, fn: Callable, gm: torch.fx.GraphModule, ctx: PassContext) -> int:
    """Run a pass torchfuse does not own; on an exception or a graph that does not lint, warn
    and put the graph back as it was."""
    saved = torch.fx.Graph()
    saved.output(saved.graph_copy(gm.graph, {}))
    try:
        changes = fn(gm, ctx)
        gm.graph.lint()
        outputs = [n for n in gm.graph.nodes if n.op == "output"]
        if len(outputs) != 1:
            raise RuntimeError(f"the graph has {len(outputs)} output nodes")
        unknown = [n.name for n in gm.graph.nodes if n.op == "call_function" and "val" not in n.meta]
        if unknown:      # the lowering reads every node's fake value
            raise RuntimeError(f"nodes without meta['val']: {unknown[:5]}")
        return int(changes or 0)
    except Exception as e:
        warnings.warn(f"torchfuse: graph pass {name!r} failed ({type(e).__name__}: {str(e).splitlines()[0][:200]}); "
                      "it was undone and compilation goes on without it")
        gm.graph = saved
        return 0
