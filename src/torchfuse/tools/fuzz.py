"""A random-program fuzzer: hypothesis builds small tensor programs, torchfuse must agree with eager.

    python -m torchfuse.tools.fuzz --examples 300 --seed 1 --max-ops 8
    python -m torchfuse.tools.fuzz --dynamic [--triton]     # symbolic sizes; Triton's interpreter
    python -m torchfuse.tools.fuzz --bad-values [--triton | --lazy]   # out-of-range indices,
                                                            # zero and -1 divisors, INT_MIN

A program is straight-line Python over 1-4 input tensors: chains and DAGs of pointwise ops
(with broadcasting and Python scalars), views (permute, transpose, slice, select, expand,
reshape, squeeze/unsqueeze, flip), reductions (sum, mean, amax, prod, argmax, var, softmax, ...),
casts, `cat`, and in-place ops (on inputs, intermediates and views of them).  Inputs have random
shapes (size-1 and odd sizes), dtypes (float32, float64, float16, bfloat16, int32, int64, bool)
and layouts (contiguous, transposed, step-sliced, offset, expanded).  Every op is run eagerly
while the program is drawn, so only programs that eager PyTorch accepts are generated.

Index remapping that is not a view (roll, pad, tril/triu, index_select, gather, repeat) is
drawn too, and half of the programs are compiled with `parallel_threshold=1`, so that every
loop runs through its OpenMP path although the tensors are small.

What real models bring (the "real models" section; `--real-models` draws mostly these):
Python and 0-d tensor scalars as inputs (Dynamo passes an unspecialized one as a 0-d CPU
tensor; with `--device cuda` the other inputs go to the GPU and 0-d ones stay on the host),
int64 and bool values and literals in every position (stored, cast, compared, selected,
clamped, filled, reduced; Python ints beyond int32), gathers by computed index tensors,
`grid_sample` and `interpolate`, and data-dependent ops (topk, sort, nonzero) next to fused
ones.

A program is compared on its outputs and on its inputs after the call (in-place mutations);
floats within the tolerance of the least precise float dtype it computes in.  A program that
Dynamo/AOTAutograd reject without torchfuse too (backend="aot_eager") is discarded.  When one
fails, hypothesis shrinks it and the minimal program is written as a standalone pytest file
`tests/fuzz/regressions/test_case_<hash>.py` (inputs, options and the program's source).
"""
from __future__ import annotations

import argparse
import copy
import hashlib
import os
import re
import sys
import textwrap
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from .fuzz_real import PY_SCALARS, REAL_MODEL_KINDS, RealModelSteps, make_scalar

INTS = ("int32", "int64")
DTYPES = ("float32", "float32", "float64", "float16", "bfloat16", "int32", "int64", "bool")
LAYOUTS = ("contiguous", "transposed", "strided", "offset", "expanded")
SIZES = (5, 1, 3, 7, 2, 8, 4, 6, 16, 1)
RANKS = (2, 3, 1, 4, 0, 2, 3)
MAX_NUMEL = 512

DEFAULT_REGRESSION_DIR = Path(__file__).resolve().parents[3] / "tests" / "fuzz" / "regressions"


# ----------------------------------------------------------------------------------------------
# inputs
# ----------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class InputSpec:
    shape: tuple[int, ...]
    dtype: str
    layout: str = "contiguous"
    seed: int = 0


def make_input(spec: InputSpec) -> torch.Tensor:
    """A deterministic tensor of `spec.shape` whose strides follow `spec.layout`."""
    gen = torch.Generator().manual_seed(1000 + spec.seed)
    if spec.dtype in PY_SCALARS:
        return make_scalar(spec, gen)
    shape, dtype, nd = tuple(spec.shape), getattr(torch, spec.dtype), len(spec.shape)

    def data(s: Sequence[int]) -> torch.Tensor:
        if dtype == torch.bool:
            return torch.randint(0, 2, tuple(s), generator=gen).bool()
        if dtype.is_floating_point:
            return (torch.randn(tuple(s), generator=gen, dtype=torch.float64) * 2).to(dtype)
        return torch.randint(-4, 5, tuple(s), generator=gen).to(dtype)

    layout = spec.layout
    if layout == "transposed" and nd >= 2:
        return data(shape[::-1]).permute(*reversed(range(nd)))
    if layout == "strided" and nd >= 1:
        return data(shape[:-1] + (2 * shape[-1] + 1,))[..., 1::2]
    if layout == "offset" and nd >= 1:
        return data((shape[0] + 1,) + shape[1:])[1:]
    if layout == "expanded" and nd >= 1:
        dims = [d for d, s in enumerate(shape) if s > 1]
        if dims:
            base = list(shape)
            base[dims[0]] = 1
            return data(base).expand(*shape)
    return data(shape)


