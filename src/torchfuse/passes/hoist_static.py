"""Hoist values computed from parameters alone out of the per-call path of an inference graph.

After AOTAutograd, parameters and buffers are graph inputs, so everything computed from them
alone runs on every call: the folded weight and bias of every conv-bn pair, weight casts under
autocast, position-bias tables, rotary tables.  Their results change only when a
parameter does.  This pass cuts such a graph in two:

    const_gm(static inputs)             -> the hoisted values (run when a parameter changed)
    main_gm(inputs..., hoisted values)  -> the graph's outputs (run on every call)

The caller (`runtime.static_values.StaticPrologue`) keeps the hoisted values and recomputes
them only when one of the static inputs they read changed: its version counter (bumped by
every in-place write, optimizer steps and `load_state_dict` included) or its storage (a
`param.data = ...` swap).  With `Config.freezing` the check is skipped: parameters are taken
as constants, as Inductor's freezing does.

What is hoisted: the *frontier* of the parameter-only region, i.e. the values some per-call
node reads, excluding
  * views of a parameter (free to recompute; a hoisted copy would only cost memory),
  * broadcasts: a value EXPANSION times larger than the parameters and buffers it is computed
    from (a Swin window attention's position bias added to its shift mask, [windows, heads, 49,
    49] from a [heads, 49, 49] table: 127 MiB held between calls at batch 32; a rotary cos/sin
    table, [positions, head_dim] from a [head_dim / 2] frequency buffer), or a gather larger
    than what it reads; its inputs are hoisted instead and the value is recomputed where it is
    read (so is a T5 bias gathered from its bucket table into [heads, q, k]).  Measured against
    the sources, not the step's own inputs: the rotary table grows in steps (outer product,
    cat, cos), none of them more than 2x, and held it raised Llama's peak above Inductor's,
    whose peak at the logits no longer holds it,
  * values the graph returns or writes (the caller would see or corrupt the cached tensor),
  * anything random, mutating, with symbolic sizes, or not a plain strided tensor.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx as fx

from ._util import alias_input, alias_tree, flat_nodes, is_foldable, is_impure, is_written, output_values


@dataclass
class HoistedValues:
    """The parameter-only part cut out of a graph: `const_gm(*[args[i] for i in positions])`
    returns the values `main_gm` takes as its trailing inputs."""

    const_gm: fx.GraphModule
    positions: list[int]       # indices of the static inputs const_gm reads, in the caller's args
    names: list[str]           # the hoisted nodes' names, for reports
    numel: int                 # elements held by the hoisted values

    def describe(self) -> str:
        shown = ", ".join(self.names[:8]) + (", ..." if len(self.names) > 8 else "")
        return (f"{len(self.names)} value(s) computed from {len(self.positions)} parameter/buffer input(s) "
                f"hoisted out of the per-call path ({self.numel} elements): {shown}")


EXPANSION = 2
_SMALL = 1 << 12      # elements: a value this small is held whatever it is computed from (16 KiB fp32)
# A gather only selects: its reader can gather in its own kernel for the same reads a held copy
# would cost, so a gathered value larger than what it reads is not held (OPT's learned position
# embedding gathered for every sequence of the batch: 6 MiB held, 2.0x its table, at batch 8).
_GATHERS = {torch.ops.aten.index.Tensor, torch.ops.aten._unsafe_index.Tensor, torch.ops.aten.embedding.default,
            torch.ops.aten.gather.default, torch.ops.aten.index_select.default}


def _storage_numel(val: torch.Tensor) -> int:
    try:
        return val.untyped_storage().nbytes() // max(val.element_size(), 1)
    except Exception:      # (no storage to ask: count its elements)
        return val.numel()


def _broadcasts(node: fx.Node, source_numel: int) -> bool:
    """Whether `node`'s value is much larger than the parameters and buffers it is computed from
    (`source_numel` elements), or, for a gather, than what it reads: cheap to recompute where it
    is read, costly to hold."""
    val = node.meta.get("val")
    if not isinstance(val, torch.Tensor) or val.numel() < _SMALL:
        return False
    if node.target in _GATHERS:
        reads = [a.meta.get("val") for a in flat_nodes((node.args, node.kwargs))]
        return val.numel() > sum(_storage_numel(v) for v in reads if isinstance(v, torch.Tensor))
    return val.numel() > EXPANSION * source_numel


def _source_numel(gm: fx.GraphModule, node: fx.Node) -> int:
    """Elements of a static input's or a graph attribute's storage."""
    val = getattr(gm, str(node.target), None) if node.op == "get_attr" else node.meta.get("val")
    return _storage_numel(val) if isinstance(val, torch.Tensor) else 0


def _is_view_of_source(node: fx.Node, sources: set[fx.Node]) -> bool:
    while node not in sources:
        base = alias_input(node)
        if base is None:
            return False
        node = base
    return True


def hoist_static(gm: fx.GraphModule, static_indices: set[int]) -> HoistedValues | None:
    """Cut `gm`'s parameter-only computations into a separate module (see the module doc).
    `gm` is rewritten in place (new trailing placeholders); None when there is nothing to hoist."""
    graph = gm.graph
    placeholders = list(graph.find_nodes(op="placeholder"))
    written = {n for n in placeholders if is_written(alias_tree(n))}
    sources = {p for i, p in enumerate(placeholders)
               if i in static_indices and p not in written and isinstance(p.meta.get("val"), torch.Tensor)}
    if not sources:
        return None
    # region: computable before the call; reads_static: and reads a parameter (a value built
    # from constructors alone, a causal mask, say, stays a lazy index expression in the kernel)
    region: set[fx.Node] = set(sources)
    reads_static: set[fx.Node] = set(sources)
    # per region node, the parameters, buffers and attributes it is computed from
    origins: dict[fx.Node, frozenset[fx.Node]] = {p: frozenset((p,)) for p in sources}
    for node in graph.nodes:
        if node.op == "get_attr":
            region.add(node)
            reads_static.add(node)
            origins[node] = frozenset((node,))
        elif is_foldable(node) and all(a in region for a in flat_nodes((node.args, node.kwargs))):
            origin = frozenset().union(*(origins[a] for a in flat_nodes((node.args, node.kwargs))))
            if _broadcasts(node, sum(_source_numel(gm, o) for o in origin)):
                continue
            region.add(node)
            origins[node] = origin
            if any(a in reads_static for a in flat_nodes((node.args, node.kwargs))):
                reads_static.add(node)
    outs = output_values(graph)
    roots = sources | set(graph.find_nodes(op="get_attr"))
    frontier: list[fx.Node] = []
    for node in graph.nodes:
        if node not in reads_static or node.op != "call_function":
            continue
        if not any(u not in region for u in node.users):
            continue
        val = node.meta.get("val")
        if not isinstance(val, torch.Tensor) or val.layout != torch.strided:
            continue
        if _is_view_of_source(node, roots):
            continue
        tree = alias_tree(node)
        if tree & outs or is_written(tree):
            continue
        frontier.append(node)
    if not frontier:
        return None

    # the constant module: the frontier and everything it needs
    needed: set[fx.Node] = set()
    stack = list(frontier)
    while stack:
        n = stack.pop()
        if n not in needed:
            needed.add(n)
            stack.extend(flat_nodes((n.args, n.kwargs)))
    const_graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    positions = []
    for i, p in enumerate(placeholders):
        if p in needed:
            env[p] = const_graph.placeholder(p.name)
            env[p].meta.update(p.meta)
            positions.append(i)
    for node in graph.nodes:
        if node in needed and node.op != "placeholder":
            env[node] = const_graph.node_copy(node, env.__getitem__)
    const_graph.output(tuple(env[n] for n in frontier))
    const_gm = fx.GraphModule(gm, const_graph)

    # the per-call module reads the hoisted values as trailing inputs
    with graph.inserting_after(placeholders[-1]):
        for node in reversed(frontier):
            ph = graph.placeholder(f"hoisted_{node.name}")
            ph.meta.update(node.meta)
            node.replace_all_uses_with(ph)
    graph.eliminate_dead_code(is_impure_node=lambda n: n.op == "placeholder" or is_impure(n))
    graph.lint()
    gm.recompile()
    numel = sum(n.meta["val"].numel() for n in frontier)
    return HoistedValues(const_gm, positions, [n.name for n in frontier], int(numel))
