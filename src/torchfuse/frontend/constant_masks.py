"""Attention masks that mask nothing, dropped from Dynamo's graph before AOTAutograd, and causal
masks computed from constants, replaced by SDPA's `is_causal=True`.

Some models build an attention mask from constants alone: transformers 5.17 gives a ViT/DeiT
encoder `(arange(S)[None, None, :, None] + 0 >= 0).expand(B, -1, S, S)`, all true.  SDPA
picks its kernel when AOTAutograd traces it, and with a mask whose rows are not 8-aligned it
takes the math path (matmuls, a softmax): on an H100 DeiT-S ran 3.3 ms of attention that
eager, which passes no mask, runs in 2.5 ms with the fused memory-efficient kernel.

A mask qualifies when its value (not its shape: an `expand` to a symbolic batch size is skipped)
is computed from constants only, and that value masks nothing: all true, or all zero for an
additive float mask.  It is evaluated once, at compile time, on the CPU whatever the graph's
device: skipping a broadcast changes shapes, so an index computed for the broadcast shape
(transformers' decoder masks index their batch) can fall outside the unbroadcast tensor; on the
CPU that raises and the mask stays, on a GPU it is a device-side assert that poisons the
process.  Broadcasts to static sizes are evaluated as written.

A decoder's causal mask is the same story at every sequence length: eager transformers calls
SDPA with `is_causal=True` and no mask, while under torch.compile it materializes the
lower-triangular mask (from `arange`s and comparisons), and the attention kernels then read it
and compute every block above the diagonal as well: on an H100 GPT-NeoX's fp32 attention took
15.6 ms under Inductor against eager's 8.5.  A mask computed from constants whose value is
exactly the causal one (true on and below the diagonal, or an additive float mask of 0 there and
-inf or the dtype's minimum above it), for queries and keys of the same static length, becomes
`is_causal=True`, which is SDPA's definition of that mask.
"""
from __future__ import annotations

import logging
import operator
from typing import Any

import torch
import torch.fx as fx

from ..counters import counters

log = logging.getLogger("torchfuse")

_SDPA = {torch._C._nn.scaled_dot_product_attention, torch.nn.functional.scaled_dot_product_attention}
_BROADCASTS = {"expand", "expand_as", "broadcast_to"}   # change the shape, not whether all() holds
_FILLS = {"new_ones", "new_zeros", "new_full"}    # values that read only their receiver's dtype
_MAX_NODES = 64       # a mask's value chain longer than this is not evaluated
_RANDOM = ("rand", "bernoulli", "normal", "dropout", "multinomial", "poisson")   # values differ per call


class _NotConstant(Exception):
    pass


def _value(node: Any, memo: dict, budget: list[int]) -> Any:
    """The value of `node` computed from constants only (raises _NotConstant otherwise); a
    broadcast is skipped, so its (possibly symbolic) sizes are never read."""
    if not isinstance(node, fx.Node):
        if isinstance(node, (list, tuple)):
            return type(node)(_value(x, memo, budget) for x in node)
        if isinstance(node, dict):
            return {k: _value(v, memo, budget) for k, v in node.items()}
        if isinstance(node, (torch.SymInt, torch.SymFloat, torch.SymBool)):
            raise _NotConstant
        return node
    if node in memo:
        return memo[node]
    budget[0] -= 1
    if budget[0] < 0 or node.op not in ("call_function", "call_method"):
        raise _NotConstant
    target = node.target
    if any(word in str(getattr(target, "__name__", target)) for word in _RANDOM):
        raise _NotConstant
    if node.op == "call_method" and target in _FILLS:
        # x.new_ones(...): only x's dtype is read (transformers' all-ones padding mask)
        proto = node.args[0].meta.get("example_value") if isinstance(node.args[0], fx.Node) else node.args[0]
        if not isinstance(proto, torch.Tensor):
            raise _NotConstant
        args, kwargs = _value(node.args[1:], memo, budget), _value(node.kwargs, memo, budget)
        kwargs = {"dtype": proto.dtype, **kwargs, "device": "cpu"}
        result = getattr(torch.empty((), dtype=proto.dtype), target)(*args, **kwargs)
    elif ((node.op == "call_method" and target in _BROADCASTS) or
          (node.op == "call_function" and getattr(target, "__name__", "") in _BROADCASTS
           and getattr(target, "__module__", "") in ("torch", "torch.functional"))) and _symbolic(node):
        result = _value(node.args[0], memo, budget)
    else:
        args, kwargs = _value(node.args, memo, budget), _value(node.kwargs, memo, budget)
        if "device" in kwargs:
            kwargs["device"] = "cpu"                 # (see the module docstring)
        if node.op == "call_method":
            if not isinstance(args[0], torch.Tensor):
                raise _NotConstant
            if target in ("cuda", "to", "cpu"):      # moves: stay on the CPU, keep a dtype change
                rest = [a for a in args[1:] if not isinstance(a, (torch.device, str, int))]
                result = args[0].to(*rest, **{k: v for k, v in kwargs.items() if k in ("dtype", "copy")})
            else:
                result = getattr(args[0], target)(*args[1:], **kwargs)
        elif target in (operator.getitem, operator.add, operator.sub, operator.mul, operator.ge, operator.gt,
                        operator.le, operator.lt, operator.eq, operator.ne, operator.and_, operator.or_,
                        operator.invert, operator.neg) or getattr(target, "__module__", None) in ("torch", "torch._C._VariableFunctions"):
            result = target(*args, **kwargs)
        else:
            raise _NotConstant
    memo[node] = result
    return result