def make_inputs(specs: Sequence[InputSpec], device: str | None = None) -> list[Any]:
    """The inputs; with `device`, tensors of rank >= 1 live there and 0-d tensors stay on the
    host (as Dynamo passes an unspecialized Python number next to a model's GPU tensors)."""
    inputs = [make_input(s) for s in specs]
    if device is not None:
        inputs = [x.to(device) if isinstance(x, torch.Tensor) and x.ndim else x for x in inputs]
    return inputs


# ----------------------------------------------------------------------------------------------
# programs
# ----------------------------------------------------------------------------------------------

@dataclass
class Program:
    inputs: list[InputSpec] = field(default_factory=list)
    lines: list[str] = field(default_factory=list)
    outputs: list[str] = field(default_factory=list)
    options: dict = field(default_factory=dict)     # torchfuse options it is compiled with

    def source(self, name: str = "program") -> str:
        params = ", ".join(f"a{k}" for k in range(len(self.inputs)))
        body = self.lines + [f"return ({', '.join(self.outputs)},)"]
        return f"def {name}({params}):\n" + "".join(f"    {ln}\n" for ln in body)

    def function(self) -> Callable:
        env: dict[str, Any] = {"torch": torch}
        exec(compile(self.source(), "<fuzz program>", "exec"), env)
        return env["program"]

    def digest(self) -> str:
        text = self.source() + repr(self.inputs) + (repr(sorted(self.options.items())) if self.options else "")
        return hashlib.sha1(text.encode()).hexdigest()[:12]

    def __str__(self) -> str:
        return self.source() + "".join(f"# a{k}: {s}\n" for k, s in enumerate(self.inputs)) + \
            (f"# options: {self.options}\n" if self.options else "")


