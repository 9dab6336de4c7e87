"""Op prediction and flush replay (src/torchfuse/lazy/trace.py): a program recorded again is
predicted op by op from the trie, and its flush replays the one seen before without a graph
signature; anything that differs (a scalar, a layout, which tensors are shared, which values are
alive, an in-place op, a cleared cache) falls back to the ordinary path with eager's results."""
from __future__ import annotations

import torch

import torchfuse
from torchfuse import counters
from torchfuse.lazy import cache, clear_cache

KEYS = ("lazy_replays", "lazy_signatures", "lazy_compiles", "lazy_flushes", "lazy_cache_hits")


def snap() -> dict[str, int]:
    return {k: counters[k] for k in KEYS}


def delta(before: dict[str, int]) -> dict[str, int]:
    return {k: counters[k] - v for k, v in before.items()}


def program(x: torch.Tensor, y: torch.Tensor, scale: float = 0.5) -> torch.Tensor:
    h = (x * scale + y).relu()
    h = torch.softmax(h, -1).view(-1)
    return h.sum() + x.mean()


def lazy_run(fn, *args):
    with torchfuse.lazy(options={"strict": True}) as ctx:
        out = fn(*args)
    return out, ctx


def test_repeated_program_is_predicted_and_replayed():
    torch.manual_seed(0)
    x, y = torch.randn(4, 8), torch.randn(4, 8)
    lazy_run(program, x, y)
    lazy_run(program, x, y)                      # learns the flush at the end of the trace
    x2, y2 = torch.randn(4, 8), torch.randn(4, 8)    # new tensors, same layouts
    before = snap()
    out, ctx = lazy_run(program, x2, y2)
    d = delta(before)
    torch.testing.assert_close(out, program(x2, y2))
    assert ctx.trace_misses == 0 and ctx.trace_hits == len(ctx.flushes[-1].funcs)
    assert d["lazy_replays"] == 1 and d["lazy_signatures"] == 0 and d["lazy_compiles"] == 0
    assert d["lazy_flushes"] == 1 and d["lazy_cache_hits"] == 1 and ctx.flushes[-1].cache_hit


def test_a_different_scalar_or_layout_is_not_predicted():
    torch.manual_seed(1)
    x, y = torch.randn(4, 8), torch.randn(4, 8)
    for _ in range(2):
        lazy_run(program, x, y)
    before = snap()
    out, ctx = lazy_run(program, x, y, 0.25)     # the scalar differs: a miss from `mul` on
    torch.testing.assert_close(out, program(x, y, 0.25))
    assert ctx.trace_misses >= 1 and delta(before)["lazy_replays"] == 0
    xt = torch.randn(8, 4).t()                   # same sizes, other strides
    out, ctx = lazy_run(program, xt, y)
    torch.testing.assert_close(out, program(xt, y))
    assert ctx.trace_misses >= 1


def test_shared_leaves_are_part_of_a_replay():
    """A graph made for x + y takes two leaves; replayed for x + x it must get x twice, and one
    made for x + x (one leaf) must not be replayed for x + y."""
    torch.manual_seed(2)
    x, y = torch.randn(4, 8), torch.randn(4, 8)
    for a, b in ((x, y), (x, y), (x, x), (x, x), (x, y), (y, x), (y, y)):
        out, _ = lazy_run(program, a, b)
        torch.testing.assert_close(out, program(a, b))


def test_alive_values_decide_the_replay():
    """A pending value still alive when a flush computes its ancestors becomes an output of the
    graph (it is not recomputed later): a flush with other values alive is another replay."""
    torch.manual_seed(3)
    x = torch.randn(4, 8)

    def keep(x: torch.Tensor, hold: bool):
        a = x.exp()
        b = (a * 2).sum()
        if not hold:
            del a
            a = None
        return b.item(), a                       # .item() flushes b (and a, when alive)

    for hold in (False, False, True, True, False, True):
        (v, a), ctx = lazy_run(keep, x, hold)
        assert abs(v - float((x.exp() * 2).sum())) < 1e-4
        assert ctx.flushes[0].extra_outputs == int(hold)
        if hold:
            torch.testing.assert_close(a, x.exp())


