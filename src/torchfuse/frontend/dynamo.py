"""The `torch.compile` backend: Dynamo hands us a torch-level graph, AOTAutograd turns it into
forward/backward (or inference) aten graphs with our decompositions, and each aten graph goes
to `graph_compile.compile_aten_graph`, which runs the core pipeline (`pipeline.compile_graph`)
on it and adds CUDA graphs under reduce-overhead.  Where the graph-level cache is usable, the
compilers are wrapped by `graph_cache` so that AOTAutograd's own cache can store and restore
the generated code (a hit skips AOTAutograd and the pipeline).
"""
from __future__ import annotations

import logging
import math
from typing import Any, Callable, Mapping

import torch
import torch.fx as fx

from ..report import Explanation
from ..config import Config
from ..counters import counters
from ..runtime import cudagraphs
from .. import progress
from . import channels_last_training, constant_masks, graph_cache, saved_program, upsample_training
from ..passes import check_names
from .decompositions import decomposition_table
from .graph_compile import compile_aten_graph, workers_start_early

log = logging.getLogger("torchfuse")


class TorchfuseBackend:
    """A Dynamo backend bound to one `Config` (and, for `explain`, one report to fill)."""

    def __init__(self, config: Config | None = None, report: Explanation | None = None):
        self.config = config or Config.from_options()
        self.report = report
        check_names(self.config.passes)

    def _compile(self, kind: str, gm: fx.GraphModule, static: set[int], training: "cudagraphs.TrainingState") -> Callable:
        """One aten graph through torchfuse (and CUDA graphs under reduce-overhead)."""
        return compile_aten_graph(self.config, self.report, kind, gm, static, training)

    def _compiler(self, kind: str, training: "cudagraphs.TrainingState", cached: bool) -> Callable:
        if cached:
            compiler = graph_cache.serializable(kind, self._compile, _static_input_indices, training, self.config)
            if compiler is not None:
                return compiler

        def compile_fn(gm: fx.GraphModule, example_inputs: list) -> Callable:
            return self._compile(kind, gm, _static_input_indices(), training)
        return compile_fn

    def __call__(self, gm: fx.GraphModule, example_inputs: list, **kwargs: Any) -> Callable:
        config = self.config
        if kwargs:
            config = Config.from_options({**_config_dict(config), **(kwargs.get("options") or {})},
                                         mode=kwargs.get("mode"))
        backend = TorchfuseBackend(config, self.report) if config is not self.config else self
        from torch._dynamo.backends.common import aot_autograd
        from torch._functorch.partitioners import default_partition
        partition = _min_cut_partition if config.partitioner == "min_cut" else default_partition
        def compile_with_aot(use_cache: bool) -> Callable:
            training = cudagraphs.TrainingState()
            # (explain() compiles cache hits again: its report is what the stages did)
            with graph_cache.enabled(config, backend._compile, use_cache, reuse_code=backend.report is None) as cached, \
                    counters.timed("backend"):
                # (AOTAutograd + every compile_graph it calls, or the cache's load)
                aot = aot_autograd(fw_compiler=backend._compiler("forward", training, cached),
                                   bw_compiler=backend._compiler("backward", training, cached),
                                   inference_compiler=backend._compiler("inference", training, cached),
                                   decompositions=decomposition_table(config),
                                   partition_fn=partition,
                                   # input mutations stay in the graph as copy_ (inference graphs,
                                   # and in training the ones autograd cannot see: batch norm's
                                   # running statistics), so the kernel computing the new value
                                   # writes the input itself (codegen/wrapper.py) instead of
                                   # AOTAutograd copying each after
                                   keep_inference_input_mutations=True)
                return aot(gm, example_inputs), cached

        constant_masks.drop_constant_masks(gm)
        upsamples = upsample_training.use_aten_backward(gm, example_inputs)
        relaid = channels_last_training.to_channels_last(gm) \
            if channels_last_training.wants_channels_last(gm, example_inputs, config, backend.report) else []
        if saved_program.in_aot_compile():
            # torch.compile(...).aot_compile: the result must serialize (saved_program.py)
            saved_program.check_can_save(config)
            return saved_program.wrap(compile_with_aot(True)[0], config)

        def compile_graph() -> Callable:
            try:
                return compile_with_aot(True)[0]
            except Exception as e:
                # Dynamo's restart signals (a float input to be specialized, ...) are not failures
                if not graph_cache.usable(config) or isinstance(e, torch._dynamo.exc.RestartAnalysis):
                    raise
                # The graph cache leans on AOTAutograd internals that differ between torch
                # versions: if the compile fails with it, compile without it (an error of the
                # compile itself then raises again, below) and leave it off for this process.
                compiled = compile_with_aot(False)[0]
                graph_cache.turn_off(f"{type(e).__name__}: {e}")
                return compiled

        with progress.compiling(config), workers_start_early(example_inputs, config):
            try:
                return compile_graph()
            except Exception as e:
                if not (relaid or upsamples) or isinstance(e, torch._dynamo.exc.RestartAnalysis):
                    raise
                log.info("the rewritten training graph did not compile (%s: %s); compiling it as it was",
                         type(e).__name__, e)
                channels_last_training.undo(gm, relaid)
                upsample_training.undo(gm, upsamples)
                return compile_graph()


