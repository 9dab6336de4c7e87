"""Attention masks that mask nothing, dropped from Dynamo's graph before AOTAutograd.

Some models build an attention mask from constants alone: transformers 5.17 gives a ViT/DeiT
encoder `(arange(S)[None, None, :, None] + 0 >= 0).expand(B, -1, S, S)`, all true.  SDPA
picks its kernel when AOTAutograd traces it, and with a mask whose rows are not 8-aligned it
takes the math path (matmuls, a softmax): on an H100 DeiT-S ran 3.3 ms of attention that
eager, which passes no mask, runs in 2.5 ms with the fused memory-efficient kernel.

A mask qualifies when its value (not its shape: an `expand` to the batch size may be symbolic)
is computed from constants only, and that value masks nothing: all true, or all zero for an
additive float mask.  It is evaluated once, at compile time, on the CPU whatever the graph's
device: skipping a broadcast changes shapes, so an index computed for the broadcast shape
(GPT-2's causal mask indexes its batch) can fall outside the unbroadcast tensor; on the CPU
that raises and the mask stays, on a GPU it is a device-side assert that poisons the process.
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
    if (node.op == "call_method" and target in _BROADCASTS) or \
            (node.op == "call_function" and getattr(target, "__name__", "") in _BROADCASTS
             and getattr(target, "__module__", "") in ("torch", "torch.functional")):
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


def _masks_nothing(mask: Any) -> bool:
    if not isinstance(mask, torch.Tensor) or mask.numel() == 0:
        return False
    if mask.dtype == torch.bool:
        return bool(mask.all())
    return mask.is_floating_point() and bool((mask == 0).all())


def drop_constant_masks(gm: fx.GraphModule) -> int:
    """Drop every SDPA attention mask of `gm` that is constant and masks nothing; returns how many."""
    dropped = 0
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
        if not _masks_nothing(value):
            continue
        if in_kwargs:
            node.kwargs = {**node.kwargs, "attn_mask": None}
        else:
            node.args = node.args[:3] + (None,) + node.args[4:]
        dropped += 1
    if dropped:
        gm.recompile()      # (the mask's nodes stay: AOTAutograd's trace drops what nothing reads)
        counters.bump("constant_masks_dropped", dropped)
        log.info("torchfuse: dropped %d attention mask(s) that mask nothing", dropped)
    return dropped
