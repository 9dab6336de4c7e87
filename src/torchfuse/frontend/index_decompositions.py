"""Decompositions of indexing ops into the gathers and scatters the lowering fuses
(lowering/scatter.py, lowering/views.py): applied while AOTAutograd traces, so their backwards are
the decomposed ops' own (gathers become accumulating scatters, scatters become gathers).

    _embedding_bag, _embedding_bag_forward_only (mode sum and mean, per_sample_weights, padding_idx,
        include_last_offset): each index's bag by searchsorted over the offsets (ATen: a routing
        op), then rows gathered, weighted and summed into their bags by one index_add (a scatter
        whose gather and weighting fuse into its loop); a mean divides by the bag's count of
        non-padding rows.  Autograd records eager's backward ops (_embedding_bag_backward,
        _embedding_bag_dense_backward, _embedding_bag_per_sample_weights_backward), decomposed
        here too: a gather of the output's gradient by bag into an accumulating scatter into the
        table (embedding_dense_backward), and a row dot for the per-sample weights.  Mode max,
        scale_grad_by_freq and sparse gradients stay in ATen, and so does every embedding bag on
        a backend without Features.embedding_bag_kernels (the C++ one: ATen's CPU kernel was
        1.4-1.7x faster than the decomposition).
    take: a gather from the flattened tensor (aten.index: the stock decomposition's x[index]
        reads a 0-d index as a Python int, a data-dependent .item()).
    index_fill: index_copy of the broadcast value (stock).
    put: index_put into the flattened tensor (accumulating or not).
"""
from __future__ import annotations

from typing import Any

import torch
from torch._decomp import get_decompositions

aten = torch.ops.aten

STOCK = [aten.index_fill]


def _embedding_bag(weight: torch.Tensor, indices: torch.Tensor, offsets: torch.Tensor,
                   scale_grad_by_freq: bool = False, mode: int = 0, sparse: bool = False,
                   per_sample_weights: torch.Tensor | None = None, include_last_offset: bool = False,
                   padding_idx: int = -1) -> Any:
    if mode not in (0, 1) or scale_grad_by_freq or sparse or indices.ndim != 1 or offsets.ndim != 1 \
            or weight.ndim != 2:
        return NotImplemented
    n, bags = indices.shape[0], offsets.shape[0] - (1 if include_last_offset else 0)
    bag = _bag_of_each(indices, offsets, bags)
    # 16-bit tables: weighted, summed and divided in fp32 and rounded once, as eager's kernel
    # does (the bf16 product and quotient rounded twice more: 1.2x eager's error vs fp64)
    acc = torch.float32 if weight.dtype in (torch.float16, torch.bfloat16) else weight.dtype
    rows = weight.index_select(0, indices).to(acc)
    if per_sample_weights is not None:
        rows = rows * per_sample_weights.unsqueeze(1).to(acc)
    keep = None
    if padding_idx >= 0:
        keep = indices != padding_idx
        rows = torch.where(keep.unsqueeze(1), rows, torch.zeros((), dtype=acc, device=rows.device))
    out = torch.zeros(bags, weight.shape[1], dtype=acc, device=weight.device).index_add(0, bag, rows)
    index_dtype = torch.int64
    if mode == 1:
        ones = keep.to(index_dtype) if keep is not None else torch.ones(n, dtype=index_dtype, device=indices.device)
        count = torch.zeros(bags, dtype=index_dtype, device=indices.device).index_add(0, bag, ones)
        out = out / count.clamp(min=1).unsqueeze(1).to(acc)
        return out.to(weight.dtype), bag.to(index_dtype), count, count.clone()
    zeros = torch.zeros(bags, dtype=index_dtype, device=indices.device)
    # (eager's sum returns no bag per index: its backward finds them from the offsets, as ours does)
    return out.to(weight.dtype), torch.zeros(0, dtype=index_dtype, device=indices.device), zeros, zeros.clone()


def _bag_of_each(indices: torch.Tensor, offsets: torch.Tensor, bags: int) -> torch.Tensor:
    """The bag of index j: the last bag starting at or before j (an empty bag takes none; the
    last bag runs to the end, as eager's does with include_last_offset)."""
    starts = offsets[:bags]
    n = indices.shape[0]
    return torch.searchsorted(starts, torch.arange(n, dtype=starts.dtype, device=indices.device), right=True) - 1


