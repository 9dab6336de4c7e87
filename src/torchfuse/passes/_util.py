"""Helpers shared by the graph passes: purity (what may be removed or merged) and aliasing.

The aliasing helpers exist because every rewrite that replaces a node N by another node R
changes which tensors share memory.  Eager gave N fresh storage (or a view of some base);
after the rewrite N's users and, worse, the graph's outputs see R's storage.  That is only
invisible to the program when nobody outside the graph can observe the two storages at once.
"""
from __future__ import annotations

import functools
import operator
from typing import Any, Iterable

import torch
import torch.fx as fx
from torch.fx.experimental.symbolic_shapes import free_symbols

# Substrings of op names that draw from the RNG.  Most such ops carry the
# `nondeterministic_seeded` tag; the names catch the few that do not (e.g. prims.inductor_random).
_RANDOM_WORDS = ("rand", "bernoulli", "dropout", "normal", "uniform", "multinomial", "poisson",
                 "exponential", "geometric", "cauchy", "rrelu")
# These write their running statistics in place when `training` (args[5]) is true, although
# their schemas do not say so.
_MUTATES_WHEN_TRAINING = {"batch_norm", "native_batch_norm", "instance_norm", "_batch_norm_impl_index",
                          "cudnn_batch_norm", "miopen_batch_norm"}
