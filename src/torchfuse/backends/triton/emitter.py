"""The Triton expression emitter: a kernel's node DAGs as Triton statements (codegen.py builds
the kernels around it)."""
from __future__ import annotations

from typing import Sequence

import torch

from ...ir.nodes import INDEX, Node, to_text, walk
from ...codegen.checks import unchecked_index
from ...codegen.common import ExprEmitter
from .lang import _CORE, _INFIX, _LIBDEVICE, INTERPRETER_LIBDEVICE, TL, literal, to_storage


def _interpreting() -> bool:
    import os
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def _only_constants(n: Node) -> bool:
    """No load, loop variable or size symbol below `n`: Triton folds it to a Python number.
    (A load is no leaf: one at a constant offset, `t0 + 1` over a value read at offset 0, is a
    tensor, and wrapping it in tl.full failed.)"""
    return not any(x.op in ("load", "var", "sym") for x in walk(n))


class TritonEmitter(ExprEmitter):
    """Node DAGs as Triton statements (see ExprEmitter for the shared CSE machinery)."""
    INDENT = "    "
    FLOORDIV = "//"

    def __init__(self, buffers: dict[str, torch.dtype], indent: int = 1):
        super().__init__(buffers, indent)
        self.mask = "None"
        self.interpreter = _interpreting()
        # exp and sqrt as eager's CUDA kernels round them (and Inductor emits them): libdevice's
        # expf (~1 ulp) and IEEE sqrt, not Triton's fast forms (tl.exp is ex2.approx of
        # x * log2(e): its error grows with |x|, to ~20 ulps at a softmax's |x| ~ 20; tl.sqrt is
        # sqrt.approx).  The interpreter has no libdevice; numpy's exp and sqrt are precise there.
        self.exp_fn = "tl.exp" if self.interpreter else "libdevice.exp"
        self.unstored: set[str] = set()     # stored buffers this variant keeps in registers
        self.static: set[str] = set()       # numels shadowed by their compile-time value
        self.drop_masks = True              # may a static numel's mask be dropped (_emit_mask)
        # Inside a looped variant's row loop: the L2 hint for loads of each buffer (see
        # _eviction); None elsewhere (no hints).
        self.evict: dict[str, str] | None = None
        self.checks: dict[Node, int] = {}       # run-time checks (codegen/checks.py) -> site
        self.ranges: dict[str, Node] = {}       # loop var -> size (indices known in range)
        # In a scatter's 2-D tile: the loop vars along the tile's rows (x); a load that depends
        # on none of them (address, own mask, nested loads) is read once per row, [YBLOCK, 1]
        # under `ymask`, and broadcast where it meets the tile
        self.row_vars: frozenset[str] = frozenset()
        # In a reduction kernel that runs a scatter: the reduced dims' loop vars (y); a load
        # that depends on none of them (the scatter's index, a per-row weight) is read once per
        # row, [XBLOCK, 1] under `xmask`, as Inductor's persistent reductions read them: an
        # [XBLOCK, RBLOCK] load of the same address issued every lane its slots (and its index
        # check's error store)
        self.reduced_vars: frozenset[str] = frozenset()

    def _narrow(self, n: Node) -> tuple[str, str] | None:
        """(mask, zero) for `n` when it is the same along the tile's other dim: a scatter row
        tile's rows (reads no x var: [YBLOCK, 1]) or a reduction's reduced dims (no y var:
        [XBLOCK, 1]); None elsewhere."""
        if self.row_vars and self.mask == "xmask" and \
                not any(v.op == "var" and v.arg in self.row_vars for v in walk(n)):
            return "ymask", "yzero"
        if self.reduced_vars and self.mask == "xmask & rmask" and \
                not any(v.op == "var" and v.arg in self.reduced_vars for v in walk(n)):
            return "xmask", "xzero"
        return None

    def _flag(self, site: int, bad: str, value: str, mask: str | None = None) -> None:
        """Record `value` where `bad` holds (in this program's live lanes) in the kernel's error
        slots (`tf_err`), which the wrapper reads after the graph (runtime/kernel_errors.py)."""
        mask = self.mask if mask is None else mask
        if mask != "None":
            bad = f"{bad} & ({mask})"
        b = f"f{self.count}"
        self.count += 1
        # (a check on sizes alone is a Python bool under the interpreter: made a tensor here)
        self.line(f"{b}_m, {b}_v = tl.broadcast(tl.zeros([1], tl.int1) | ({bad}), "
                  f"tl.zeros([1], tl.int64) + ({value}))")
        self.line(f"tl.store(tf_err + {site} + {b}_v * 0, {b}_v, mask={b}_m)")

    def _checked_divisor(self, n: Node, y: str) -> str:
        """The divisor of an integer division, 1 where it is 0 (flagged) or -1 (the quotient is
        then -x, the remainder 0: the hardware division of INT_MIN by -1 is undefined)."""
        if n in self.checks:
            z = self.tmp(f"({y} == 0)")
            self._flag(self.checks[n], z, f"{z}.to(tl.int64)")
        return self.tmp(f"tl.where(({y} == 0) | ({y} == -1), 1, {y})")

    def literal(self, value, dtype: torch.dtype) -> str:
        return literal(value, dtype)

    def index_literal(self, value: int) -> str:
        return str(int(value))

    def operand(self, n: Node, beside: Sequence[Node]) -> str:
        """An operand of an infix op.  An int64 constant next to an operand that is not constant
        is printed bare: Triton's weak typing gives it that operand's type, so arithmetic on the
        int32 loop variables stays int32.  Any other constant is a typed value."""
        if n.op == "const" and n.dtype == INDEX and any(b.op != "const" for b in beside):
            return self.index_literal(n.arg)
        return self.value(n)

    def declare(self, name: str, expr: str, dtype: torch.dtype | None) -> str:
        return f"{name} = {expr}"

    def masked(self, mask: str, value: str, dtype: torch.dtype) -> str:
        return f"tl.where({mask}, {value}, 0)"

    def _expr(self, n: Node) -> str:
        expr = self._expr_of(n)
        if n.op in ("floordiv", "mod") and n.dtype == INDEX and _only_constants(n):
            # printed as index arithmetic (bare numbers), which a size substitution can make
            # constant: a Python int in Triton, where every temporary must be a typed value
            return f"tl.full([1], {expr}, tl.int64)"
        return expr

    def _expr_of(self, n: Node) -> str:
        o, a, dt = n.op, n.args, n.dtype
        if o == "checked":          # a value whose index check the load dropped (a dim of one)
            self.value(a[1])
            return self.value(a[0])
        if o == "check_index":
            if n not in self.checks:
                return self.index(unchecked_index(n, self.ranges))
            i, size = self.value(a[0]), self.index(a[1])
            w = self.tmp(f"tl.where({i} < 0, {i} + {size}, {i})") if a[2].arg else i
            ok = self.tmp(f"({w} >= 0) & ({w} < {size})")
            narrow = self._narrow(n)
            self._flag(self.checks[n], f"({ok} == 0)", i, narrow[0] if narrow else None)
            return f"tl.where({ok}, {w}, 0)"     # (never a load outside the tensor)
        if o == "load":
            mask, zero = self._narrow(n) or (self.mask, "xzero")
            if len(a) == 2:
                own = self.value(a[1])
                mask = own if mask == "None" else f"{mask} & {own}"
            hint = ""
            if self.evict is not None:
                rowwise = any(v.op == "var" and v.arg.startswith("x") for v in walk(a[0]))
                hint = f", eviction_policy='{self.evict.get(n.arg, 'evict_first') if rowwise else 'evict_last'}'"
            raw = f"tl.load({n.arg} + ({self.index(a[0])}) + {zero}, mask={mask}, other=0{hint})"
            sdt = self.buffers[n.arg]
            if sdt in (torch.float16, torch.bfloat16):
                raw += ".to(tl.float32)"
            elif sdt == torch.bool:
                raw += ".to(tl.int1)"
            return raw
        if o == "cast":
            inline = a[0].dtype == INDEX and a[0].op in ("add", "mul", "floordiv", "mod")
            x = self.index(a[0]) if inline else self.value(a[0])
            if inline and _only_constants(a[0]):
                # index arithmetic (bare numbers) that a size substitution made constant (the
                # element count of a batch-norm's statistics) or that folds from constants
                # (0 + 2): Triton keeps it a Python int, which has no .to(), and
                # `128.to(tl.float64)` does not even parse (a constant alone is a typed value)
                x = f"tl.full([1], {x}, tl.int64)"
            if dt == torch.bool:
                return f"({x} != 0)"
            if dt in (torch.float16, torch.bfloat16):
                # through fp32, as ATen converts (c10::Half and c10::BFloat16 are made from a
                # float; an int64 or fp64 rounded once to 8 bits can differ), and as Triton's
                # interpreter can (from int, bool or fp64 it made NaN or zeros)
                src = x if TL.get(a[0].dtype) == "tl.float32" else f"{x}.to(tl.float32)"
                return f"{to_storage(src, dt)}.to(tl.float32)"
            return f"{x}.to({TL[dt]})"
        if o in ("floordiv", "mod") and dt == INDEX:
            return self.index(n)
        if o == "where":
            return f"tl.where({self.value(a[0])}, {self.value(a[1])}, {self.value(a[2])})"
        if o in ("add", "mul") and len(a) > 2:
            return "(" + f" {_INFIX[o]} ".join(self.operand(x, a) for x in a) + ")"
        if o in _INFIX and len(a) == 2:
            if o == "truediv" and not dt.is_floating_point:
                return f"({self.value(a[0])}.to(tl.float32) / {self.value(a[1])}.to(tl.float32))"
            return f"({self.operand(a[0], a[1:])} {_INFIX[o]} {self.operand(a[1], a[:1])})"
        if o == "neg":
            return f"(-{self.value(a[0])})"
        if o == "not":
            return f"({self.value(a[0])} == 0)"
        if o == "bitnot":
            return f"(~{self.value(a[0])})"
        if o == "abs":
            return f"tl.abs({self.value(a[0])})"
        if o == "relu":
            x = self.value(a[0])
            return f"tl.where({x} < 0, 0, {x}).to({TL[dt]})"
        if o == "reciprocal":
            return f"(1.0 / {self.value(a[0])})"
        if o == "frac":
            x = self.value(a[0])
            return f"({x} - libdevice.trunc({x}))"
        if o == "log10":
            return f"(tl.log({self.value(a[0])}) * 0.4342944819032518)"
        if o == "erfc":
            return f"(1.0 - tl.erf({self.value(a[0])}))"
        if o == "isinf":
            return f"(tl.abs({self.value(a[0])}) == 1e999)"
        if o in ("isnan",):
            x = self.value(a[0])
            return f"({x} != {x})"
        if o == "isfinite":
            x = self.value(a[0])
            return f"(({x} == {x}) & (tl.abs({x}) != 1e999))"
        if o == "sign":
            x = self.value(a[0])
            return f"(({x} > 0).to({TL[dt]}) - ({x} < 0).to({TL[dt]}))"
        if o in ("maximum", "clamp_min", "minimum", "clamp_max"):
            x, y = self.value(a[0]), self.value(a[1])
            big = o in ("maximum", "clamp_min")
            if dt.is_floating_point:
                return f"{'_max_nan' if big else '_min_nan'}({x}, {y})"
            return f"{'tl.maximum' if big else 'tl.minimum'}({x}, {y})"
        if o in ("fmax", "fmin"):
            x, y = self.value(a[0]), self.value(a[1])
            fn = "tl.maximum" if o == "fmax" else "tl.minimum"
            return f"tl.where({x} != {x}, {y}, tl.where({y} != {y}, {x}, {fn}({x}, {y})))"
        if o == "pow":
            x, y = self.value(a[0]), self.value(a[1])
            if dt.is_floating_point:
                return f"libdevice.pow({x}, {y})"
            raise NotImplementedError("integer pow in Triton")
        if o in ("pyfloordiv", "remainder", "truncdiv"):
            x, y = self.value(a[0]), self.value(a[1])
            if dt.is_floating_point:
                if o == "truncdiv":
                    return f"libdevice.trunc({x} / {y})"
                m = self.tmp(f"libdevice.fmod({x}, {y})")
                fix = self.tmp(f"({m} != 0) & (({y} < 0) != ({m} < 0))")
                if o == "remainder":
                    return f"tl.where({fix}, {m} + {y}, {m})"
                return f"tl.where({y} == 0, {x} / {y}, libdevice.trunc(({x} - {m}) / {y}) - tl.where({fix}, 1.0, 0.0))"
            ys = self._checked_divisor(n, y)
            # Triton integer // and % truncate, like C; by -1: -x (wraps INT_MIN) and 0
            q = self.tmp(f"tl.where({y} == -1, -{x}, {x} // {ys})")
            r = self.tmp(f"tl.where({y} == -1, 0, {x} % {ys})")
            if o == "truncdiv":
                return q
            fix = self.tmp(f"({r} != 0) & (({r} < 0) != ({y} < 0))")
            return f"tl.where({fix}, {q} - 1, {q})" if o == "pyfloordiv" else f"tl.where({fix}, {r} + {y}, {r})"
        if o == "fmod" and not dt.is_floating_point:
            x, y = self.value(a[0]), self.value(a[1])
            return f"tl.where({y} == -1, 0, {x} % {self._checked_divisor(n, y)})"
        if o == "exp" and dt == torch.float32:
            return f"{self.exp_fn}({self.value(a[0])})"
        if o == "sqrt" and dt == torch.float32 and not self.interpreter:
            return f"tl.sqrt_rn({self.value(a[0])})"
        if o in _CORE:
            return f"{_CORE[o]}({self.value(a[0])})"
        if o in _LIBDEVICE:
            fn = _LIBDEVICE[o]
            if self.interpreter and fn.split(".")[1] not in INTERPRETER_LIBDEVICE:
                raise NotImplementedError(f"{o} has no Triton-interpreter implementation")
            return f"{fn}({', '.join(self.value(x) for x in a)})"
        raise NotImplementedError(f"Triton codegen: no rule for op {o!r} ({to_text(n)})")
