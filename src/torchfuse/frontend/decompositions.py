"""The decomposition table torchfuse owns.

We decompose what we fuse better ourselves (softmax, norms, activations and their backwards,
var/std, losses) into pointwise ops and reductions.  Matmul, convolution and attention stay
whole and run in ATen; so does inference batch norm, which `conv_bn_fold` folds into a preceding
convolution and the lowering handles as a pointwise op otherwise.
"""
from __future__ import annotations

import torch
from torch._decomp import get_decompositions

from .. import backends
from ..config import Config

aten = torch.ops.aten

DECOMPOSE = [
    # softmax family
    aten._softmax, aten._safe_softmax, aten._log_softmax, aten._softmax_backward_data, aten._log_softmax_backward_data,
    aten.logsumexp,
    # normalization
    aten.native_layer_norm, aten.native_layer_norm_backward, aten.native_group_norm,
    aten.native_group_norm_backward, aten.native_batch_norm, aten._native_batch_norm_legit,
    aten._native_batch_norm_legit_functional, aten.native_batch_norm_backward, aten.var, aten.var_mean,
    aten.std, aten.std_mean, aten.linalg_vector_norm,
    # activations and their backwards
    aten.gelu, aten.gelu_backward, aten.silu, aten.silu_backward, aten.mish, aten.mish_backward,
    aten.leaky_relu, aten.leaky_relu_backward, aten.elu, aten.elu_backward, aten.hardsigmoid,
    aten.hardsigmoid_backward, aten.hardswish, aten.hardswish_backward, aten.hardtanh_backward,
    aten.threshold_backward,   # (relu's: the partitioner may then save its bool mask, not an fp32 input)
    aten.softplus, aten.softplus_backward, aten.threshold, aten.glu, aten.glu_backward, aten.logit,
    aten.celu, aten.selu, aten.relu6, aten.prelu, aten._prelu_kernel, aten._prelu_kernel_backward,
    aten.log_sigmoid_forward, aten.softshrink, aten.hardshrink,
    # elementwise helpers
    aten.addcmul, aten.addcdiv, aten.lerp, aten.xlogy, aten.clamp_min, aten.clamp_max, aten.rsub,
    aten.triu, aten.tril, aten.masked_fill, aten.square, aten.logaddexp, aten.hypot, aten.nan_to_num,
    aten.zero, aten.isposinf, aten.isneginf,
    # losses
    aten.nll_loss_forward, aten.nll_loss_backward, aten.mse_loss, aten.mse_loss_backward,
    aten.binary_cross_entropy, aten.binary_cross_entropy_backward, aten.smooth_l1_loss, aten.huber_loss,
    aten.binary_cross_entropy_with_logits,
    # views' backwards and index helpers
    aten.slice_backward, aten.select_backward, aten.index_select_backward, aten.diagonal_backward,
    aten.embedding, aten.expand_as, aten.narrow, aten.unfold_backward, aten.stack,
]

_table: dict | None = None


def decomposition_table(config: Config | None = None) -> dict:
    """The table for AOTAutograd.  With the `config` given (the compile path), max pooling also
    decomposes to the low-memory form on devices whose backend pools in its kernels
    (backends.base.Features.pooling: not the C++ backend, which leaves pooling to ATen)."""
    base = _base_table()
    if config is not None:
        from .index_decompositions import embedding_bag_table
        base = {**embedding_bag_table(config), **base}     # (a user's own decomposition wins)
    from ..lowering.pool import POOL_WITH_OFFSETS
    if config is None or POOL_WITH_OFFSETS is None or aten.max_pool2d_with_indices.default in base:
        return base     # (a user's own decomposition of max pooling wins)
    return {**base, aten.max_pool2d_with_indices.default: _max_pool_low_memory(config)}


