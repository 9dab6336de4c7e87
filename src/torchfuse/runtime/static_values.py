"""Run-time side of `passes.hoist_static`: values computed from parameters, kept between calls.

A compiled inference graph whose parameter-only part was hoisted is called as

    main(args + hoisted)   where hoisted = const_gm(*static args), recomputed only when needed

"Needed" is decided per call from the static inputs' version counters and storage pointers, a
few hundred nanoseconds per parameter: an in-place update (an optimizer step under no_grad,
`load_state_dict`, `param.copy_`) or a `param.data = ...` swap is picked up on the next call.
With `Config.freezing` the values are computed once and never checked again.
"""
from __future__ import annotations

import logging
from typing import Any, Callable

import torch

from ..passes.hoist_static import HoistedValues

log = logging.getLogger("torchfuse")


class StaticPrologue:
    """A boxed callable: appends the (cached) hoisted values to the inputs, then calls `main`."""

    def __init__(self, main: Callable, hoisted: HoistedValues, frozen: bool):
        self._boxed_call = True     # (on the instance: functools.wraps copies only its __dict__)
        self.main = main
        self.const_gm = hoisted.const_gm
        self.positions = hoisted.positions
        self.frozen = frozen
        self.key: list[tuple[int, int]] | None = None
        self.warned = False
        self.values: tuple[torch.Tensor, ...] = ()
        self._torchfuse_lib = getattr(main, "_torchfuse_lib", None)  # keep the kernels alive

    def __call__(self, args: list[Any]) -> Any:
        statics = [args[i] for i in self.positions]
        if self.frozen:
            if self.key is None:
                self._compute(statics, [])
        else:
            try:
                key = [(t._version, t.data_ptr()) for t in statics]
            except RuntimeError:
                # inference tensors (made under torch.inference_mode) keep no version counter:
                # an in-place change to one cannot be seen, so the values are computed every call
                if not self.warned:
                    log.info("torchfuse: parameters made under inference_mode carry no version counter; "
                             "parameter-only values are recomputed on every call (freezing=True avoids it)")
                    self.warned = True
                key = None
            if key is None or key != self.key:
                self._compute(statics, key)
        args.extend(self.values)
        return self.main(args)

    def _compute(self, statics: list[torch.Tensor], key: list[tuple[int, int]] | None) -> None:
        if self.key is not None:
            log.debug("torchfuse: a parameter changed: recomputing %d hoisted value(s)", len(self.values))
        with torch.no_grad():
            self.values = tuple(self.const_gm(*statics))
        self.key = key
