"""Constant folding: compute at compile time what depends on nothing but constants.

Constants are `get_attr` tensors (tensor literals; not parameters, which an optimizer may
update between calls) and pure ops over constants, including constructors with no tensor
inputs (`full`, `arange`, `scalar_tensor`, ...).  Values are computed with the real ATen op,
so the folded result is bit-identical to what eager would have computed.

Only the *frontier* is materialized: a computed constant some non-constant node reads.  It
becomes a `get_attr` of a fresh buffer `_tf_const_N`.  What is deliberately left alone:
  * results above MAX_NUMEL elements: a large `full` stays a lazy constructor the lowering
    turns into an index expression instead of a buffer read;
  * the constructors themselves, for the same reason (folding `full` would only add a buffer);
  * views: a view's identity is its base, and a separate buffer would break that sharing;
  * anything with symbolic shapes, random or mutating ops, `empty` (undefined contents);
  * values that escape through the graph's outputs: the caller would receive (a view of) a
    buffer owned by the compiled module and could corrupt it for the next call.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import FakeTensor, unset_fake_temporarily

from ._meta import fake_mode_of, same_seq
from ._util import alias_input, alias_tree, flat_nodes, is_foldable, is_written, output_values
from .context import PassContext

MAX_NUMEL = 1024


def _small(v: Any) -> bool:
    if isinstance(v, torch.Tensor):
        return v.numel() <= MAX_NUMEL and v.layout == torch.strided
    return isinstance(v, (tuple, list)) and all(isinstance(x, torch.Tensor) and _small(x) for x in v)


def _matches(real: Any, fake: Any) -> bool:
    """Does the computed value have the shape/dtype the graph's metadata promised?"""
    if isinstance(real, torch.Tensor) and isinstance(fake, torch.Tensor):
        return real.dtype == fake.dtype and same_seq(real.shape, fake.shape)
    if isinstance(real, (tuple, list)) and isinstance(fake, (tuple, list)) and len(real) == len(fake):
        return all(_matches(r, f) for r, f in zip(real, fake))
    return False


def _constant_attr(gm: fx.GraphModule, target: str) -> torch.Tensor | None:
    obj: Any = gm
    for part in target.split("."):
        obj = getattr(obj, part, None)
    if not isinstance(obj, torch.Tensor) or isinstance(obj, (torch.nn.Parameter, FakeTensor)):
        return None
    return None if obj.requires_grad else obj


def _evaluate(gm: fx.GraphModule) -> dict[fx.Node, Any]:
    """Real values of every constant node (get_attrs, and small computed values)."""
    env: dict[fx.Node, Any] = {}
    for node in gm.graph.nodes:
        if node.op == "get_attr":
            t = _constant_attr(gm, node.target)
            if t is not None:
                env[node] = t
            continue
        # the cheap test first: most nodes read a graph input somewhere
        if not all(n in env for n in flat_nodes((node.args, node.kwargs))) or not is_foldable(node):
            continue
        args, kwargs = fx.node.map_arg((node.args, node.kwargs), env.__getitem__)
        try:
            value = node.target(*args, **kwargs)
        except Exception:  # e.g. an op with no kernel for this device: leave it to runtime
            continue
        if _small(value) and _matches(value, node.meta.get("val")):
            env[node] = value
    return env


def _fresh_name(gm: fx.GraphModule) -> str:
    i = 0
    while hasattr(gm, f"_tf_const_{i}"):
        i += 1
    return f"_tf_const_{i}"


def _materializable(node: fx.Node, value: Any, outs: set[fx.Node]) -> bool:
    if node.op == "get_attr" or not isinstance(value, torch.Tensor):
        return False  # already a constant / a tuple (its getitems get folded instead)
    if not flat_nodes((node.args, node.kwargs)) or alias_input(node) is not None:
        return False  # a constructor (keep it lazy) or a view (keep its base)
    tree = alias_tree(node)
    return not (tree & outs or is_written(tree))


def _choose(env: dict[fx.Node, Any], outs: set[fx.Node]) -> list[fx.Node]:
    """The constants to turn into buffers: those some remaining computation still reads.

    Walking users before producers: a constant is needed if a non-constant node reads it, or a
    constant that stays in the graph does (a view, constructor or escaping value).  A needed
    constant that can be materialized is; its own inputs are then no longer needed through it.
    """
    kept: set[fx.Node] = set()
    chosen: list[fx.Node] = []
    for node in reversed(list(env)):
        if not any(u not in env or u in kept for u in node.users):
            continue  # dead, or read only by constants that become buffers
        if _materializable(node, env[node], outs):
            chosen.append(node)
        else:
            kept.add(node)
    return chosen


def constant_fold(gm: fx.GraphModule, ctx: PassContext) -> int:
    """Replace needed constant computations by buffers; return how many were replaced."""
    graph = gm.graph
    with unset_fake_temporarily(), torch.no_grad():
        env = _evaluate(gm)
        chosen = _choose(env, output_values(graph))
        mode = fake_mode_of(graph) if chosen else None
        for node in chosen:
            value, fake = env[node], node.meta["val"]
            # Lay the buffer out exactly as the metadata says, so downstream strides stay valid.
            buf = torch.empty_strided(value.shape, fake.stride(), dtype=value.dtype, device=value.device)
            buf.copy_(value)
            name = _fresh_name(gm)
            gm.register_buffer(name, buf)
            with graph.inserting_before(node):
                attr = graph.get_attr(name)
            attr.meta.update({k: v for k, v in node.meta.items() if k not in ("val", "tensor_meta")})
            attr.meta["val"] = mode.from_tensor(buf, static_shapes=True)
            node.replace_all_uses_with(attr)
    # The folded computations are now dead; erase them (users first) so the graph shrinks.
    for node in reversed(list(env)):
        if node.op == "call_function" and not node.users:
            graph.erase_node(node)
    return len(chosen)
