"""Functional collectives scheduled around compute (scheduler/overlap.py, the waits fusion holds
back in scheduler/fusion.py): each start runs as soon as its inputs exist, ahead of work that
does not need it; each wait right before the first step reading its result; a wait does not
split a fusion group; a start's input is not overwritten before its wait.

One process, a gloo group of one (an in-memory store, no port): the collectives run for real
(an all-reduce over one rank is the identity), and the generated wrapper's order is read from
the debug folder, where the wrapper marks each start and wait."""
from __future__ import annotations

import re

import pytest
import torch
import torch.distributed as dist

import torchfuse

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                                reason="needs torch.distributed with gloo")
c10d = None


@pytest.fixture(scope="module")
def group() -> str:
    """The name of a world of one process (torch.distributed's default group)."""
    global c10d
    import torch.distributed._functional_collectives  # noqa: F401  (registers the _c10d_functional ops)
    c10d = torch.ops._c10d_functional
    mine = not dist.is_initialized()
    if mine:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield dist.group.WORLD.group_name
    finally:
        if mine:
            dist.destroy_process_group()


def _calls(tmp_path) -> list[str]:
    """The plain `call` of the (one) compiled graph's wrapper, one step per entry: kernel calls
    by kernel name, ATen calls as "start"/"wait"/"aten", allocations, checks and dels left out."""
    (path,) = tmp_path.rglob("*wrapper.py")
    body = path.read_text().split("\ndef call_profiled")[0]
    steps = []
    for line in body.splitlines():
        m = re.match(r"    (?:\w+ = )?((?:poi|red)_fused_\w+)\(", line)
        if m:
            steps.append(m.group(1))
        elif line.endswith("starts"):
            steps.append("start")
        elif "# wait for the collective" in line:
            steps.append("wait")
        elif re.match(r"    (?:\w+ = )?_c\d+\((?!\()", line):       # an ATen call (not an allocation)
            steps.append("aten")
    return steps


def _explain(fn, args, tmp_path):
    with torch.no_grad():
        e = torchfuse.explain(fn, *args, options={"debug": True, "debug_dir": tmp_path})
        torch.testing.assert_close(e.output, fn(*args), rtol=1e-5, atol=1e-5)
    return e, _calls(tmp_path)


def test_start_before_independent_work_wait_before_first_reader(group, tmp_path):
    """Dynamo traces the wait right after its start; the matmul and the kernels that do not read
    the gathered tensor run between them (the cosine too, though lowering realizes it after the
    sum that reads the gathered tensor), and the wait comes right before its reader."""
    def fn(x, y, w):
        a = torch.relu(x * 2)
        g = c10d.wait_tensor(c10d.all_gather_into_tensor(a, 1, group))
        z = torch.sin(y) + 1
        return (g * 3 + 1).sum(), (z @ w).cos()

    torch.manual_seed(0)
    e, steps = _explain(fn, (torch.randn(8, 13), torch.randn(5, 13), torch.randn(13, 7)), tmp_path)
    assert len(e.kernels) == 4, [k.name for k in e.kernels]
    relu, sin_add, cos, red = (next(s for s in steps if s.startswith(p)) for p in
                               ("poi_fused_mul_relu", "poi_fused_sin_add", "poi_fused_cos", "red_fused"))
    assert steps.index("start") == steps.index(relu) + 1, steps
    assert steps.index("start") < steps.index(sin_add) < steps.index(cos) < steps.index("wait"), steps
    assert steps.index("start") < steps.index("aten") < steps.index("wait"), steps     # the matmul
    assert steps[steps.index("wait") + 1] == red, steps
    (line,) = e.collectives
    assert "all_gather_into_tensor" in line and "meanwhile 2 kernel(s), 1 ATen call(s) (mm)" in line, line
    assert "collectives" in str(e)
    assert {f.op.split(".")[1] for f in e.fallbacks if "communication" in f.reason} == \
        {"all_gather_into_tensor", "wait_tensor"}, e.fallbacks


def test_start_raised_with_its_producers(group, tmp_path):
    """A backward's pattern: the input gradient (x @ w1, then a kernel) is all-reduced, the weight
    gradient (y @ w2) is not needed by it.  The start moves with its producers ahead of the
    independent matmul, which then overlaps the communication."""
    def fn(x, y, w1, w2):
        p = y @ w2                                  # independent: first in program order
        h = (x @ w1) * 2 + 1
        s = c10d.wait_tensor(c10d.all_reduce(h, "sum", group))
        return s.tanh(), p.relu()

    torch.manual_seed(0)
    args = (torch.randn(6, 11), torch.randn(9, 11), torch.randn(11, 5), torch.randn(11, 3))
    e, steps = _explain(fn, args, tmp_path)
    assert len(e.kernels) == 3, [k.name for k in e.kernels]
    start, wait = steps.index("start"), steps.index("wait")
    assert steps[:start] == ["aten", next(s for s in steps if s.startswith("poi_fused_mm_mul_add")
                                          or s.startswith("poi_fused_mul_add"))], steps
    assert "aten" in steps[start + 1:wait], steps               # y @ w2 runs during the all-reduce
    assert steps[wait + 1].startswith("poi_fused_tanh"), steps


def test_wait_does_not_split_a_fusion_group(group, tmp_path):
    """A row sum realized between a start and its wait, and the element-wise epilogue reading the
    sum and the collective's result, are one reduction kernel (the wait goes before it): with the
    wait where Dynamo traced it, the epilogue was a second kernel after the wait."""
    def fn(x, y):
        g = c10d.all_reduce(x @ x.t(), "sum", group)
        q = torch.exp(y) * 2
        s = q.sum(1, keepdim=True)
        return (q - s) * c10d.wait_tensor(g)

    torch.manual_seed(0)
    e, steps = _explain(fn, (torch.randn(7, 3), torch.randn(7, 7)), tmp_path)
    assert len(e.kernels) == 1, [k.name for k in e.kernels]
    assert steps == ["aten", "start", "wait", e.kernels[0].name.split(".")[-1]], steps
    assert e.kernels[0].kind == "reduction"


def test_start_input_not_overwritten_before_its_wait(group, tmp_path):
    """A kernel between a start and its wait that reads the start's input last must not write
    its output into that input's storage: the communication reads it until the wait."""
    def fn(x, v, u, w):
        a = x.relu()
        g = c10d.wait_tensor(c10d.all_gather_into_tensor(a, 1, group))
        b = a * (v @ u) - 1     # a's last reader, after a matmul: a donor for b without the collective
        return g @ w, b

    torch.manual_seed(0)
    args = (torch.randn(9, 6), torch.randn(1, 5), torch.randn(5, 6), torch.randn(6, 4))
    _, steps = _explain(fn, args, tmp_path)
    (path,) = tmp_path.rglob("*wrapper.py")
    body = path.read_text().split("\ndef call_profiled")[0]
    start = body.index("starts")
    wait = body.index("# wait for the collective")
    assert steps.index("start") < steps.index(next(s for s in steps if s.startswith("poi_fused_mul_sub"))) \
        < steps.index("wait"), steps
    assert "in place" not in body[start:wait], body
