"""C++ index checks made before a kernel's loops (backends/cpp/checks.py: emit_precheck): an index
that depends on fewer loops than the kernel has is checked once per value, and the loops use it
unchecked; a bad index still raises eager's error naming it, and the kernel never runs its loops."""
from __future__ import annotations

import pytest
import torch

import torchfuse

WIN, HEADS = 5, 3
N = WIN * WIN


def _relpos_index() -> torch.Tensor:
    coords = torch.stack(torch.meshgrid(torch.arange(WIN), torch.arange(WIN), indexing="ij")).flatten(1)
    rel = (coords[:, :, None] - coords[:, None, :]).permute(1, 2, 0) + (WIN - 1)
    return rel[..., 0] * (2 * WIN - 1) + rel[..., 1]


def _relpos_softmax(scores, table, index):
    bias = table[index.view(-1)].view(N, N, HEADS).permute(2, 0, 1)
    return torch.softmax(scores + bias, -1)


def _vector_loops(source: str) -> str:
    """The text of the kernel's `omp simd` loops over its elements (not the checks' own loops
    before them, which end with the early return of a failed check)."""
    lines = source.splitlines()
    main = max((k for k, line in enumerate(lines) if "return 1; }" in line and
                any("for (" in later for later in lines[k:])), default=-1) + 1
    out, depth = [], 0
    for line in lines[main:]:
        if depth == 0 and "#pragma omp simd" in line:
            depth = -1                      # the next line opens the loop
            continue
        if depth:
            out.append(line)
            depth = (0 if depth == -1 else depth) + line.count("{") - line.count("}")
    return "\n".join(out)


def test_relative_position_bias_checked_before_loops():
    scores = torch.randn(6, HEADS, N, N)
    table = torch.randn((2 * WIN - 1) ** 2, HEADS)
    index = _relpos_index()
    index[::3] -= (2 * WIN - 1) ** 2             # negative indices count from the end
    torch._dynamo.reset()
    report = torchfuse.explain(_relpos_softmax, scores, table, index)
    (kernel,) = report.kernels
    assert "tf_check_index" in kernel.source
    loops = _vector_loops(kernel.source)
    assert "tf_expf" in loops                   # (the softmax's loops)
    assert "tf_check_index" not in loops and "tf_clamp_index" not in loops and "tf_bad" not in loops
    torch._dynamo.reset()
    f = torch.compile(_relpos_softmax, backend="torchfuse")
    torch.testing.assert_close(f(scores, table, index), _relpos_softmax(scores, table, index))
    for bad in ((2 * WIN - 1) ** 2, -(2 * WIN - 1) ** 2 - 1, 10 ** 12):
        idx = index.clone()
        idx[3, 7] = bad
        with pytest.raises(IndexError):
            _relpos_softmax(scores, table, idx)
        with pytest.raises(IndexError, match=f"index {bad} "):
            f(scores, table, idx)
    torch.testing.assert_close(f(scores, table, index), _relpos_softmax(scores, table, index))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_edge_gather_checked_before_loops(dtype):
    x = torch.randn(37, 19).to(dtype)
    edges = torch.randint(0, 37, (2, 101))

    def fn(x, e):
        return torch.relu(x[e[0]] + x[e[1]])
    torch._dynamo.reset()
    (kernel,) = torchfuse.explain(fn, x, edges).kernels
    loops = _vector_loops(kernel.source)
    assert "relu" in kernel.name and loops and "tf_check_index" not in loops
    torch._dynamo.reset()
    f = torch.compile(fn, backend="torchfuse")
    torch.testing.assert_close(f(x, edges), fn(x, edges))
    e = edges.clone()
    e[1, 50] = 37
    with pytest.raises(IndexError, match="index 37 is out of bounds for dimension 0 with size 37"):
        f(x, e)


def test_decode_position_checked_once_and_cache_untouched():
    """A decode step's position gathers rotary rows and writes the cache in place: a bad
    position raises before the kernel writes any row (the cache keeps its values)."""
    cache = torch.randn(2, 3, 17, 8)
    cos, sin = torch.randn(17, 8), torch.randn(17, 8)
    k = torch.randn(2, 3, 1, 8)

    def step(cache, k, cos, sin, pos):
        k = k * cos[pos] + k.flip(-1) * sin[pos]
        cache.index_copy_(2, pos, k)
        return cache.sum(-1)
    torch._dynamo.reset()
    f = torch.compile(step, backend="torchfuse")
    want_cache, got_cache = cache.clone(), cache.clone()
    pos = torch.tensor([11])
    torch.testing.assert_close(f(got_cache, k, cos, sin, pos), step(want_cache, k, cos, sin, pos))
    torch.testing.assert_close(got_cache, want_cache)
    before = got_cache.clone()
    with pytest.raises(IndexError, match="index 17 "):
        f(got_cache, k, cos, sin, torch.tensor([17]))
    torch.testing.assert_close(got_cache, before, rtol=0, atol=0)


def test_index_read_by_gather_and_scatter_checked_in_one_pass():
    """Messages x[src] / s[dst] added into row dst: dst is checked as gathered and as scattered
    to, one pass over it before the loops (a pass per index, src and dst, not per site)."""
    x, s = torch.randn(37, 19), torch.rand(37) + 1
    src, dst = torch.randint(-37, 37, (301,)), torch.randint(0, 37, (301,))

    def fn(x, s, src, dst):
        return torch.zeros_like(x).index_add(0, dst, x[src] / s[dst][:, None])
    torch._dynamo.reset()
    kernel = next(k for k in torchfuse.explain(fn, x, s, src, dst).kernels if "omp_get_max_threads" in k.source)
    before_loops = kernel.source[:kernel.source.index("omp_get_max_threads")]
    assert before_loops.count("tf_check_index(") == 2, kernel.source
    torch._dynamo.reset()
    f = torch.compile(fn, backend="torchfuse")
    torch.testing.assert_close(f(x, s, src, dst), fn(x, s, src, dst))
    bad = dst.clone()
    bad[200] = 37
    with pytest.raises(IndexError):
        fn(x, s, src, bad)
    with pytest.raises(IndexError, match="index 37 "):
        f(x, s, src, bad)