def _static_input_indices() -> set[int]:
    """Positions of the parameters and buffers among the graph's inputs, as AOTAutograd marked
    them for the graph being compiled now (empty when it did not say)."""
    context = torch._guards.TracingContext.try_get()
    meta = getattr(context, "fw_metadata", None) if context is not None else None
    return set(getattr(meta, "static_input_indices", None) or ())


def _min_cut_partition(joint: fx.GraphModule, joint_inputs: Any, **kwargs: Any) -> tuple:
    """AOTAutograd's min-cut partition of the joint graph, after dropping what it would count as
    uses of a forward value that read none of its elements:
    - `detach` nodes.  The joint graph is functional and its gradients are explicit, so a detach
      is a no-op there; but the partitioner counts it as a use that must be materialized, and so
      saved the log-probabilities of a cross entropy ([tokens, vocab]) for the backward instead
      of recomputing them from the logits.  (Graph outputs keep their detach: aliasing metadata
      was computed for them.)
    - the input of a max pooling, which its backward reads for its shape and strides only (the
      indices say where the gradient goes): it was saved for the backward, a full activation
      per pooling (a ResNet's stem: [batch, 64, 112, 112]), where Inductor saves none.
    and after rewriting row gathers into `aten.index` (`_index_select_as_index`) and marking an
    input's re-layout copy for recomputation (`_recompute_input_relayouts`)."""
    from torch._functorch.partitioners import min_cut_rematerialization_partition
    graph = joint.graph
    for node in list(graph.find_nodes(op="call_function", target=torch.ops.aten.detach.default)):
        node.replace_all_uses_with(node.args[0], delete_user_cb=lambda user: user.op != "output")
        if not node.users:
            graph.erase_node(node)
    pool_backward = torch.ops.aten.max_pool2d_with_indices_backward.default
    for node in list(graph.find_nodes(op="call_function", target=pool_backward)):
        _shape_only_input(graph, node, 1)
    _recompute_input_relayouts(graph)
    _index_select_as_index(graph)
    joint.recompile()
    forward, backward = min_cut_rematerialization_partition(joint, joint_inputs, **kwargs)
    _saved_values_early(forward)
    return forward, backward


def _saved_values_early(forward: fx.GraphModule) -> None:
    """Move each value the forward computes only for its outputs to just after its last input.

    The partitioner places what it moved from the backward into the forward (ReLU's mask,
    `relu <= 0`, saved as bool rather than recomputed) after the whole forward.  Computed there,
    its input (the layer's pre-activation, which the kernel reads to recompute the ReLU) stayed
    alive to the forward's end: in T5, one [batch, seq, ffn] fp32 tensor per layer.  A value
    larger than its inputs (a broadcast) stays where it is, as does a seeded random op, whose
    place decides its random numbers."""
    graph = forward.graph
    output = next(n for n in reversed(graph.nodes) if n.op == "output")
    order = {n: i for i, n in enumerate(graph.nodes)}
    placeholders = list(graph.find_nodes(op="placeholder"))
    floor = placeholders[-1] if placeholders else None
    moved = False
    for node in list(graph.nodes):
        if node.op != "call_function" or set(node.users) != {output} or _seeded(node) \
                or _nbytes(node) > sum(_nbytes(a) for a in node.all_input_nodes):
            continue
        anchor = max((*node.all_input_nodes, *([floor] if floor else [])), key=order.__getitem__, default=None)
        if anchor is None or order[anchor] + 1 >= order[node]:
            continue
        anchor.append(node)      # (no moved node reads another: each has only the output as user)
        moved = True
    if moved:
        forward.recompile()


def _seeded(node: fx.Node) -> bool:
    return torch.Tag.nondeterministic_seeded in getattr(node.target, "tags", ())


def _nbytes(node: fx.Node) -> int:
    from ..passes._meta import size_hint
    val = node.meta.get("val")
    return math.prod(size_hint(s) for s in val.shape) * val.element_size() if isinstance(val, torch.Tensor) else 0