def _symbolic(node: fx.Node) -> bool:
    """Does a broadcast's target shape hold a symbolic size (a dynamic batch)?"""
    flat = [x for a in (*node.args[1:], *node.kwargs.values()) for x in (a if isinstance(a, (list, tuple)) else (a,))]
    return any(isinstance(x, (fx.Node, torch.SymInt)) for x in flat)


def _masks_nothing(mask: Any) -> bool:
    if not isinstance(mask, torch.Tensor) or mask.numel() == 0:
        return False
    if mask.dtype == torch.bool:
        return bool(mask.all())
    return mask.is_floating_point() and bool((mask == 0).all())


def _static_length(node: Any) -> int | None:
    """The sequence length (dim -2) of a query or key node, if Dynamo recorded a static one."""
    val = node.meta.get("example_value") if isinstance(node, fx.Node) else None
    if not isinstance(val, torch.Tensor) or val.ndim < 2 or not isinstance(val.shape[-2], int):
        return None
    return val.shape[-2]


def _is_causal(mask: Any, sdpa: fx.Node) -> bool:
    """Is `mask` (evaluated, before its broadcasts) SDPA's causal mask for this call?"""
    if not isinstance(mask, torch.Tensor) or mask.ndim < 2:
        return False
    length = _static_length(sdpa.args[0])
    if length is None or length < 2 or _static_length(sdpa.args[1]) != length or \
            tuple(mask.shape[-2:]) != (length, length):
        return False
    lower = torch.ones(length, length, dtype=torch.bool).tril()
    if mask.dtype == torch.bool:
        return bool((mask == lower).all())
    if not mask.is_floating_point():
        return False
    lower = lower.expand(mask.shape)
    return bool((mask[lower] == 0).all()) and bool((mask[~lower] <= torch.finfo(mask.dtype).min).all())


def _set_mask(node: fx.Node, in_kwargs: bool, causal: bool) -> None:
    if in_kwargs:
        node.kwargs = {**node.kwargs, "attn_mask": None}
    else:
        node.args = node.args[:3] + (None,) + node.args[4:]
    if causal:
        if len(node.args) > 5:
            node.args = node.args[:5] + (True,) + node.args[6:]
        else:
            node.kwargs = {**node.kwargs, "is_causal": True}


def drop_constant_masks(gm: fx.GraphModule) -> int:
    """Drop every SDPA attention mask of `gm` that is constant and masks nothing, and replace
    every constant causal one by `is_causal=True`; returns how many masks went."""
    dropped = causal = 0
    for node in gm.graph.nodes:
        if node.op != "call_function" or node.target not in _SDPA:
            continue
        in_kwargs = "attn_mask" in node.kwargs
        mask = node.kwargs.get("attn_mask") if in_kwargs else (node.args[3] if len(node.args) > 3 else None)
        if not isinstance(mask, fx.Node):
            continue
        try:
            with torch.no_grad():
                value = _value(mask, {}, [_MAX_NODES])
        except _NotConstant:
            continue
        except Exception as e:      # an op that does not run on concrete values here: leave the mask
            log.debug("torchfuse: attention mask %s not evaluated: %s: %s", mask.name, type(e).__name__, e)
            continue
        if _masks_nothing(value):
            _set_mask(node, in_kwargs, causal=False)
            dropped += 1
        elif _is_causal(value, node):
            _set_mask(node, in_kwargs, causal=True)
            causal += 1
    if dropped or causal:
        gm.recompile()      # (the mask's nodes stay: AOTAutograd's trace drops what nothing reads)
        counters.bump("constant_masks_dropped", dropped)
        counters.bump("causal_masks_replaced", causal)
        log.info("torchfuse: dropped %d attention mask(s) that mask nothing, replaced %d causal one(s) "
                 "by is_causal=True", dropped, causal)
    return dropped + causal
