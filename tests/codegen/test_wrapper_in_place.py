"""The generated wrapper's in-place decisions (codegen/wrapper.py): a pointwise kernel writes into
a buffer that dies at it, and the kernel computing an input's new value (batch norm's running
statistics) writes the input itself instead of a copy_ after the graph.  Both backends, compared
with eager; the wrapper source is read from the debug folder to see what was decided."""
from __future__ import annotations

import copy
import os
import re

import pytest
import torch
import torch.nn as nn

import torchfuse
from torchfuse import counters

os.environ.setdefault("TRITON_INTERPRET", "1")
BACKENDS = {"cpp": {}, "triton": {"cpu_backend": "triton"}}


def _wrappers(tmp_path) -> str:
    """The wrappers' `call` functions (without `call_profiled`, the same steps for the profiler)."""
    return "\n".join(p.read_text().split("\ndef call_profiled")[0].rsplit("\n#", 1)[0]
                     for p in sorted(tmp_path.rglob("*wrapper.py")))


def _cnn() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8), nn.ReLU(),
                         nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU())


@pytest.mark.parametrize("backend", sorted(BACKENDS))
@pytest.mark.parametrize("channels_last", [False, True])
def test_training_batch_norm_updates_running_stats_in_place(tmp_path, backend, channels_last):
    if backend == "triton":
        pytest.importorskip("triton")
    eager = _cnn().train()
    model = copy.deepcopy(eager)
    x = torch.randn(4, 3, 9, 7) * 2 + 1
    if channels_last:
        x = x.to(memory_format=torch.channels_last)
    torch._dynamo.reset()
    compiled = torchfuse.compile(model, options={**BACKENDS[backend], "debug": True, "debug_dir": tmp_path})
    for _ in range(2):
        xe, xc = x.clone().requires_grad_(), x.clone().requires_grad_()
        eager(xe).square().mean().backward()
        compiled(xc).square().mean().backward()
        torch.testing.assert_close(xc.grad, xe.grad, rtol=1e-4, atol=1e-5)
    for (name, b), (_, be) in zip(model.named_buffers(), eager.named_buffers()):
        torch.testing.assert_close(b, be, rtol=1e-5, atol=1e-6, msg=name)
    src = _wrappers(tmp_path)
    # running_mean, running_var and num_batches_tracked of both batch norms
    assert src.count("# the input it updates") == 6, src