# Allocations with unspecified contents: two of them are never "the same value".
EMPTY_OPS = {"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "empty_permuted"}
# Ops whose result shares storage with their input although the schema does not say so.
_UNANNOTATED_VIEWS = {"_unsafe_view"}
_PURE_MODULES = {"_operator", "operator", "math"}
# Checks whose only effect is to raise: removing an unused one would drop the check.
_ASSERT_PREFIXES = ("_assert", "_functional_assert", "sym_constrain_range", "_functional_sym_constrain",
                    "_print", "record_stream")
_FX_SIDE_EFFECTS = getattr(fx.node, "_side_effectful_functions", set())


def op_name(target: Any) -> str:
    """'mul' for aten.mul.Tensor; '' for targets that are not ops."""
    if isinstance(target, torch._ops.OpOverload):
        return target._schema.name.split("::")[-1]
    return ""


@functools.lru_cache(maxsize=None)
def _op_random(op: torch._ops.OpOverload) -> bool:
    return torch.Tag.nondeterministic_seeded in op.tags or any(w in op_name(op) for w in _RANDOM_WORDS)


def _op_impure(op: torch._ops.OpOverload, node: fx.Node) -> bool:
    """Argument-independent impurity of an op; cached in _OP_IMPURE (asked for every node).
    fx's `node.is_impure()` looks only at the target for an OpOverload."""
    maybe_mutating = getattr(torch.Tag, "maybe_aliasing_or_mutating", None)
    return (op._schema.is_mutable or _op_random(op) or node.is_impure()  # fx: effects
            or op_name(op).startswith(_ASSERT_PREFIXES)
            or (maybe_mutating is not None and maybe_mutating in op.tags)
            or op.namespace in ("_c10d_functional", "c10d_functional"))  # collectives / waits


def is_random(node: fx.Node) -> bool:
    return isinstance(node.target, torch._ops.OpOverload) and _op_random(node.target)


def is_impure(node: fx.Node) -> bool:
    """True for nodes that DCE must keep and CSE must not merge (side effects or randomness)."""
    if node.op in ("placeholder", "output"):
        return True
    if node.op == "get_attr":
        return False
    if node.op != "call_function":
        return True  # call_module / call_method do not occur in aten graphs; stay conservative
    t = node.target
    if t is operator.getitem:
        return False
    if t in _FX_SIDE_EFFECTS:  # operator.setitem, torch._assert, autocast enter/exit, ...
        return True
    if isinstance(t, torch._ops.OpOverload):
        if t not in _OP_IMPURE:
            _OP_IMPURE[t] = _op_impure(t, node)
        if _OP_IMPURE[t]:
            return True
        return op_name(t) in _MUTATES_WHEN_TRAINING and not (len(node.args) > 5 and node.args[5] is False)
    if getattr(t, "__module__", None) in _PURE_MODULES:
        return False  # SymInt arithmetic (operator.mul, math.ceil, ...)
    if getattr(t, "__name__", "").startswith("sym_") and getattr(t, "__module__", "").startswith("torch"):
        return False  # torch.sym_max, torch.sym_float, ...
    return True  # higher-order ops and unknown Python callables: keep, never merge


_OP_IMPURE: dict[torch._ops.OpOverload, bool] = {}


def is_mutating(node: fx.Node) -> bool:
    """Nodes that may write memory (so values read before and after them may differ).
    Random ops and asserts are impure but write nothing a pure value can read."""
    t = node.target
    if node.op != "call_function" or t is operator.getitem:
        return False
    if isinstance(t, torch._ops.OpOverload):
        maybe_mutating = getattr(torch.Tag, "maybe_aliasing_or_mutating", None)
        return (t._schema.is_mutable or (maybe_mutating is not None and maybe_mutating in t.tags)
                or t.namespace in ("_c10d_functional", "c10d_functional")
                or (op_name(t) in _MUTATES_WHEN_TRAINING and is_impure(node)))
    return is_impure(node)


def written_args(node: fx.Node) -> list[fx.Node]:
    """The input nodes that `node` may write into."""
    if not is_mutating(node):
        return []
    t = node.target
    if isinstance(t, torch._ops.OpOverload) and t._schema.is_mutable:
        out = []
        for i, a in enumerate(t._schema.arguments):
            if a.alias_info is not None and a.alias_info.is_write:
                v = node.args[i] if i < len(node.args) else node.kwargs.get(a.name)
                out += [n for n in flat_nodes(v)]
        return out
    return flat_nodes((node.args, node.kwargs))  # unknown effect: assume it writes every input


def flat_nodes(a: Any) -> list[fx.Node]:
    out: list[fx.Node] = []
    fx.node.map_arg(a, out.append)
    return out


# ---- aliasing -------------------------------------------------------------------------------
def alias_input(node: fx.Node) -> fx.Node | None:
    """The input whose storage `node`'s result may share (None: the result is fresh memory)."""
    if node.op != "call_function":
        return None
    t = node.target
    if t is operator.getitem:
        # an element of split()/unbind() is a view of their input; of max.dim() etc. it is fresh
        base = node.args[0]
        return alias_input(base) if isinstance(base, fx.Node) else None
    if not isinstance(t, torch._ops.OpOverload):
        return None
    i, name = _aliased_arg(t)
    if i is None:
        return None
    v = node.args[i] if i < len(node.args) else node.kwargs.get(name)
    return v if isinstance(v, fx.Node) else None


@functools.lru_cache(maxsize=None)
def _aliased_arg(op: torch._ops.OpOverload) -> tuple[int | None, str]:
    """(index, name) of the argument an op's result may alias, from its schema's alias info."""
    schema, unannotated = op._schema, op_name(op) in _UNANNOTATED_VIEWS
    if not unannotated and not any(r.alias_info is not None for r in schema.returns):
        return None, ""
    for i, a in enumerate(schema.arguments):
        if a.alias_info is not None or unannotated:
            return i, a.name
    return None, ""


def alias_root(node: fx.Node) -> fx.Node:
    """The node that owns the storage `node` lives in (itself unless it is a view)."""
    while (base := alias_input(node)) is not None:
        node = base
    return node


def _direct_base(u: fx.Node) -> fx.Node | None:
    """The node `u` is a view of, one step up (for getitem: the split()/unbind() node)."""
    if alias_input(u) is None:
        return None
    return u.args[0] if u.target is operator.getitem else alias_input(u)


def alias_tree(node: fx.Node) -> set[fx.Node]:
    """`node` and every view taken (transitively) from it."""
    seen, stack = {node}, [node]
    while stack:
        cur = stack.pop()
        for u in cur.users:
            if u not in seen and _direct_base(u) is cur:
                seen.add(u)
                stack.append(u)
    return seen


def output_values(graph: fx.Graph) -> set[fx.Node]:
    outs = graph.find_nodes(op="output")
    return set(flat_nodes(outs[0].args)) if outs else set()


def is_written(nodes: Iterable[fx.Node]) -> bool:
    nodes = set(nodes)
    return any(n in nodes for m in nodes for u in m.users for n in written_args(u))


def can_forward(node: fx.Node, repl: fx.Node) -> bool:
    """May every use of `node` read `repl` instead without creating aliasing eager did not have?"""
    outs = output_values(node.graph)
    root_r = alias_root(repl)
    if node in outs:
        # two outputs would become one tensor object, or an output would be (a view of) an input
        if repl in outs or root_r.op in ("placeholder", "get_attr"):
            return False
    root_n = alias_root(node)
    if root_n is root_r:
        return True  # node is already a view into repl's storage: no new sharing
    moved, target = alias_tree(node), alias_tree(root_r)
    visible_r = root_r.op in ("placeholder", "get_attr") or bool(target & outs)
    if moved & outs and visible_r:
        return False  # an output would now share memory with an input, constant or other output
    # node's users would now read storage someone writes (or write into repl's storage)
    return not (is_written(moved | alias_tree(root_n)) or is_written(target))


def is_foldable(node: fx.Node) -> bool:
    """Could this node be computed ahead of the call from its inputs' values alone?  A pure op
    (not random, mutating or an allocation of unspecified contents) without symbolic sizes
    (constant folding; hoisting parameter-only values out of inference calls)."""
    if node.op != "call_function" or is_impure(node) or has_symbols(node.meta.get("val")):
        return False
    if node.target is operator.getitem:
        return True
    return isinstance(node.target, torch._ops.OpOverload) and op_name(node.target) not in EMPTY_OPS


def has_symbols(val: Any) -> bool:
    if isinstance(val, (tuple, list)):
        return any(has_symbols(v) for v in val)
    if isinstance(val, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        return True
    return isinstance(val, torch.Tensor) and bool(free_symbols(val))
