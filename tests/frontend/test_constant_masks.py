"""Attention masks computed from constants that mask nothing are dropped before AOTAutograd
(frontend/constant_masks.py), so SDPA can pick a fused kernel, and causal ones become
`is_causal=True`; masks that mask something else, or that depend on inputs or random numbers,
stay.  Outputs are eager's either way."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from torchfuse import counters

B, H, S, D = 2, 2, 18, 8     # 18: rows not 8-aligned, the case that sent SDPA to its math path


def _qkv(batch: int = B, requires_grad: bool = False):
    g = torch.Generator().manual_seed(0)
    return [torch.randn(batch, H, S, D, generator=g).requires_grad_(requires_grad) for _ in range(3)]


def all_true_from_arange(q, k, v):       # transformers 5.17's encoder mask
    rows = torch.arange(S, device=q.device) + 0
    mask = (rows[None, None, :, None] >= 0).expand(q.shape[0], -1, S, S)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def zero_additive(q, k, v):
    mask = torch.zeros(S, S, device=q.device, dtype=q.dtype)
    return F.scaled_dot_product_attention(q, k, v, mask)


def causal(q, k, v):
    rows = torch.arange(S, device=q.device)
    mask = rows[:, None] >= rows[None, :]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def causal_additive(q, k, v):     # 0 on and below the diagonal, the dtype's minimum above it
    rows = torch.arange(S, device=q.device)
    mask = torch.zeros(S, S, device=q.device, dtype=q.dtype)
    mask = mask.masked_fill(rows[None, :] > rows[:, None], torch.finfo(q.dtype).min)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask[None, None].expand(q.shape[0], 1, S, S))


def causal_from_padding_of_ones(q, k, v):     # transformers' decoder mask: causal & padding(ones)
    rows = torch.arange(S, device=q.device)
    padding = q.new_ones(q.shape[0], S, dtype=torch.bool)
    mask = (rows[None, :] <= rows[:, None])[None, None] & padding[:, None, None, :]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def causal_shifted(q, k, v):      # sees one key ahead: not SDPA's causal mask
    rows = torch.arange(S, device=q.device)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=rows[None, :] <= rows[:, None] + 1)


def random_all_true(q, k, v):
    mask = torch.rand(S, S, device=q.device) < 2.0     # all true, but drawn anew every call
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


@pytest.mark.parametrize("fn,dropped,causal", [
    (all_true_from_arange, 1, 0), (zero_additive, 1, 0), (causal, 0, 1), (causal_additive, 0, 1),
    (causal_from_padding_of_ones, 0, 1), (causal_shifted, 0, 0), (random_all_true, 0, 0)])
def test_masks(fn, dropped, causal):
    before = counters["constant_masks_dropped"], counters["causal_masks_replaced"]
    q, k, v = _qkv()
    torch.testing.assert_close(torch.compile(fn, backend="torchfuse")(q, k, v), fn(q, k, v), rtol=1e-5, atol=1e-5)
    assert counters["constant_masks_dropped"] - before[0] == dropped
    assert counters["causal_masks_replaced"] - before[1] == causal


def _check_training_step(compiled, fn, batch: int = B) -> None:
    """Outputs and q/k/v gradients of `compiled` equal `fn`'s, run eagerly."""
    q, k, v = _qkv(batch, requires_grad=True)
    qr, kr, vr = (t.detach().clone().requires_grad_() for t in (q, k, v))
    out, expected = compiled(q, k, v), fn(qr, kr, vr)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    out.square().sum().backward()
    expected.square().sum().backward()
    for a, b in ((q, qr), (k, kr), (v, vr)):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-4, atol=1e-5)


def test_causal_mask_in_training():
    """A causal mask replaced by is_causal=True: gradients are eager's (with the mask)."""
    before = counters["causal_masks_replaced"]
    _check_training_step(torch.compile(causal_additive, backend="torchfuse"), causal_additive)
    assert counters["causal_masks_replaced"] - before == 1


def test_causal_mask_for_a_shorter_query_stays():
    """Queries of one length against keys of another (decoding with a cache): SDPA's is_causal
    aligns the mask to the top left, the model's to the bottom right; the mask stays."""
    g = torch.Generator().manual_seed(1)
    q = torch.randn(B, H, 4, D, generator=g)
    k, v = torch.randn(B, H, S, D, generator=g), torch.randn(B, H, S, D, generator=g)

    def f(q, k, v):
        rows = torch.arange(S, device=q.device)
        mask = rows[None, :] <= rows[S - 4:, None]
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)

    before = counters["causal_masks_replaced"]
    torch.testing.assert_close(torch.compile(f, backend="torchfuse")(q, k, v), f(q, k, v), rtol=1e-5, atol=1e-5)
    assert counters["causal_masks_replaced"] == before


def test_mask_from_an_input_stays():
    def f(q, k, v, keep):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=keep[:, None, None, :].expand(-1, H, S, S))

    before = counters["constant_masks_dropped"]
    q, k, v = _qkv()
    keep = torch.ones(B, S, dtype=torch.bool)
    keep[1, 5:] = False
    torch.testing.assert_close(torch.compile(f, backend="torchfuse")(q, k, v, keep), f(q, k, v, keep),
                               rtol=1e-5, atol=1e-5)
    assert counters["constant_masks_dropped"] == before


def test_symbolic_batch_and_training():
    """The mask's expand to a dynamic batch does not keep it; gradients are eager's."""
    before = counters["constant_masks_dropped"]
    compiled = torch.compile(all_true_from_arange, backend="torchfuse", dynamic=True)
    for batch in (3, 5):
        _check_training_step(compiled, all_true_from_arange, batch)
    assert counters["constant_masks_dropped"] - before == 1


def _mask_graph(indexed: bool) -> torch.fx.GraphModule:
    """SDPA with a mask built on the "meta" device, as Dynamo records it (sizes are ints)."""
    import operator
    g = torch.fx.Graph()
    q, k, v = (g.placeholder(n) for n in "qkv")
    rows = g.call_function(operator.add, (g.call_function(torch.arange, (S,), {"device": "meta"}), 0))
    if indexed:     # an index valid only for the broadcast shape, which the evaluation skips
        full = g.call_method("expand", (g.call_function(operator.ge, (g.call_function(
            operator.getitem, (rows, (None, slice(None)))), 0)), 4, S))
        picked = g.call_function(operator.getitem, (full, g.call_function(torch.arange, (4,), {"device": "meta"})))
        mask = g.call_function(operator.getitem, (picked, (slice(None), None, None, slice(None))))
    else:
        mask = g.call_method("expand", (g.call_function(operator.ge, (g.call_function(
            operator.getitem, (rows, (None, None, slice(None), None))), 0)), B, -1, S, S))
    g.output(g.call_function(torch._C._nn.scaled_dot_product_attention, (q, k, v), {"attn_mask": mask}))
    return torch.fx.GraphModule(torch.nn.Module(), g)


def test_masks_are_evaluated_on_the_cpu_whatever_their_device():
    """The evaluation never runs on the graph's device: a mask built on another device (here
    "meta", which cannot be evaluated) is computed on the CPU, where an index that fails raises
    and the mask stays (on a GPU it was a device-side assert that took the process down).  A
    broadcast to static sizes is evaluated, so an index into the broadcast shape (transformers'
    decoder masks index their batch) is valid."""
    from torchfuse.frontend.constant_masks import drop_constant_masks
    assert drop_constant_masks(_mask_graph(indexed=False)) == 1
    assert drop_constant_masks(_mask_graph(indexed=True)) == 1
