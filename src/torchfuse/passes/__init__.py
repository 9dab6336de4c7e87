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
from typing import Callable, Sequence

import torch.fx

# Imported under private names so that `torchfuse.passes.cse` etc. stay the submodules.
from .constant_fold import constant_fold as _constant_fold
from .context import PassContext, PassRecord
from .conv_bn_fold import conv_bn_fold as _conv_bn_fold
from .cse import cse as _cse
from .dce import dce as _dce
from .pad_mm import pad_mm as _pad_mm
from .unfuse_bias import unfuse_addmm as _unfuse_addmm
from .unfuse_bias import unfuse_conv_bias as _unfuse_conv_bias
from .simplify import simplify as _simplify

__all__ = ["REGISTRY", "PassContext", "PassRecord", "run_passes", "DEFAULT_PIPELINE"]

log = logging.getLogger("torchfuse.passes")

Pass = Callable[[torch.fx.GraphModule, PassContext], int]

REGISTRY: dict[str, Pass] = {
    "dce": _dce,
    "cse": _cse,
    "constant_fold": _constant_fold,
    "simplify": _simplify,
    "conv_bn_fold": _conv_bn_fold,
    "pad_mm": _pad_mm,
    "unfuse_addmm": _unfuse_addmm,
    "unfuse_conv_bias": _unfuse_conv_bias,
}

DEFAULT_PIPELINE: tuple[str, ...] = ("dce", "cse", "constant_fold", "simplify", "conv_bn_fold", "pad_mm", "unfuse_addmm", "unfuse_conv_bias",
                                     "dce")


def run_passes(gm: torch.fx.GraphModule, names: Sequence[str], ctx: PassContext) -> list[PassRecord]:
    """Run the passes called `names`, in order, on `gm`; return one record per pass run."""
    if isinstance(names, str):  # a bare string would otherwise be run letter by letter
        names = (names,)
    unknown = [n for n in names if n not in REGISTRY]
    if unknown:  # check everything up front so that a typo never leaves a half-rewritten graph
        raise ValueError(f"torchfuse: unknown graph pass(es) {unknown}; valid passes are {sorted(REGISTRY)}")
    records: list[PassRecord] = []
    for name in names:
        before = len(gm.graph.nodes)
        start = time.perf_counter()
        changes = REGISTRY[name](gm, ctx)
        record = PassRecord(name, time.perf_counter() - start, before, len(gm.graph.nodes), int(changes))
        log.debug("%s", record)
        records.append(record)
    gm.graph.lint()
    gm.recompile()
    return records
