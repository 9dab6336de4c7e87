"""Eager micro-fusion: run ordinary eager PyTorch code, fuse what can be fused.

    with torchfuse.lazy() as ctx:           # also @torchfuse.lazy, torchfuse.lazy(options={...})
        y = torch.softmax(x * 2, -1) + b    # recorded, not run: y is a pending LazyTensor
        z = y @ w                           # mm is not fusible: y's ops compile to one kernel, run
        print(z.sum().item())               # .item() computes the pending sum
    print(ctx.flushes)                      # a table: why each flush happened, ops, kernels,
                                            # cache hit, time

The modules, top-down: each imports only those below it; where a lower one must call an upper
one it calls a hook in `state.hooks`, which the upper module sets when it is imported.

    context   `LazyContext` and `lazy()`: entering and leaving a block, its options, its flush log
    capture   modules called again at a block's top level run compiled (Dynamo + torchfuse)
    mode      `LazyMode`'s dispatch handler: record each aten op, or run it eagerly
    graph     `LazyNode`s, the pending graph, flushing it (compile and run, or replay) and publishing
    trace     op prediction: the trie of recorded op sequences and the flushes seen at its steps
    recorder  a function generated per trie step that records the op the step predicts
    cache     compiled graphs by signature (exact, and without sizes); compiles through the pipeline
    tensor    `LazyTensor`, the wrapper handed out for a pending value
    state     the open blocks of each thread, the `LazyMode` type, the mode stack, the hooks

Design (see the modules for details):

* `LazyMode` (its handler in `mode`), a TorchDispatchMode active inside the block, sees every
  aten op.  Fusible ops (a lowering in `torchfuse.lowering.registry.LOWERINGS` or a torchfuse
  decomposition; not random, not mutating; strided tensors on one CPU/CUDA device) are
  recorded as `graph.LazyNode`s; so are matmuls, attention (without dropout), convolutions,
  cumsum and their backward ops, which run through ATen inside the compiled graph
  (`lazy(defer_matmuls=False)` runs them eagerly instead).  Outputs are `tensor.LazyTensor`s, wrapper subclasses with eager mode's
  sizes, strides and dtype computed by the ops' meta kernels -- once per (op, scalars, input
  layouts): `mode.Plan`s cache that, so recording an op again is a dict lookup.  Everything
  else runs eagerly on computed inputs.
* A flush (`graph.flush`) computes exactly the pending values something needs -- plus values
  computed on the way that are still referenced -- by replaying their ops under make_fx into an
  aten graph, compiling it with `compile_graph` and running it.  `cache` keeps compiled graphs
  in two levels: by exact signature (ops, scalars, how nodes connect, leaf dtypes/sizes/strides;
  one dict lookup per flush), and by the same signature without sizes, for graphs traced with
  symbolic sizes plus the shape guards they assumed: a new batch size compiles nothing.  Both
  are LRU-bounded by `Config.memory_cache_size`.  Counters: `lazy_flushes`, `lazy_cache_hits`
  (exact), `lazy_shape_hits` (size-free), `lazy_compiles`.
* `trace`: a program recorded again is predicted.  Each block keeps the nodes recorded since
  its last flush and a cursor into a process-wide trie of the op sequences seen (pending
  inputs by position, real tensors by layout, scalars by value): an op matching a child of the
  cursor is recorded by a function generated for the step (`recorder`: the step's comparisons
  and its node and wrapper, straight-line code).  A flush whose trace ends at
  a step that flushed before, with the same values requested and alive, replays that flush
  (no topological sort, no signature, no cache lookup).  Counters: `lazy_replays`,
  `lazy_signatures`; per block `trace_hits` / `trace_misses`.
* `capture`: a module called at the block's top level is recorded on its first call and from
  its second runs compiled (Dynamo + torchfuse, forward and backward) with the lazy mode off
  the dispatch stack: recording every op of a whole model costs more host time than eager's
  forward, and only not seeing the ops one by one gets below that floor.  Pending inputs are
  computed first (one flush); outputs are plain tensors; the compiled backward nodes run outside
  the mode too.  `lazy(capture_modules=False)` turns it off.
* Flushes happen when a non-fusible op reads a pending value, when data leaves the tensor world
  (.item(), bool(), print, .tolist(), .numpy(), .data_ptr(), ...), before an op writes memory a
  pending value read, when the pending graph exceeds `max_nodes` (512), when a backward pass
  ends, and at the end of the block.  Values nobody references any more are never computed.
* A computed LazyTensor's own storage is pointed at its result, so it stays a valid tensor after
  the block (ops on it run eagerly and return plain tensors; the decorator returns plain tensors).

Semantics kept from eager mode: views of pending values stay views after computing (they are
re-applied to the computed base); in-place ops see and are seen by aliases; values computed from
memory before an in-place write keep the old contents; random ops run eagerly on the same
random stream; autograd records exactly what it records in eager mode: the mode sits below
autograd, whose graph simply holds LazyTensors.  A training step is fused forward and backward:
the backward pass's ops are recorded like the forward's, and the gradients (`.grad`, computed
LazyTensors once the pass ends) equal eager's.  Training batch norm runs eagerly (it writes its
running statistics), so a CNN in train mode is fused between its batch norms only.

Limitations: scalar arguments are part of the cache signature, so each new scalar value
compiles once; index-like integers (slice bounds, select index) too, only `size=`/`shape=`
lists are lifted out of it.  A graph the core cannot compile with symbolic sizes, or whose
symbolic compile disagrees with eager on its first run, is compiled with static sizes (once per
size).  Writes that bypass the dispatcher (through `.numpy()` arrays,
`data_ptr()` in C extensions) are not seen -- call `ctx.flush()` first; a pending LazyTensor
has no memory until computed, so C++ code reading its data pointer directly must see a computed
one; interception costs a few microseconds per op (0.9-1.2x a TorchDispatchMode that only
runs each op, on the 2-core CPU: the mode's dispatch and a wrapper per output are most of it),
so code outside captured modules on tiny tensors runs slower than eager; factories on CUDA run eagerly.  Prediction is off from an in-place op recorded on a pending value to the
next flush.
"""
from .context import LazyContext, lazy
from .graph import FlushRecord, clear_cache
from .tensor import LazyTensor

__all__ = ["lazy", "LazyContext", "LazyTensor", "FlushRecord", "clear_cache"]