def _bag_grad(grad: torch.Tensor, bag: torch.Tensor, indices: torch.Tensor, bag_size: torch.Tensor,
              num_weights: int, mode: int, per_sample_weights: torch.Tensor | None, padding_idx: int) -> Any:
    """The table's gradient: each index's bag's gradient (scaled by its weight, or by 1 / the
    bag's size for a mean) added into its row, as embedding_dense_backward's scatter."""
    g = grad.index_select(0, bag)
    if per_sample_weights is not None:
        g = g * per_sample_weights.unsqueeze(1)
    if mode == 1:
        g = g / bag_size.clamp(min=1).index_select(0, bag).unsqueeze(1).to(g.dtype)
    return aten.embedding_dense_backward(g, indices.long(), num_weights, padding_idx, False)


def _embedding_bag_backward(grad: torch.Tensor, indices: torch.Tensor, offsets: torch.Tensor,
                            offset2bag: torch.Tensor, bag_size: torch.Tensor, maximum_indices: torch.Tensor,
                            num_weights: int, scale_grad_by_freq: bool, mode: int, sparse: bool,
                            per_sample_weights: torch.Tensor | None = None, padding_idx: int = -1) -> Any:
    if mode not in (0, 1) or scale_grad_by_freq or sparse or indices.ndim != 1 or grad.ndim != 2:
        return NotImplemented
    # (offset2bag is empty after eager's plain sum: the bags are found again from the offsets)
    bag = _bag_of_each(indices, offsets, grad.shape[0])
    return _bag_grad(grad, bag, indices, bag_size, num_weights, mode, per_sample_weights, padding_idx)


def _embedding_bag_dense_backward(grad: torch.Tensor, indices: torch.Tensor, offset2bag: torch.Tensor,
                                  bag_size: torch.Tensor, maximum_indices: torch.Tensor, num_weights: int,
                                  scale_grad_by_freq: bool, mode: int, per_sample_weights: torch.Tensor | None = None,
                                  padding_idx: int = -1) -> Any:
    if mode not in (0, 1) or scale_grad_by_freq or indices.ndim != 1 or grad.ndim != 2 or \
            offset2bag.shape != indices.shape:
        return NotImplemented
    return _bag_grad(grad, offset2bag, indices, bag_size, num_weights, mode, per_sample_weights, padding_idx)


def _per_sample_weights_backward(grad: torch.Tensor, weight: torch.Tensor, indices: torch.Tensor,
                                 offsets: torch.Tensor, offset2bag: torch.Tensor, mode: int,
                                 padding_idx: int = -1) -> Any:
    """d out[bag(j)] / d psw[j] = weight[indices[j]]: the dot of that row with its bag's gradient."""
    if mode != 0 or indices.ndim != 1 or grad.ndim != 2:
        return NotImplemented
    bag = _bag_of_each(indices, offsets, grad.shape[0])
    dot = (grad.index_select(0, bag) * weight.index_select(0, indices)).sum(1)
    if padding_idx >= 0:
        dot = torch.where(indices != padding_idx, dot, torch.zeros((), dtype=dot.dtype, device=dot.device))
    return dot


def _take(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    return aten.index(x.reshape(-1), [index])


def _put(x: torch.Tensor, index: torch.Tensor, source: torch.Tensor, accumulate: bool = False) -> torch.Tensor:
    flat = x.reshape(-1)
    return aten.index_put(flat, [index.reshape(-1)], source.reshape(-1), accumulate).view(x.shape)


def table() -> dict:
    """take, index_fill and put, for frontend/decompositions.py's table."""
    out = dict(get_decompositions(STOCK))
    out[aten.put.default] = _put
    out[aten.take.default] = _take
    return out


def embedding_bag_table(config: Any) -> dict:
    """The embedding-bag decompositions, each applied only to tensors whose backend asks for
    them (backends.base.Features.embedding_bag_kernels), else ATen's op stays."""
    from .. import backends

    def where_wanted(fn):
        def run(*args, **kwargs):
            t = args[0]
            if not backends.for_device(t.device, config).features.embedding_bag_kernels:
                return NotImplemented
            return fn(*args, **kwargs)
        return run
    return {aten._embedding_bag.default: where_wanted(_embedding_bag),
            aten._embedding_bag_forward_only.default: where_wanted(_embedding_bag),
            aten._embedding_bag_backward.default: where_wanted(_embedding_bag_backward),
            aten._embedding_bag_dense_backward.default: where_wanted(_embedding_bag_dense_backward),
            aten._embedding_bag_per_sample_weights_backward.default: where_wanted(_per_sample_weights_backward)}
