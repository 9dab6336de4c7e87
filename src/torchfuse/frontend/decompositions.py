"""The decomposition table torchfuse owns.

We decompose what we fuse better ourselves (softmax, norms, activations and their backwards,
var/std, losses) into pointwise ops and reductions.  Matmul, convolution and attention stay
whole and run in ATen; so does inference batch norm, which `conv_bn_fold` folds into a preceding
convolution and the lowering handles as a pointwise op otherwise.
"""
from __future__ import annotations

import torch
from torch._decomp import get_decompositions

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


def decomposition_table() -> dict:
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
    from ..extend import decompositions as user_decompositions
    extra = user_decompositions()
    return {**_table, **extra} if extra else _table