class _Builder(RealModelSteps):
    """Draws a program op by op, running each op eagerly on the real inputs to keep it valid."""

    def __init__(self, draw: Callable, st: Any, real_models: bool = False):
        self.draw, self.st = draw, st
        self.real_models = real_models     # draw mostly what real models bring (fuzz_real.py)
        self.prog = Program()
        self.env: dict[str, Any] = {"torch": torch}
        self.vars: list[str] = []
        self.count = 0

    # -- inputs ---------------------------------------------------------------------------
    def new_input(self, shape: Sequence[int], dtype: str | None = None) -> str:
        st = self.st
        dtype = dtype or self.draw(st.sampled_from(DTYPES))
        layout = self.draw(st.sampled_from(LAYOUTS))
        spec = InputSpec(tuple(int(s) for s in shape), dtype, layout, seed=len(self.prog.inputs))
        name = f"a{len(self.prog.inputs)}"
        self.prog.inputs.append(spec)
        self.env[name] = make_input(spec)
        self.vars.append(name)
        return name

    def shape(self, max_rank: int = 4) -> tuple[int, ...]:
        st = self.st
        rank = min(self.draw(st.sampled_from(RANKS)), max_rank)
        dims = [self.draw(st.sampled_from(SIZES)) for _ in range(rank)]
        while dims and _numel(dims) > MAX_NUMEL:
            dims.pop()
        return tuple(dims)

    # -- helpers ------------------------------------------------------------------------------
    def pick(self, pred: Callable[[torch.Tensor], bool] = lambda t: True) -> str | None:
        cands = [v for v in self.vars if isinstance(self.env[v], torch.Tensor) and pred(self.env[v])]
        if not cands:
            return None
        k = self.draw(self.st.integers(0, len(cands) - 1))
        return cands[-1 - k]                  # shrinks towards the most recent value: a chain

    def dim(self, t: torch.Tensor) -> int:
        d = self.draw(self.st.integers(0, max(t.ndim - 1, 0)))
        return d - t.ndim if self.draw(self.st.booleans()) and t.ndim else d

    def try_line(self, expr: str, *, statement: bool = False) -> bool:
        """Run `expr` eagerly; keep it as the next line (binding a new var) if it works."""
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                if statement:
                    exec(expr, self.env)
                    self.prog.lines.append(expr)
                    return True
                value = eval(expr, self.env)
        except Exception:
            return False
        if not isinstance(value, torch.Tensor) or value.numel() > 4 * MAX_NUMEL:
            return False
        name = f"v{self.count}"
        self.count += 1
        self.env[name] = value
        self.vars.append(name)
        self.prog.lines.append(f"{name} = {expr}")
        return True

    def broadcast_partner(self, t: torch.Tensor) -> str:
        """An existing value or a new input whose shape broadcasts against `t`."""
        st = self.st
        same = [v for v in self.vars if isinstance(self.env[v], torch.Tensor) and _broadcasts(self.env[v].shape, t.shape)]
        if same and self.draw(st.booleans()):
            k = self.draw(st.integers(0, len(same) - 1))
            return same[-1 - k]
        shape = list(t.shape)
        drop = self.draw(st.integers(0, len(shape)))
        shape = shape[drop:]
        shape = [1 if self.draw(st.booleans()) else s for s in shape]
        return self.new_input(shape)

    # -- ops ------------------------------------------------------------------------------------
    def step(self) -> None:
        st, draw = self.st, self.draw
        kind = draw(st.sampled_from(("unary", "binary", "scalar", "view", "reduce", "cast", "inplace",
                                     "binary", "unary", "view", "where", "cat", "reduce", "misc", "view")
                                    + REAL_MODEL_KINDS * (3 if self.real_models else 1)))
        if kind in REAL_MODEL_KINDS:
            return self.real_model_step(kind)
        x = self.pick()
        if x is None:
            return
        t = self.env[x]
        if kind == "unary":
            fn = draw(st.sampled_from(UNARY))
            self.try_line(fn.format(x=x))
        elif kind == "binary":
            fn = draw(st.sampled_from(BINARY))
            y = self.broadcast_partner(t)
            a, b = (x, y) if draw(st.booleans()) else (y, x)
            self.try_line(fn.format(x=a, y=b))
        elif kind == "scalar":
            fn = draw(st.sampled_from(SCALAR))
            self.try_line(fn.format(x=x, s=draw(st.sampled_from((2, -1, 0.5, 3, -2.5, 1e-3)))))
        elif kind == "where":
            c = self.pick(lambda u: u.dtype == torch.bool and _broadcasts(u.shape, t.shape))
            if c is None:
                c = f"({x} > 0)"
            y = self.broadcast_partner(t)
            other = y if draw(st.booleans()) else draw(st.sampled_from(("0.0", "-1", "2.5")))
            self.try_line(f"torch.where({c}, {x}, {other})")
        elif kind == "cat":
            if t.ndim == 0:
                return
            d = self.dim(t)
            y = self.pick(lambda u: u.ndim == t.ndim)
            self.try_line(f"torch.cat([{x}, {y}], {d})")
        elif kind == "cast":
            fn = draw(st.sampled_from(CASTS))
            self.try_line(fn.format(x=x))
        elif kind == "reduce":
            self.reduce(x, t)
        elif kind == "view":
            self.view(x, t)
        elif kind == "inplace":
            self.inplace(x, t)
        elif kind == "misc":
            self.misc(x, t)

    def misc(self, x: str, t: torch.Tensor) -> None:
        """Index remapping that is not a view: roll, pad, tril, index_select, gather, repeat."""
        st, draw = self.st, self.draw
        if t.ndim == 0:
            return
        d = self.dim(t)
        size = t.shape[d]
        kind = draw(st.sampled_from(("roll", "pad", "tril", "index_select", "gather", "repeat", "flip2")))
        if kind == "roll":
            self.try_line(f"torch.roll({x}, {draw(st.integers(-size - 1, size + 1))}, {d})")
        elif kind == "pad":
            lo, hi = draw(st.integers(-1, 2)), draw(st.integers(0, 2))
            value = draw(st.sampled_from(("0", "1.5", "-1")))
            self.try_line(f"torch.nn.functional.pad({x}, ({lo}, {hi}), value={value})")
        elif kind == "tril" and t.ndim >= 2:
            fn = draw(st.sampled_from(("tril", "triu")))
            self.try_line(f"torch.{fn}({x}, {draw(st.integers(-2, 2))})")
        elif kind == "index_select":
            idx = [draw(st.integers(0, max(size - 1, 0))) for _ in range(draw(st.integers(1, 4)))]
            self.try_line(f"torch.index_select({x}, {d}, torch.tensor({idx}))")
        elif kind == "gather":
            self.try_line(f"torch.gather({x}, {d}, {x}.argmax({d}, keepdim=True).expand_as({x}).flip({d}))")
        elif kind == "repeat":
            reps = [draw(st.sampled_from((1, 2, 3))) for _ in range(t.ndim + draw(st.integers(0, 1)))]
            self.try_line(f"{x}.repeat({', '.join(map(str, reps))})")
        elif kind == "flip2" and t.ndim >= 2:
            self.try_line(f"{x}.flip(0, -1)")

    def reduce(self, x: str, t: torch.Tensor) -> None:
        st, draw = self.st, self.draw
        fn = draw(st.sampled_from(REDUCE))
        if t.ndim == 0 or draw(st.integers(0, 3)) == 0:
            dim = ""
        else:
            dim = str(self.dim(t))
            if t.ndim >= 2 and draw(st.booleans()) and "{dims}" in fn:
                d2 = (int(dim) + 1) % t.ndim
                dim = f"({int(dim) % t.ndim}, {d2})"
        keep = draw(st.booleans())
        dims = dim if dim or "dim={dims}" not in fn else "None"
        self.try_line(fn.format(x=x, dims=dims, dim=dim or "0", keep=keep))

    def view(self, x: str, t: torch.Tensor) -> None:
        st, draw = self.st, self.draw
        kind = draw(st.sampled_from(("permute", "transpose", "slice", "select", "unsqueeze", "squeeze",
                                     "expand", "reshape", "flip", "t", "chunk", "unbind")))
        nd = t.ndim
        if kind == "permute" and nd >= 2:
            perm = draw(st.permutations(list(range(nd))))
            self.try_line(f"{x}.permute({', '.join(map(str, perm))})")
        elif kind == "transpose" and nd >= 2:
            self.try_line(f"{x}.transpose({self.dim(t)}, {self.dim(t)})")
        elif kind == "t" and nd <= 2:
            self.try_line(f"{x}.t()")
        elif kind == "slice" and nd >= 1:
            d = self.dim(t) % nd
            size = t.shape[d]
            start = draw(st.integers(-size, size))
            stop = draw(st.one_of(st.none(), st.integers(-size, size + 2)))
            step = draw(st.sampled_from((1, 1, 2, 3)))
            sl = f"{start}:{'' if stop is None else stop}{'' if step == 1 else f':{step}'}"
            self.try_line(f"{x}[{', '.join([':'] * d + [sl])}]")
        elif kind == "select" and nd >= 1:
            d = self.dim(t) % nd
            i = draw(st.integers(-t.shape[d], max(t.shape[d] - 1, 0)))
            self.try_line(f"{x}.select({d}, {i})")
        elif kind == "unsqueeze":
            self.try_line(f"{x}.unsqueeze({draw(st.integers(-nd - 1, nd))})")
        elif kind == "squeeze" and nd >= 1:
            ones = [d for d, s in enumerate(t.shape) if s == 1]
            self.try_line(f"{x}.squeeze({draw(st.sampled_from(ones))})" if ones else f"{x}.squeeze()")
        elif kind == "expand":
            lead = draw(st.sampled_from((0, 0, 1)))
            sizes = [draw(st.sampled_from((2, 3))) for _ in range(lead)]
            sizes += [draw(st.sampled_from((1, 3, 4))) if s == 1 else -1 for s in t.shape]
            if sizes:
                self.try_line(f"{x}.expand({', '.join(map(str, sizes))})")
        elif kind == "reshape":
            shape = _refactor(list(t.shape), draw, st)
            self.try_line(f"{x}.reshape({', '.join(map(str, shape))}{',' if len(shape) == 1 else ''})")
        elif kind == "chunk" and nd >= 1:
            d = self.dim(t)
            n = draw(st.integers(1, 3))
            self.try_line(f"{x}.chunk({n}, {d})[{draw(st.integers(-1, n - 1))}]")
        elif kind == "unbind" and nd >= 1:
            d = self.dim(t) % nd
            self.try_line(f"{x}.unbind({d})[{draw(st.integers(0, max(t.shape[d] - 1, 0)))}]")
        elif kind == "flip" and nd >= 1:
            self.try_line(f"{x}.flip({self.dim(t)})")

    def inplace(self, x: str, t: torch.Tensor) -> None:
        st, draw = self.st, self.draw
        if any(s > 1 and st_ == 0 for s, st_ in zip(t.shape, t.stride())):
            return                              # an expanded value cannot be written in place
        kind = draw(st.sampled_from(("op_", "scalar_", "setitem", "copy_")))
        if kind == "op_":
            y = self.broadcast_partner(t)
            fn = draw(st.sampled_from(("add_", "sub_", "mul_", "maximum", "copy_")))
            if fn == "maximum":
                self.try_line(f"{x}.copy_(torch.maximum({x}, {y}))")
            else:
                self.try_line(f"{x}.{fn}({y})")
        elif kind == "scalar_":
            fn = draw(st.sampled_from(("mul_(2)", "add_(1)", "clamp_(-1, 1)", "relu_()", "neg_()", "fill_(3)",
                                       "zero_()", "abs_()")))
            self.try_line(f"{x}.{fn}")
        elif kind == "setitem" and t.ndim >= 1:
            d = self.dim(t) % t.ndim
            i = draw(st.integers(0, max(t.shape[d] - 1, 0)))
            value = draw(st.sampled_from(("0", "-1", "2.5")))
            idx = ", ".join([":"] * d + [str(i) if draw(st.booleans()) else f"{i}:"])
            self.try_line(f"{x}[{idx}] = {value}", statement=True)
        elif kind == "copy_":
            y = self.pick(lambda u: _broadcasts(u.shape, t.shape))
            if y is not None and y != x:
                self.try_line(f"{x}.copy_({y})")

    def finish(self) -> Program:
        st, draw = self.st, self.draw
        made = [v for v in self.vars if v.startswith("v")]
        if not made:      # the last tensor input (a Python-number input is no output)
            made = [v for v in self.vars if isinstance(self.env[v], torch.Tensor)][-1:]
        outs = [made[-1]]
        # every value nothing else reads is an output too (else dead code would be removed)
        import re
        for v in reversed(made[:-1]):
            pattern = re.compile(rf"\b{v}\b")
            readers = [ln for ln in self.prog.lines if pattern.search(ln.split("=", 1)[1] if " = " in ln else ln)]
            if not readers and len(outs) < 4:
                outs.append(v)
        if draw(st.booleans()) and len(made) > 1:
            v = made[draw(st.integers(0, len(made) - 1))]
            if v not in outs:
                outs.append(v)
        self.prog.outputs = outs
        return self.prog