def test_in_place_turns_prediction_off_until_the_flush():
    torch.manual_seed(4)
    x = torch.randn(4, 8)

    def f(x: torch.Tensor) -> torch.Tensor:
        y = x * 2
        y.add_(1)                                # recorded functionally: re-points y
        return (y * 3).sum()

    for _ in range(3):
        out, ctx = lazy_run(f, x)
        torch.testing.assert_close(out, ((x * 2 + 1) * 3).sum())
    assert ctx.trace_hits <= 1 and ctx.cursor is not None     # off inside, on again after the flush


def test_no_replay_of_a_graph_dropped_from_the_cache():
    torch.manual_seed(5)
    x, y = torch.randn(4, 8), torch.randn(4, 8)
    for _ in range(2):
        lazy_run(program, x, y)
    cache.clear()
    before = snap()
    out, _ = lazy_run(program, x, y)
    torch.testing.assert_close(out, program(x, y))
    d = delta(before)
    assert d["lazy_replays"] == 0 and d["lazy_compiles"] == 1


def test_partial_flushes_and_host_reads_in_a_loop():
    """`.item()` in every step of a loop flushes part of what is pending (a new trace starts
    after it): from the second step on each step is predicted and its flush replayed, and every
    step is still eager's, data-dependent branch included."""
    torch.manual_seed(6)
    clear_cache()
    w = torch.randn(8)

    def loop(acc: torch.Tensor) -> torch.Tensor:
        for _ in range(6):
            acc = acc + (w * 1.5).tanh()
            if acc.sum().item() > 0:             # data-dependent control flow
                acc = acc * -0.5
        return acc

    before = snap()
    with torchfuse.lazy(options={"strict": True}) as ctx:
        out = loop(torch.zeros(8))
    torch.testing.assert_close(out, loop(torch.zeros(8)))
    assert ctx.trace_hits > 0 and delta(before)["lazy_replays"] > 0


def test_nan_scalars_are_not_learnt():
    """nan never equals itself: a step learnt from it would never match and a new one would be
    added on every call."""
    from torchfuse.lazy import trace
    x = torch.randn(4, 8)
    ctx = torchfuse.lazy(options={"strict": True})
    root = trace.root_for(ctx)
    before = len(root.children.get(id(torch.ops.aten.add.Tensor), []))
    for _ in range(3):
        with ctx:
            out = (x + float("nan")).sum()
        assert torch.isnan(out)
    assert len(root.children.get(id(torch.ops.aten.add.Tensor), [])) == before


def test_many_variants_of_an_op_keep_the_newest_predicted():
    """The first op of every program seen hangs below the same root: past MAX_VARIANTS the
    oldest go, the program running now is still predicted."""
    from torchfuse.lazy import trace
    x = torch.randn(4, 8)
    for i in range(trace.MAX_VARIANTS + 4):
        lazy_run(lambda x: (x * (i + 0.5)).sum(), x)      # a new scalar: a new variant
    for _ in range(2):
        out, ctx = lazy_run(program, x, x)
    assert ctx.trace_misses == 0 and ctx.trace_hits > 0
    torch.testing.assert_close(out, program(x, x))


def test_a_training_step_is_predicted_through_its_backward():
    """Backward ops take bool lists (native_layer_norm_backward's output_mask): a step must
    predict them, or prediction stops at the first one, every step."""
    torch.manual_seed(11)
    model = torch.nn.Sequential(torch.nn.Linear(6, 10), torch.nn.LayerNorm(10), torch.nn.GELU(),
                                torch.nn.Linear(10, 3))
    ref = torch.nn.Sequential(*[type(m)(*a) for m, a in ((model[0], (6, 10)), (model[1], (10,)),
                                                          (model[2], ()), (model[3], (10, 3)))])
    ref.load_state_dict(model.state_dict())
    block = torchfuse.lazy(capture_modules=False, options={"strict": True})
    for step in range(3):
        x = torch.randn(5, 6)
        misses, hits = block.trace_misses, block.trace_hits
        with block:
            loss = model(x).square().mean()
            loss.backward()
        ref_loss = ref(x).square().mean()
        ref_loss.backward()
        torch.testing.assert_close(loss, ref_loss)
        for p, q in zip(model.parameters(), ref.parameters()):
            torch.testing.assert_close(p.grad, q.grad)
            p.grad = q.grad = None
    # the third step: forward and backward all predicted (nothing recorded the ordinary way)
    assert block.trace_misses == misses and block.trace_hits - hits > 20
