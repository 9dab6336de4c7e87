"""What real models bring to the fuzzer (torchfuse.tools.fuzz): its "real models" steps.

The fuzzer's first programs were chains of pointwise ops, views and reductions over float
tensors.  Real models (transformers' MoE decoders, torchvision's RAFT) broke torchfuse with what
those programs lacked:
  scalars      Python numbers and 0-d tensors as inputs (Dynamo passes an unspecialized Python
               float as a 0-d CPU tensor; next to GPU tensors it must not reach a kernel's
               pointer arguments)
  literal      int64 and bool values and literals in every position: stored, cast, compared,
               selected, clamped, filled, reduced; Python ints beyond int32
  index        gathers by computed index tensors (index_select, gather, embedding, advanced
               indexing by a tensor or a 0-d tensor, take_along_dim)
  sample       grid_sample and interpolate
  routing      data-dependent ops (topk, sort, argsort, nonzero, one_hot, scatter of expert ids)
               next to fused ones
Each step is an expression that eager PyTorch must accept on the drawn inputs (the builder runs
it), so a template may be drawn where it does not apply and is then dropped.
"""
from __future__ import annotations

from typing import Any

import torch

REAL_MODEL_KINDS = ("literal", "index", "sample", "routing", "scalar_input")
PY_SCALARS = ("pyfloat", "pyint")     # InputSpec dtypes of Python numbers (not tensors)

INT_LITERALS = ("0", "0", "-1", "3", "2 ** 40", "-2 ** 33", "2 ** 31")   # 0: the MoE decoder's store
FLOAT_LITERALS = ("0.0", "-1.5", "float('-inf')", "1e-3")
LITERAL_DTYPES = ("int64", "int64", "int64", "int32", "bool", "float16", "bfloat16", "float32", "float64")

LITERAL = [
    "torch.full_like({x}, {lit}, dtype=torch.{dt})", "torch.zeros_like({x}, dtype=torch.{dt})",
    "{x}.new_full(({n},), {lit}, dtype=torch.{dt})", "torch.full(({n},), {lit})",
    "torch.where({x} > 0, {lit}, {x})", "torch.where({x} > 0, {x}, {lit})", "torch.where({x} < 0, {lit}, {lit2})",
    "{x}.masked_fill({x} > 0, {lit})", "({x} > {lit}).to(torch.{dt})", "({x} == {lit})", "({x} >= {lit}) & ({x} < 2)",
    "{x}.to(torch.int64).clamp(min={lit})", "{x}.to(torch.int64).clamp(max={lit})", "({x}.to(torch.int64) + {lit})",
    "({x}.to(torch.int64) * {lit})", "torch.maximum({x}.to(torch.int64), torch.full_like({x}, {lit}, dtype=torch.int64))",
    "(({x} != 0).sum({dim}) * {lit})", "({x} > 0).to(torch.int64).amax({dim})", "({x} > 0).any({dim}).to(torch.{dt})",
    "torch.nn.functional.pad({x}.to(torch.int64), (1, 1), value={lit})", "{x}.to(torch.{dt}) * 0 + {lit}",
    "torch.where({x} > 0, torch.ones_like({x}, dtype=torch.bool), torch.zeros_like({x}, dtype=torch.bool))",
]
INDEX = [
    "{x}.index_select({d}, (torch.arange({k}) * 3 + 1) % {size})",
    "{x}.index_select({d}, {y}.flatten().argsort()[:{k}] % {size})",
    "torch.gather({x}, {d}, ({x}.float().abs() * 3).nan_to_num().clamp(0, 100).long() % {size})",
    "torch.take_along_dim({x}, {x}.float().argsort({d}), {d})",
    "{x}[{y}.flatten().float().argmax() % {size0}]",
    "{x}[({y}.flatten().float().abs() * 5).nan_to_num().clamp(0, 100).long() % {size0}]",
    "{x}.flatten()[torch.tensor([0, -1, 1])]",
    "torch.nn.functional.embedding(({y}.float().abs() * 5).nan_to_num().clamp(0, 100).long() % {size0}, {x}.float())",
    "{x}.index_select({d}, ({x}.float().sum() > 0).long().reshape(1) % {size})",
]
SAMPLE = [
    "torch.nn.functional.interpolate({img}, scale_factor=2, mode='nearest')",
    "torch.nn.functional.interpolate({img}, size=({h2}, {w2}), mode='bilinear', align_corners={ac})",
    "torch.nn.functional.interpolate({img}, scale_factor=0.5, mode='bilinear', align_corners={ac})",
    "torch.nn.functional.interpolate({img}, size=({h2}, {w2}), mode='nearest-exact')",
    "torch.nn.functional.grid_sample({img}, torch.tanh({grid}) * 1.2, mode='{mode}', padding_mode='{pad}', "
    "align_corners={ac})",
]
ROUTING = [
    "torch.topk({x}.float().flatten(), {k}).values * 2",
    "torch.topk({x}.float(), {kd}, dim={d}).indices + 1",
    "torch.sort({x}, dim={d}).values",
    "torch.sort({x}.float(), {d}, descending=True).indices.to(torch.int32)",
    "{x}.flatten().nonzero().squeeze(-1) * 2",
    "torch.nn.functional.one_hot(({x}.float().abs() * 3).nan_to_num().clamp(0, 100).long() % 4, 4)",
    "torch.zeros({rows}, 4, dtype=torch.int64).scatter(1, torch.topk({x}.float().reshape({rows}, -1), "
    "{k2}, -1).indices % 4, 1)",
    "(torch.topk(torch.softmax({x}.float().reshape({rows}, -1), -1), {k2}, -1).values.sum(-1, keepdim=True) "
    "* {x}.float().reshape({rows}, -1))",
]
SCALAR_USES = [
    "({x} * {s})", "({x} + {s})", "torch.where({x} > {s}, {x}, {s})", "({x} > {s})", "({x} - {s}).to(torch.int64)",
    "{x}.float().clamp(max={s})", "torch.full_like({x}, {s}, dtype=torch.float32)",
]