UNARY = ["torch.neg({x})", "torch.abs({x})", "torch.sin({x})", "torch.cos({x})", "torch.tanh({x})",
         "torch.sigmoid({x})", "torch.exp({x})", "torch.relu({x})", "torch.sqrt({x})", "torch.floor({x})",
         "torch.reciprocal({x})", "torch.nn.functional.gelu({x})", "torch.nn.functional.silu({x})",
         "torch.log1p(torch.abs({x}))", "torch.logical_not({x})", "torch.sign({x})", "torch.square({x})",
         "torch.bitwise_not({x})", "torch.isnan({x})", "{x}.clone()", "{x}.contiguous()"]
BINARY = ["torch.add({x}, {y})", "torch.sub({x}, {y})", "torch.mul({x}, {y})", "torch.div({x}, {y})",
          "torch.maximum({x}, {y})", "torch.minimum({x}, {y})", "torch.eq({x}, {y})", "torch.gt({x}, {y})",
          "torch.logical_and({x}, {y})", "torch.bitwise_xor({x}, {y})", "torch.bitwise_and({x}, {y})",
          "torch.atan2({x}, {y})", "torch.add({x}, {y}, alpha=2)", "torch.remainder({x}, {y}.float().abs() + 1)",
          "torch.fmod({x}, {y}.float().abs() + 1)", "torch.floor_divide({x}, {y}.abs() + 1)",
          "torch.pow({x}.abs() + 0.5, {y}.float().clamp(-2, 2))", "({x} * {y} + {x})", "({x} - {y}) * ({x} + {y})"]