@pytest.mark.parametrize("backend", sorted(BACKENDS))
def test_pointwise_output_reuses_a_dying_buffer(tmp_path, backend):
    if backend == "triton":
        pytest.importorskip("triton")
    w = torch.randn(8, 8)

    def fn(x, y):
        h = x @ w                 # an ATen result that dies at the next kernel
        return torch.relu(h * 2 + 1) @ w, (y.sin() + 1)   # an input dying there is never written

    x, y = torch.randn(5, 8), torch.randn(7)
    before = y.clone()
    reused = counters["buffers_reused_in_place"]
    e = torchfuse.explain(fn, x, y, options={**BACKENDS[backend], "debug": True, "debug_dir": tmp_path})
    torch.testing.assert_close(e.output[0], fn(x, y)[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(e.output[1], before.sin() + 1)
    assert torch.equal(y, before)
    assert counters["buffers_reused_in_place"] > reused
    assert "# in place:" in _wrappers(tmp_path)


@pytest.mark.parametrize("backend", sorted(BACKENDS))
def test_pointwise_reads_a_reshaped_buffer_in_place(tmp_path, backend):
    """A ConvNeXt MLP: the [N*H*W, 4C] matmul result is read through a [N, H, W, 4C] view by the
    bias + GELU kernel, whose index unflattens the row into three dims; once simplified it is
    the element the kernel writes, so the GELU writes into the matmul's buffer (one fewer
    4C-wide buffer at the peak: planned peak three [N*H*W, 4C] buffers -> two)."""
    if backend == "triton":
        pytest.importorskip("triton")
    torch.manual_seed(0)
    fc1, fc2 = nn.Linear(12, 48), nn.Linear(48, 12)

    def fn(x):
        y = x.permute(0, 2, 3, 1)
        return fc2(torch.nn.functional.gelu(fc1(y))).permute(0, 3, 1, 2) + x

    x = torch.randn(2, 12, 5, 7)
    with torch.no_grad():
        e = torchfuse.explain(fn, x, options={**BACKENDS[backend], "debug": True, "debug_dir": tmp_path,
                                              "cublas_devices": ("cpu", "cuda")})
        torch.testing.assert_close(e.output, fn(x), rtol=1e-5, atol=1e-5)
    src = _wrappers(tmp_path)
    assert src.count("# in place:") == 1, src
    assert "0 B written in place" not in e.memory[0], e.memory


def test_no_reuse_of_a_buffer_with_live_views(tmp_path):
    """h dies at the kernel computing r, but a view of h is returned: h must not be written."""
    w = torch.randn(6, 6)

    def fn(x):
        h = x @ w
        return h.t(), torch.relu(h) * 3

    x = torch.randn(6, 6)
    e = torchfuse.explain(fn, x, options={"debug": True, "debug_dir": tmp_path})
    torch.testing.assert_close(e.output[0], (x @ w).t())
    torch.testing.assert_close(e.output[1], torch.relu(x @ w) * 3)


def test_planned_peak_is_reported_and_counts_reuse():
    """explain() reports the wrapper's planned peak per graph: a chain of ATen matmuls and
    pointwise kernels on [64, 64] fp32 (16 KiB each) holds at most three buffers at a time."""
    w = torch.randn(64, 64)

    def fn(x):
        for _ in range(4):
            x = torch.relu(x @ w) * 0.5
        return x

    x = torch.randn(64, 64)
    e = torchfuse.explain(fn, x)
    torch.testing.assert_close(e.output, fn(x), rtol=1e-4, atol=1e-4)
    assert len(e.memory) == 1 and "planned peak" in e.memory[0], e.memory
    peak, _, allocated, in_place = (float(v) for v in re.findall(r"([0-9.]+) KiB", e.memory[0])[:4])
    assert 16 <= peak <= 3 * 16, e.memory[0]
    assert in_place >= 16 and allocated + in_place >= 8 * 16, e.memory[0]


@pytest.mark.parametrize("backend", sorted(BACKENDS))
def test_value_needed_in_memory_is_read_not_recomputed(tmp_path, backend):
    """y = relu(x * 2 + r) has two consumers: a convolution (ATen, so y is written to memory) and
    a later add.  The add reads y's buffer instead of recomputing it from x and r, which would
    read more bytes and keep x and r alive until then."""
    if backend == "triton":
        pytest.importorskip("triton")
    w = torch.randn(6, 5, 3, 3)

    def fn(x, r):
        y = torch.relu(x * 2 + r)
        return torch.nn.functional.conv2d(y, w, padding=1) + y[:, :1]

    x, r = torch.randn(2, 5, 7, 9), torch.randn(5, 1, 1)
    e = torchfuse.explain(fn, x, r, options={**BACKENDS[backend], "debug": True, "debug_dir": tmp_path})
    torch.testing.assert_close(e.output, fn(x, r), rtol=1e-4, atol=1e-4)
    src = _wrappers(tmp_path)
    calls = re.findall(r"(?:poi|red)_fused_\w*\((.*)\)", src)
    assert len(calls) == 2, src
    y = re.search(r"(buf\d+)\s*=\s*\S*\(\s*(buf\d+)\s*,", src.split(calls[0])[1])   # the conv's first argument
    assert y is not None, src
    assert y.group(2) in calls[1] and "in0" not in calls[1] and "in1" not in calls[1], src


def test_multi_output_fallback_releases_its_tuple(tmp_path):
    """An ATen op returning several tensors (max_pool2d_with_indices): once they are unpacked the
    tuple is dropped, so an output whose last reader ran (the indices here, read by nothing) is
    freed then, not when the graph returns."""
    def fn(x):
        v, _ = torch.nn.functional.max_pool2d(x.sin(), 3, 2, 1, return_indices=True)
        return v.cos() * 2

    x = torch.randn(2, 3, 11, 9)
    # max-pooling is lowered to a kernel: run it through ATen here, as a multi-output fallback
    e = torchfuse.explain(fn, x, options={"debug": True, "debug_dir": tmp_path,
                                          "fallback_ops": ["aten.max_pool2d_with_indices.default"]})
    torch.testing.assert_close(e.output, fn(x))
    src = _wrappers(tmp_path)
    tuples = re.findall(r"(_r_\w+) = ", src)
    assert tuples, src
    for t in tuples:
        lines = src[src.index(f"{t} = "):].splitlines()
        unpacked = [k for k, line in enumerate(lines) if f"= {t}[" in line]
        assert lines[max(unpacked) + 1].strip() == f"del {t}", src


def _mib(text: str, pattern: str) -> float:
    """The size `pattern` matches in `text` (its NUM marking the number), in MiB."""
    value, unit = re.search(pattern.replace("NUM", r"([0-9.]+) (B|KiB|MiB)"), text).groups()
    return float(value) / {"B": 2 ** 20, "KiB": 1024, "MiB": 1}[unit]


def test_training_backward_drops_saved_activations():
    """The backward graph's inputs (the activations the forward saved, handed over in a list the
    wrapper clears) are dropped after their last reader: a 4-layer MLP's backward then peaks at
    no more than its inputs on entry plus the parameter gradients it returns plus two
    activation-sized working buffers (holding every input to the end would be ~1 MiB more)."""
    torch.manual_seed(0)
    model = nn.Sequential(*[m for _ in range(4) for m in (nn.Linear(256, 256), nn.Tanh())])
    eager = copy.deepcopy(model)

    def step(m, x):
        m(x).square().mean().backward()

    x = torch.randn(512, 256)
    e = torchfuse.explain(step, model, x)
    step(eager, x)
    for p, q in zip(model.parameters(), eager.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-6)
    backward = next(m for m in e.memory if "backward" in m)
    inputs = _mib(backward, "inputs NUM")
    peak = _mib(backward, "held by the wrapper, NUM with the inputs")
    activation = 512 * 256 * 4 / 2 ** 20
    grads = sum(p.numel() * 4 for p in model.parameters()) / 2 ** 20
    assert _mib(backward, "NUM of them dropped") == inputs > 4 * activation, backward
    assert peak <= inputs + grads + 2 * activation, backward


def test_value_feeding_a_channels_last_convolution_is_written_channels_last(tmp_path):
    """A channel shuffle's `.contiguous()` is NCHW in eager, but only the next (channels-last)
    convolution reads it: the kernel writes it channels-last, so cuDNN/oneDNN copy nothing."""
    conv = nn.Conv2d(8, 8, 3, padding=1, groups=8).to(memory_format=torch.channels_last)

    def fn(x):
        n, c, h, w = x.shape
        y = torch.relu(x).view(n, 2, c // 2, h, w).transpose(1, 2).contiguous().view(n, c, h, w)
        return conv(y)

    x = torch.randn(2, 8, 6, 5).to(memory_format=torch.channels_last)
    with torch.no_grad():
        e = torchfuse.explain(fn, x, options={"debug": True, "debug_dir": tmp_path})
        torch.testing.assert_close(e.output, fn(x))
    src = _wrappers(tmp_path)
    allocs = re.findall(r"buf\d+ = \w+\(\(2, 8, 6, 5, \), \(([\d, ]+)\), ", src)
    assert allocs and all(a.replace(" ", "") == "240,1,40,8," for a in allocs), src


@pytest.mark.parametrize("backend", sorted(BACKENDS))
def test_shuffle_half_stored_for_a_convolution_is_channels_last(tmp_path, backend):
    """ShuffleNet's block: the shuffled value is split in halves, stored at the split (the first
    half is read again after the convolutions); the half only a channels-last convolution reads
    is stored channels-last, and so is the other: its node says NCHW (the shuffle's
    `.contiguous()`), but it is computed from channels-last inputs only, and stored NCHW its
    kernel would write it transposed (`lowering/realize.channels_last_inputs`)."""
    torch.manual_seed(0)
    convs = [nn.Conv2d(4, 4, 1).to(memory_format=torch.channels_last) for _ in range(2)]

    def fn(x, a, b, c):
        n, ch, h, w = x.shape
        y = torch.relu(x * a + b * c)     # reads 4 tensors: stored rather than recomputed twice
        y = y.view(n, 2, ch // 2, h, w).transpose(1, 2).contiguous().view(n, ch, h, w)
        x1, x2 = y.chunk(2, dim=1)
        return torch.cat([x1, convs[1](torch.relu(convs[0](x2)))], 1) * 2

    args = [torch.randn(2, 8, 6, 5).to(memory_format=torch.channels_last) for _ in range(4)]
    with torch.no_grad():
        # (inline_max_cost=0: a value with two readers is stored, as a costlier one is on a GPU)
        e = torchfuse.explain(fn, *args, options={"debug": True, "debug_dir": tmp_path, "inline_max_cost": 0,
                                                   **BACKENDS[backend]})
        torch.testing.assert_close(e.output, fn(*args))
    src = _wrappers(tmp_path)
    allocs = sorted(a.replace(" ", "") for a in re.findall(r"buf\d+ = \w+\(\(2, 4, 6, 5, \), \(([\d, ]+)\), ", src))
    assert allocs == ["120,1,20,4,", "120,1,20,4,"], src


@pytest.mark.parametrize("row", [40, 33000])
def test_row_held_in_registers_gets_no_buffer(tmp_path, row):
    """softmax(s) of a value too costly to recompute in each reader (stored, so it is computed
    once): s is read by the max, the exponentials and their sum.  A Triton reduction that holds
    the whole row in registers (rows up to PERSISTENT_LIMIT) never stores it, so the wrapper
    allocates nothing for it; longer rows are walked in chunks by the looped variant, which
    reads it back from memory (a real buffer)."""
    pytest.importorskip("triton")

    def fn(a, b):
        return torch.softmax(a.sin() * b.cos() + a.exp() * 0.1, -1) * 2

    a, b = torch.randn(3, row), torch.randn(3, row) * 3
    e = torchfuse.explain(fn, a, b, options={"cpu_backend": "triton", "debug": True, "debug_dir": tmp_path})
    torch.testing.assert_close(e.output, fn(a, b))
    src = _wrappers(tmp_path)
    planned = re.search(r"([0-9.]+ [KM]?i?B) allocated", e.memory[0]).group(1)
    out_bytes = f"{3 * row * 4 / 1024:.1f} KiB" if row > 256 else f"{3 * row * 4} B"
    if row <= 32768:
        assert src.count("# held in registers") == 1, src
        assert planned == out_bytes, e.memory    # the output alone
    else:
        assert "# held in registers" not in src, src
        assert planned != out_bytes, e.memory


@pytest.mark.parametrize("row, dim", [(40, -1), (33000, -1), (300, 0)])
@pytest.mark.parametrize("stored_logits", [False, True])
def test_softmax_probabilities_overwrite_the_scores(tmp_path, row, dim, stored_logits):
    """A Triton reduction's elementwise output takes the storage of a same-sized input that dies
    at it (attention probabilities over the scores), in the persistent variant (the row in
    registers), the looped one (rows longer than PERSISTENT_LIMIT, read again chunk by chunk
    before each chunk is written) and column tiles (softmax over dim 0); also when the scores
    are read only by a member computing the softmax's input (too costly to recompute, so a
    member of its own: T5's scores + position bias)."""
    pytest.importorskip("triton")
    torch.manual_seed(0)
    w = torch.randn(16, row)

    def fn(x):
        h = x @ w
        if stored_logits:
            h = torch.tanh(h) * torch.sigmoid(h) + h.exp() * 0.01
        return torch.softmax(h, dim) * 3

    x = torch.randn(6, 16)
    e = torchfuse.explain(fn, x, options={"cpu_backend": "triton", "cublas_devices": ("cpu", "cuda"),
                                          "debug": True, "debug_dir": tmp_path})
    torch.testing.assert_close(e.output, fn(x), rtol=1e-5, atol=1e-6)
    src = _wrappers(tmp_path)
    # the matmul's result is the only [6, row] storage: every later [6, row] value reuses it,
    # but for the stored softmax input of rows too long for registers (the looped variant
    # reads it back)
    carried = 1 if stored_logits and row > 32768 else 0
    assert "# in place:" in src and len(re.findall(rf"= _c\d+\(\(6, {row}, \)", src)) == carried, src


def test_looped_reduction_with_two_row_outputs_takes_one_storage(tmp_path):
    """Rows longer than the persistent limit, read in chunks by two passes (the sum, then
    h * 2 + 1 and h / sum): the output computed from the sum takes h's storage, the other gets
    its own, and both equal eager's."""
    pytest.importorskip("triton")
    torch.manual_seed(0)
    w = torch.randn(8, 33000)

    def fn(x):
        h = x @ w
        s = h * 2 + 1
        return s, h / h.sum(1, keepdim=True)

    x = torch.randn(3, 8)
    e = torchfuse.explain(fn, x, options={"cpu_backend": "triton", "cublas_devices": ("cpu", "cuda"),
                                          "debug": True, "debug_dir": tmp_path})
    ref = fn(x)
    torch.testing.assert_close(e.output[0], ref[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(e.output[1], ref[1], rtol=1e-4, atol=1e-6)
    assert _wrappers(tmp_path).count("# in place:") == 1


@pytest.mark.parametrize("backend", sorted(BACKENDS))
def test_state_before_a_concatenation_slice_takes_the_old_states_storage(tmp_path, backend):
    """An LSTM step stores the cell state c and then h, straight into its slice of the stacked
    outputs (lowering/cat_slots.py).  The slice takes no storage; c takes the dying c's, and h, which
    reads c's new value, gets it from the kernel's registers, not from the overwritten buffer."""
    if backend == "triton":
        pytest.importorskip("triton")
    torch.manual_seed(0)
    w = torch.randn(8, 32) / 3

    def fn(x):
        h = c = x.new_zeros(x.shape[0], 8)
        outs = []
        for t in range(x.shape[1]):
            i, f, g, o = (x[:, t] + h @ w).chunk(4, 1)
            c = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g)
            h = torch.sigmoid(o) * torch.tanh(c)
            outs.append(h)
        return torch.stack(outs, 1).flatten(0, 1) @ w

    x = torch.randn(3, 6, 32)
    e = torchfuse.explain(fn, x, options={**BACKENDS[backend], "debug": True, "debug_dir": tmp_path})
    torch.testing.assert_close(e.output, fn(x), rtol=1e-5, atol=1e-5)
    src = _wrappers(tmp_path)
    assert "cat" in src and src.count("# in place:") >= 4, src