def _recompute_input_relayouts(graph: fx.Graph) -> None:
    """A copy of a forward input into another memory format (the channels-last copy of the
    images a training step re-lays, `channels_last_training.py`) is recomputed in the backward
    rather than saved: the input is held by the caller anyway, and the partitioner, which would
    have to materialize the copy for the convolution's weight gradient either way, saved it for
    the whole step."""
    from torch.utils.checkpoint import CheckpointPolicy
    for node in graph.find_nodes(op="call_function", target=torch.ops.aten.clone.default):
        src = node.args[0]
        if isinstance(src, fx.Node) and src.op == "placeholder" and str(src.target).startswith("primals") \
                and node.kwargs.get("memory_format") not in (None, torch.preserve_format):
            node.meta["recompute"] = CheckpointPolicy.MUST_RECOMPUTE


def _index_select_as_index(graph: fx.Graph) -> None:
    """`index_select(x, dim, idx)` with a 1-D index as `x[..., idx]` (`aten.index`), as Inductor's
    decompositions write it, and a gather at least as large as its input recomputed in the
    backward rather than saved.  The partitioner never recomputes `index_select` (not in its
    allowlist), and kept a GAT's gathered messages ([edges, heads, channels], 1 GB a layer at a
    million edges) even as `aten.index` (its "used far apart" rule: the edge index also feeds
    an unfusible scatter); so they were written in the forward and read back in the backward,
    where a recomputed gather reads the node features again, fused into the backward's kernel,
    and writes nothing.  A gather smaller than its input (a few rows of a large activation)
    is left to the partitioner: recomputing it would keep the whole input alive.  (Marking an
    `index_select` for recomputation alone is not enough: the partitioner counts it as
    unfusible with its readers, and saved them instead.)  One difference on bad input, as under
    Inductor: a negative index, which eager's index_select refuses, counts from the end."""
    from torch.utils.checkpoint import CheckpointPolicy
    for node in list(graph.find_nodes(op="call_function", target=torch.ops.aten.index_select.default)):
        x, dim, idx = node.args
        xval = x.meta.get("val") if isinstance(x, fx.Node) else None
        ival = idx.meta.get("val") if isinstance(idx, fx.Node) else None
        if not isinstance(xval, torch.Tensor) or not isinstance(ival, torch.Tensor) or ival.ndim != 1 \
                or xval.ndim == 0:
            continue
        dim = dim % xval.ndim
        with graph.inserting_before(node):
            gather = graph.call_function(torch.ops.aten.index.Tensor, (x, [None] * dim + [idx]))
        gather.meta.update(node.meta)
        node.replace_all_uses_with(gather)
        graph.erase_node(node)
    for node in graph.find_nodes(op="call_function", target=torch.ops.aten.index.Tensor):
        x, indices = node.args[:2]
        idx_vals = [i.meta.get("val") for i in indices if isinstance(i, fx.Node)]
        if "recompute" in node.meta or not idx_vals or \
                any(not isinstance(v, torch.Tensor) or v.dtype in (torch.bool, torch.uint8) for v in idx_vals):
            continue
        if isinstance(x, fx.Node) and _nbytes(node) >= _nbytes(x) > 0:
            node.meta["recompute"] = CheckpointPolicy.MUST_RECOMPUTE


def _shape_only_input(graph: fx.Graph, node: fx.Node, pos: int) -> None:
    """Give `node` an uninitialized tensor of its argument `pos`'s shape, strides and dtype
    instead of that argument (static shapes only)."""
    arg = node.args[pos]
    val = arg.meta.get("val") if isinstance(arg, fx.Node) else None
    if not isinstance(val, torch.Tensor) or not all(isinstance(x, int) for x in (*val.shape, *val.stride())):
        return
    with graph.inserting_before(node):
        like = graph.call_function(torch.ops.aten.empty_strided.default, (list(val.shape), list(val.stride())),
                                   {"dtype": val.dtype, "device": val.device})
    like.meta.update(arg.meta)
    node.args = node.args[:pos] + (like,) + node.args[pos + 1:]


def _config_dict(config: Config) -> dict:
    import dataclasses
    return {f.name: getattr(config, f.name) for f in dataclasses.fields(config)}


def torchfuse_backend(gm: fx.GraphModule, example_inputs: list, *, mode: str | None = None,
                      options: Mapping[str, Any] | None = None) -> Callable:
    """Entry point registered under `torch_dynamo_backends` as "torchfuse"."""
    return TorchfuseBackend(Config.from_options(options, mode=mode))(gm, example_inputs)