SCALAR = ["({x} + {s})", "({x} * {s})", "({x} - {s})", "({x} / {s})", "({x} ** 2)", "torch.clamp({x}, -1, {s})",
          "({x} > {s})", "torch.rsub({x}, {s})", "torch.pow({s}, {x}.float().clamp(-3, 3))",
          "torch.nn.functional.leaky_relu({x}, 0.1)", "torch.nn.functional.hardtanh({x})"]
REDUCE = ["{x}.sum({dims})", "{x}.sum(dim={dims}, keepdim={keep})", "{x}.float().mean({dims})",
          "{x}.amax({dims})", "{x}.amin(dim={dims}, keepdim={keep})", "{x}.prod({dim})", "{x}.argmax({dim})",
          "{x}.max(dim={dim}, keepdim={keep}).values", "{x}.min({dim}).indices", "{x}.any({dim})",
          "{x}.all({dim})", "{x}.double().var({dims})", "torch.softmax({x}.float(), {dim})",
          "torch.log_softmax({x}.double(), {dim})", "{x}.float().norm()", "torch.logsumexp({x}.float(), {dim})",
          "{x}.sum({dims}).float() / 3", "({x} - {x}.float().mean({dims}, keepdim=True))"]
CASTS = ["{x}.to(torch.float32)", "{x}.double()", "{x}.bool()", "{x}.to(torch.int64)",
         "torch.nan_to_num({x}.double()).clamp(-1000, 1000).to(torch.int32)", "{x}.float() * 1.0",
         "{x}.to(torch.float64).to(torch.float32)", "{x}.float().clamp(-1000, 1000).half()",
         "{x}.float().bfloat16()", "{x}.half().float()"]


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _broadcasts(small: Sequence[int], big: Sequence[int]) -> bool:
    if len(small) > len(big):
        return False
    return all(s == 1 or s == b for s, b in zip(reversed(list(small)), reversed(list(big))))