def make_scalar(spec: Any, gen: torch.Generator) -> float | int:
    """A Python number for an InputSpec of dtype "pyfloat" or "pyint" (never zero)."""
    if spec.dtype == "pyint":
        v = int(torch.randint(-4, 5, (), generator=gen))
        return v or 2
    return round(float(torch.randn((), generator=gen, dtype=torch.float64)) * 2, 3) or 0.5


class RealModelSteps:
    """The fuzzer builder's steps for what real models bring (mixed into fuzz._Builder)."""

    draw: Any
    st: Any
    env: dict

    def new_scalar_input(self) -> str:
        """A Python number or a 0-d tensor as an input."""
        kind = self.draw(self.st.sampled_from(PY_SCALARS + ("float32", "float64", "int64", "bool")))
        return self.new_input((), kind)

    def _scalars(self) -> list[str]:
        return [v for v in self.vars if isinstance(self.env[v], (int, float)) and not isinstance(self.env[v], bool)
                or isinstance(self.env[v], torch.Tensor) and self.env[v].ndim == 0 and v.startswith("a")]

    def real_model_step(self, kind: str) -> None:
        st, draw = self.st, self.draw
        if kind == "scalar_input":
            s = self.draw(st.sampled_from(self._scalars() or [self.new_scalar_input()]))
            x = self.pick(lambda u: u.ndim > 0)
            if x is not None:
                self.try_line(draw(st.sampled_from(SCALAR_USES)).format(x=x, s=s))
            return
        x = self.pick()
        if x is None:
            return
        t = self.env[x]
        if kind == "literal":
            ints = t.dtype in (torch.int32, torch.int64, torch.bool) or draw(st.booleans())
            lits = INT_LITERALS if ints else FLOAT_LITERALS
            fill = {"x": x, "lit": draw(st.sampled_from(lits)), "lit2": draw(st.sampled_from(lits)),
                    "dt": draw(st.sampled_from(LITERAL_DTYPES)), "n": draw(st.sampled_from((1, 3, 7))),
                    "dim": self.dim(t) if t.ndim else "None"}
            self.try_line(draw(st.sampled_from(LITERAL)).format(**fill))
        elif kind == "index" and t.ndim:
            d = self.dim(t)
            y = self.pick(lambda u: u.numel() > 0) or x
            fill = {"x": x, "y": y, "d": d, "size": t.shape[d], "size0": t.shape[0],
                    "k": draw(st.integers(1, 5))}
            self.try_line(draw(st.sampled_from(INDEX)).format(**fill))
        elif kind == "sample" and t.numel():
            self._sample(x, t)
        elif kind == "routing" and t.ndim:
            d = self.dim(t)
            rows = t.shape[0]
            fill = {"x": x, "d": d, "k": draw(st.integers(1, min(4, t.numel()))),
                    "kd": draw(st.integers(1, max(min(3, t.shape[d]), 1))), "rows": rows,
                    "k2": min(2, t.numel() // max(rows, 1)) or 1}
            self.try_line(draw(st.sampled_from(ROUTING)).format(**fill))

    def _sample(self, x: str, t: torch.Tensor) -> None:
        """An image [N, C, H, W] made from `x` (float), sampled by interpolate or grid_sample."""
        st, draw = self.st, self.draw
        w = t.shape[-1] if t.ndim else 1
        img = f"{x}.float().reshape(1, 1, -1, {w})"
        h = t.numel() // max(w, 1)
        fill = {"img": img, "h2": draw(st.sampled_from((1, 3, 2 * h + 1))), "w2": draw(st.sampled_from((2, 5, w + 3))),
                "ac": draw(st.booleans()), "mode": draw(st.sampled_from(("bilinear", "nearest"))),
                "pad": draw(st.sampled_from(("zeros", "border", "reflection")))}
        template = draw(st.sampled_from(SAMPLE))
        if "{grid}" in template:
            fill["grid"] = self.new_input((1, draw(st.sampled_from((1, 3, 4))), draw(st.sampled_from((2, 5))), 2),
                                          "float32")
        self.try_line(template.format(**fill))