def _max_pool_low_memory(config: Config):
    """max_pool2d_with_indices as (values, int8 window offsets) plus a pointwise conversion to
    indices.  A training step saves what the backward reads: ATen's int64 indices are 8 bytes
    per pooled element (100 MB in a ResNet-50 step at batch 64), the offsets 1; the min-cut
    partitioner saves the offsets and recomputes the indices inside the backward's kernel.
    The same form as Inductor's decomposition."""
    from ..lowering.pool import MAX_WINDOW, OFFSETS_TO_INDICES, POOL_WITH_OFFSETS, pair

    def max_pool2d_with_indices(x, kernel_size, stride=(), padding=0, dilation=1, ceil_mode=False):
        if not backends.for_device(x.device, config).features.pooling:
            return NotImplemented
        if x.ndim not in (3, 4) or not x.dtype.is_floating_point:
            return NotImplemented
        k = pair(kernel_size)
        s = pair(stride, default=k)
        p, d = pair(padding), pair(dilation)
        if any(not isinstance(v, int) for v in (*k, *s, *p, *d)) or k[0] * k[1] > MAX_WINDOW:
            return NotImplemented
        values, offsets = POOL_WITH_OFFSETS(x, k, s, p, d, ceil_mode)
        indices = OFFSETS_TO_INDICES(offsets, k, x.shape[-2:], s, p, d)
        return values, indices

    return max_pool2d_with_indices


def _base_table() -> dict:
    global _table
    if _table is None:
        _table = get_decompositions(DECOMPOSE)
        stock = _table[aten.nll_loss_backward.default]

        def nll_loss_backward(grad_output, self, target, weight, reduction, ignore_index, total_weight):
            # The stock decomposition builds its result with zeros_like(self).  That use makes
            # the log-probabilities (self, [tokens, vocab]) count as materialized in the
            # backward, so AOTAutograd's min-cut partitioner saves them instead of recomputing
            # them from the logits.  Only self's shape and dtype are needed.
            like = torch.empty(self.shape, dtype=self.dtype, device=self.device)
            return stock(grad_output, like, target, weight, reduction, ignore_index, total_weight)
        _table[aten.nll_loss_backward.default] = nll_loss_backward
        for op in [op for op in _table if op.overloadpacket in (aten.var, aten.var_mean, aten.std, aten.std_mean)
                   and "keepdim" in (a.name for a in op._schema.arguments)]:
            _table[op] = _keepdim_by_unsqueeze(op, _table[op])
        stock_embedding = _table[aten.embedding.default]

        def embedding(weight, indices, padding_idx=-1, scale_grad_by_freq=False, sparse=False):
            # The stock decomposition reads ids of 2+ dims as weight[indices], advanced indexing,
            # which counts a negative id from the end; eager's embedding rejects it (IndexError),
            # as index_select does, which the stock one uses for 1-D ids.
            if indices.ndim < 2 or weight.ndim != 2:
                return stock_embedding(weight, indices, padding_idx, scale_grad_by_freq, sparse)
            rows = weight.index_select(0, indices.reshape(-1))
            return rows.view(*indices.shape, weight.shape[1])
        _table[aten.embedding.default] = embedding
        from .index_decompositions import table as index_table
        _table.update(index_table())
        from .upsample_training import interpolate as upsample_forward
        _table[torch.ops.torchfuse.upsample.default] = upsample_forward
    from ..extend import decompositions as user_decompositions
    extra = user_decompositions()
    return {**_table, **extra} if extra else _table


def _keepdim_by_unsqueeze(op, decomposition):
    """var/std (and their _mean forms) with keepdim=True as the keepdim=False decomposition plus
    unsqueezes.  The stock one keeps dims with prims.broadcast_in_dim, a view prim that
    functionalization refuses when it re-traces a block of torch.compiler.nested_compile_region
    for its backward (the whole training graph failed to compile)."""
    names = [a.name for a in op._schema.arguments]
    at = names.index("keepdim")

    def run(*args, **kwargs):
        given = {**dict(zip(names, args)), **kwargs}
        if not given.get("keepdim", False):
            return decomposition(*args, **kwargs)
        if at < len(args):
            args = args[:at] + (False,) + args[at + 1:]
        else:
            kwargs = {**kwargs, "keepdim": False}
        out = decomposition(*args, **kwargs)
        x, dim = args[0], given.get("dim")
        dims = [dim] if isinstance(dim, int) else list(dim) if dim else list(range(x.ndim))
        dims = sorted(d % max(x.ndim, 1) for d in dims)

        def keep(t):
            for d in dims:
                t = aten.unsqueeze.default(t, d)
            return t
        return tuple(keep(t) for t in out) if isinstance(out, tuple) else keep(out)
    return run