def _refactor(shape: list[int], draw: Callable, st: Any) -> list[int]:
    """A shape with the same number of elements: merge two adjacent dims, split one, or flatten."""
    choice = draw(st.sampled_from(("merge", "split", "flatten", "minus1")))
    if choice == "flatten" or not shape:
        return [_numel(shape)] if shape else [1]
    if choice == "merge" and len(shape) >= 2:
        d = draw(st.integers(0, len(shape) - 2))
        return shape[:d] + [shape[d] * shape[d + 1]] + shape[d + 2:]
    if choice == "minus1":
        d = draw(st.integers(0, len(shape) - 1))
        out = list(shape)
        out[d] = -1
        return out
    d = draw(st.integers(0, len(shape) - 1))
    n = shape[d]
    divisors = [k for k in range(1, n + 1) if n % k == 0]
    k = draw(st.sampled_from(divisors))
    return shape[:d] + [k, n // k] + shape[d + 1:]


def programs(max_ops: int = 6, real_models: bool = False):
    """The hypothesis strategy of `Program`s; `real_models` draws mostly what real models
    bring (scalar inputs, typed literals, index tensors, sampling, data-dependent ops)."""
    from hypothesis import strategies as st

    @st.composite
    def strategy(draw):
        b = _Builder(draw, st, real_models)
        n_inputs = draw(st.integers(1, 2))
        base = b.shape()
        for _ in range(n_inputs):
            shape = list(base)
            if draw(st.booleans()):
                shape = [1 if draw(st.booleans()) else s for s in shape]
            b.new_input(shape)
        if draw(st.integers(0, 2 if real_models else 5)) == 0:
            b.new_scalar_input()
        for _ in range(draw(st.integers(1, max_ops))):
            b.step()
        prog = b.finish()
        if draw(st.booleans()):
            # every loop runs under OpenMP, as large tensors do (the inputs here are small)
            prog.options = {"parallel_threshold": 1}
        return prog
    return strategy()


# ----------------------------------------------------------------------------------------------
# checking one program
# ----------------------------------------------------------------------------------------------

TOL = {torch.float32: (1e-4, 1e-4), torch.float64: (1e-9, 1e-9), torch.float16: (1e-2, 1e-2),
       torch.bfloat16: (5e-2, 5e-2)}


class Mismatch(AssertionError):
    pass


class NotTorchfuse(Exception):
    """Dynamo/AOTAutograd fail on the program without torchfuse too (backend="aot_eager")."""


def _loosest(dtypes: Sequence[torch.dtype]) -> tuple[float, float]:
    tols = [TOL[d] for d in dtypes if d in TOL]
    return (max(t[0] for t in tols), max(t[1] for t in tols)) if tols else (0.0, 0.0)


def _eager_with_dtypes(fn: Callable, inputs: Sequence[torch.Tensor]) -> tuple[Any, set[torch.dtype]]:
    """Run `fn` eagerly and collect the dtype of every tensor any aten op produced: a float64
    output computed through float32 intermediates is only as accurate as float32."""
    from torch.utils._python_dispatch import TorchDispatchMode

    seen: set[torch.dtype] = {t.dtype for t in inputs if isinstance(t, torch.Tensor)}

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for o in (out if isinstance(out, (list, tuple)) else [out]):
                if isinstance(o, torch.Tensor):
                    seen.add(o.dtype)
            return out

    with Record():
        out = fn(*inputs)
    return out, seen


def compare(got: Any, expected: Any, what: str, tol: tuple[float, float] | None = None) -> None:
    g = got if isinstance(got, (list, tuple)) else [got]
    e = expected if isinstance(expected, (list, tuple)) else [expected]
    if len(g) != len(e):
        raise Mismatch(f"{what}: {len(g)} values, eager has {len(e)}")
    for k, (a, b) in enumerate(zip(g, e)):
        label = f"{what} {k}"
        if not isinstance(a, torch.Tensor):
            raise Mismatch(f"{label}: got {type(a).__name__}")
        if a.shape != b.shape:
            raise Mismatch(f"{label}: shape {tuple(a.shape)} != eager {tuple(b.shape)}")
        if a.dtype != b.dtype:
            raise Mismatch(f"{label}: dtype {a.dtype} != eager {b.dtype}")
        if a.device != b.device:
            raise Mismatch(f"{label}: device {a.device} != eager {b.device}")
        atol, rtol = tol if tol is not None and b.dtype.is_floating_point else TOL.get(b.dtype, (0, 0))
        try:
            torch.testing.assert_close(a, b, atol=atol, rtol=rtol, equal_nan=True, check_stride=False)
        except AssertionError as err:
            raise Mismatch(f"{label}: {err}") from None


def check(fn: Callable, inputs: Sequence[torch.Tensor], *, options: dict | None = None) -> None:
    """Run `fn` eagerly and through torchfuse on copies of `inputs`; outputs and the inputs after
    the call (in-place ops) must match, floats within the tolerance of the least precise float
    dtype the program computes in.  Build errors raise (strict mode).  `options` are torchfuse's,
    plus "dynamic": True to compile with symbolic sizes (torch.compile(dynamic=True)); with
    "cpu_backend": "triton" the kernels run under Triton's interpreter."""
    from ..config import Config
    from ..frontend.dynamo import TorchfuseBackend

    options = dict(options or {})
    dynamic = bool(options.pop("dynamic", False))
    device = options.pop("device", None)
    if device is not None:
        inputs = [x.to(device) if isinstance(x, torch.Tensor) and x.ndim else x for x in inputs]
    missing = {k: v for k, v in _backend_environment(options).items() if os.environ.get(k) != v}
    if missing:
        raise RuntimeError(f"the {options.get('cpu_backend')} backend needs {missing} in the environment before "
                           "it is imported (before the first torch.compile)")
    eager_in, tf_in = copy.deepcopy(list(inputs)), copy.deepcopy(list(inputs))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        expected, dtypes = _eager_with_dtypes(fn, eager_in)
        torch._dynamo.reset()
        try:
            # (first_calls="wait": what is judged is the compiled graph, not the ATen tier)
            backend = TorchfuseBackend(Config.from_options({"strict": True, "first_calls": "wait", **options}))
            got = torch.compile(fn, backend=backend, dynamic=dynamic)(*tf_in)
        except Exception as e:
            torch._dynamo.reset()
            if "no Triton-interpreter implementation" in str(e):
                # a libdevice function the CPU interpreter lacks (backends/triton/codegen.py), not a bug
                raise NotTorchfuse(str(e)) from e
            try:
                torch.compile(fn, backend="aot_eager", dynamic=dynamic)(*copy.deepcopy(list(inputs)))
            except Exception as e2:
                raise NotTorchfuse(f"aot_eager fails too: {type(e2).__name__}: {e2}") from e
            if _outputs_share_storage(expected):
                e.add_note(ALIASED_OUTPUTS)
            raise
        finally:
            torch._dynamo.reset()
    tol = _loosest(sorted(dtypes, key=str))
    try:
        compare(got, expected, "output", tol)
        compare([x for x in tf_in if isinstance(x, torch.Tensor)],
                [x for x in eager_in if isinstance(x, torch.Tensor)], "input (after the call)", tol)
    except Mismatch as e:
        if _outputs_share_storage(expected):
            e.add_note(ALIASED_OUTPUTS)
        raise


ALIASED_OUTPUTS = "(eager's outputs share storage)"


def _outputs_share_storage(outputs: Any) -> bool:
    outs = [o for o in (outputs if isinstance(outputs, (list, tuple)) else [outputs])
            if isinstance(o, torch.Tensor) and o.numel()]
    ptrs = [o.untyped_storage().data_ptr() for o in outs]
    return len(set(ptrs)) < len(ptrs)


def check_program(prog: Program, options: dict | None = None) -> None:
    check(prog.function(), make_inputs(prog.inputs), options={**prog.options, **(options or {})})



# ----------------------------------------------------------------------------------------------
# running hypothesis and writing regressions
# ----------------------------------------------------------------------------------------------

REGRESSION_TEMPLATE = '''\
"""Fuzzer regression {digest}: a minimal program on which torchfuse disagreed with eager.

Found by `torchfuse.tools.fuzz` (hypothesis shrank it); the error was:

{error}
"""
{preamble}import torch

from torchfuse.tools.fuzz import InputSpec, check, make_inputs
{triton_setup}
INPUTS = [
{inputs}
]
OPTIONS = {options!r}


{source}

def test_case_{digest}():
    check(program, make_inputs(INPUTS), options=OPTIONS)
'''


def clean_error(error: str) -> str:
    """The error without Dynamo's boilerplate (backend object repr, TORCHDYNAMO_VERBOSE hint)."""
    error = re.sub(r"BackendCompilerFailed: backend='<[^>]*>' raised:\s*", "", error)
    error = re.sub(r"\s*Set TORCHDYNAMO_VERBOSE=1.*?TORCH_LOGS=\"\+dynamo\"", "", error, flags=re.S)
    return error.strip()


def _backend_environment(options: dict) -> dict[str, str]:
    """What the CPU backend these options pick needs set before it is imported."""
    from .. import backends
    from ..config import Config
    config = Config.from_options({k: v for k, v in options.items() if k not in ("dynamic", "device")})
    return backends.for_device("cpu", config).environment


def regression_source(prog: Program, error: str) -> str:
    error = clean_error(error)
    err = textwrap.indent("\n".join(textwrap.wrap(" ".join(error.split())[:600], 92)), "    ")
    inputs = "\n".join(f"    {s!r}," for s in prog.inputs)
    # (Triton reads TRITON_INTERPRET once, when it is imported; torchfuse's import does not)
    env = _backend_environment(prog.options)
    preamble = "import os\n\nimport pytest\n" if env else ""
    setup = "".join(f'\nos.environ.setdefault("{k}", "{v}")' for k, v in env.items())
    setup += f'\npytest.importorskip("{prog.options["cpu_backend"]}")\n' if env else ""
    return REGRESSION_TEMPLATE.format(digest=prog.digest(), error=err.replace('"""', "'"), inputs=inputs,
                                      source=prog.source(), options=prog.options, preamble=preamble,
                                      triton_setup=setup)


def write_regression(prog: Program, error: str, out_dir: Path | str = DEFAULT_REGRESSION_DIR) -> Path:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"test_case_{prog.digest()}.py"
    path.write_text(regression_source(prog, error))
    return path


@dataclass
class FuzzResult:
    examples: int
    failure: Program | None = None
    error: str = ""
    regression: Path | None = None
    known: int = 0             # programs that hit a bug of KNOWN_BUGS (counted, not reported)


# Open bugs outside the op lowerings, with an xfailed repro each (tests/fuzz/regressions,
# tests/opinfo/test_known_failures.py): (pattern of the error text, the bug).  With
# `ignore_known` a program failing this way counts as known instead of failing the run, so the
# fuzzer goes on looking for new bugs.  (The error text includes ALIASED_OUTPUTS when eager's
# outputs share storage, the mark of the output-aliasing bugs fixed in lowering.py.)
KNOWN_BUGS: list[tuple[str, str]] = []


def run_fuzz(max_examples: int = 40, *, seed: int | None = 0, max_ops: int = 6, out_dir: Path | str | None =
             DEFAULT_REGRESSION_DIR, options: dict | None = None, verbose: bool = False,
             ignore_known: bool = True, real_models: bool = False) -> FuzzResult:
    """Check `max_examples` random programs; on a failure, shrink it and (if `out_dir`) write the
    minimal program as a regression test.  `seed=None` draws fresh programs every run."""
    from hypothesis import HealthCheck, Phase, given, reject, settings
    from hypothesis import seed as hseed

    state = FuzzResult(0)
    last: dict[str, Any] = {}

    @settings(max_examples=max_examples, deadline=None, database=None, derandomize=False,
              report_multiple_bugs=False, print_blob=False,
              suppress_health_check=list(HealthCheck),
              phases=(Phase.generate, Phase.shrink))
    @given(programs(max_ops, real_models))
    def test(prog: Program) -> None:
        state.examples += 1
        if verbose:
            print(f"--- example {state.examples}\n{prog}", file=sys.stderr, flush=True)
        try:
            check_program(prog, options)
        except NotTorchfuse:
            reject()                       # a limitation of Dynamo/AOTAutograd, not of torchfuse
        except Exception as e:
            error = " ".join([f"{type(e).__name__}: {e}", *getattr(e, "__notes__", [])])
            if ignore_known and any(re.search(pat, error) for pat, _ in KNOWN_BUGS):
                state.known += 1
                return
            last["prog"], last["error"] = prog, clean_error(error)
            raise

    if seed is not None:
        test = hseed(seed)(test)
    try:
        test()
    except Exception:
        if "prog" not in last:
            raise
        state.failure, state.error = last["prog"], last["error"]
        # the run's options (dynamic, the Triton backend) go into the regression test too
        state.failure.options = {**state.failure.options, **(options or {})}
        if out_dir is not None:
            state.regression = write_regression(state.failure, state.error, out_dir)
    return state


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m torchfuse.tools.fuzz", description=__doc__.split("\n")[0])
    p.add_argument("--examples", type=int, default=200)
    p.add_argument("--seed", type=int, default=None, help="hypothesis seed (default: random)")
    p.add_argument("--max-ops", type=int, default=6)
    p.add_argument("--out-dir", default=str(DEFAULT_REGRESSION_DIR), help="where regression tests go")
    p.add_argument("--no-write", action="store_true", help="do not write a regression test")
    p.add_argument("--verbose", action="store_true", help="print every program")
    p.add_argument("--report-known", action="store_true", help="fail on the bugs of KNOWN_BUGS too")
    p.add_argument("--dynamic", action="store_true", help="compile with symbolic sizes (dynamic=True)")
    p.add_argument("--triton", action="store_true", help="the Triton backend, under Triton's interpreter")
    p.add_argument("--real-models", action="store_true", help="draw mostly what real models bring (fuzz_real.py)")
    p.add_argument("--device", default=None, help="run on this device (e.g. cuda); 0-d inputs stay on the host")
    p.add_argument("--bad-values", action="store_true",
                   help="adversarial indices and divisors instead (tools/fuzz_bad_values.py)")
    p.add_argument("--lazy", action="store_true", help="with --bad-values: through torchfuse.lazy()")
    a = p.parse_args(argv)
    if a.triton:
        os.environ.setdefault("TRITON_INTERPRET", "1")      # before anything imports triton
    if a.bad_values:
        from . import fuzz_bad_values
        mode = "triton" if a.triton else "lazy" if a.lazy else "cpp"
        failures = fuzz_bad_values.run(a.examples, seed=a.seed or 0, mode=mode)
        for case, msg in failures[:10]:
            print(f"{case}: {msg}")
        print(f"{a.examples} cases ({mode}): {len(failures)} failed")
        return 1 if failures else 0
    options = {**({"dynamic": True} if a.dynamic else {}), **({"cpu_backend": "triton"} if a.triton else {}),
               **({"device": a.device} if a.device else {})}
    r = run_fuzz(a.examples, seed=a.seed, max_ops=a.max_ops, out_dir=None if a.no_write else a.out_dir,
                 options=options or None, verbose=a.verbose, ignore_known=not a.report_known,
                 real_models=a.real_models)
    known = f" ({r.known} hit a known bug of KNOWN_BUGS)" if r.known else ""
    if r.failure is None:
        print(f"{r.examples} programs: no failure{known}")
        return 0
    print(f"failure after {r.examples} programs (incl. shrinking){known}:\n{r.failure}\n{r.error[:2000]}")
    if r.regression:
        print(f"regression test written to {r.regression}")
    return 1


if __name__ == "__main__":
    sys.exit(main())
