"""Dead code elimination: drop pure nodes whose results nobody reads.

fx's own `Graph.eliminate_dead_code` is not used because its notion of purity differs between
torch versions; ours (see `_util.is_impure`) keeps every op that mutates memory (the
`copy_` nodes AOTAutograd appends for input mutations), draws random numbers (removing a dead
`rand` would shift the RNG stream seen by later random ops), asserts, or is unknown to us.
"""
from __future__ import annotations

import torch.fx as fx

from ._util import is_impure
from .context import PassContext


def dce(gm: fx.GraphModule, ctx: PassContext) -> int:
    """Erase dead pure nodes; return how many were erased."""
    removed = 0
    # Walking backwards sees a node only after all of its users, so whole dead chains
    # (including a tuple-producing op and its getitems) go in one sweep.
    for node in reversed(list(gm.graph.nodes)):
        if node.users or is_impure(node):  # placeholders and output are impure by definition
            continue
        gm.graph.erase_node(node)
        removed += 1
    return removed
