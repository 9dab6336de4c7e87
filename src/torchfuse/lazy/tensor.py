"""`LazyTensor`: the tensor a lazy block hands out for a value it has not computed yet.

It is a wrapper subclass (`torch.Tensor._make_wrapper_subclass`): it has eager mode's sizes,
strides, dtype and device from the moment it is created, but no memory.  When its value is
computed the wrapper's own storage is pointed at the result (`set_` below the Python dispatch
key), so afterwards it *is* that tensor for code that reads memory directly (C++ extensions,
`data_ptr`), and every op on it runs eagerly on the result through `__torch_dispatch__`.

Python entry points that read data without going through the dispatcher (`repr`, `numpy`,
`tolist`, `data_ptr`, pickling, ...) are overridden to compute the value first.
"""
from __future__ import annotations

import logging
import weakref
from typing import TYPE_CHECKING, Any

import torch

from .state import current_context, hooks

if TYPE_CHECKING:
    from .graph import LazyNode

log = logging.getLogger("torchfuse.lazy")


class LazyTensor(torch.Tensor):
    """A tensor whose value is computed by torchfuse when first needed (see `torchfuse.lazy`).

    Attributes: `_lz_node`/`_lz_idx` (the recorded op output it stands for, while pending) and
    `_lz_real` (the computed tensor, once computed; it shares the wrapper's memory).
    """
    # Slots (a tensor's __dict__ stays available for user attributes): setting the three on
    # every recorded op's wrapper costs about 0.15 us less than through the instance dict.
    __slots__ = ("_lz_node", "_lz_idx", "_lz_real")
    _lz_node: "LazyNode | None"
    _lz_idx: int
    _lz_real: torch.Tensor | None

    # Tensor methods reach __torch_dispatch__ directly; a Python __torch_function__ layer would
    # cost microseconds per op and buys nothing here.
    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        # Reached when no lazy mode is active (the value escaped its block) or when another
        # mode sits above ours: compute what is pending and run the op eagerly.
        return hooks.eager_call(func, args, kwargs or {}, None, outside=True)

    # -- Python-level ways of reading data that bypass the dispatcher -----------------------
    def __repr__(self, *, tensor_contents: Any = None) -> str:
        real = materialize(self, "repr()/print()")
        with torch._C._DisableTorchDispatch():
            return repr(real)

    def __format__(self, spec: str) -> str:
        real = materialize(self, "format()")
        with torch._C._DisableTorchDispatch():
            return real.__format__(spec)

    def tolist(self) -> Any:
        return materialize(self, ".tolist()").tolist()

    def numpy(self, *, force: bool = False) -> Any:
        real = materialize(self, ".numpy()")
        with torch._C._DisableTorchDispatch():
            return real.numpy(force=force)

    def __array__(self, dtype: Any = None, copy: Any = None) -> Any:
        arr = self.numpy()
        return arr if dtype is None else arr.astype(dtype, copy=False)

    def data_ptr(self) -> int:
        return materialize(self, ".data_ptr()").data_ptr()

    def untyped_storage(self) -> torch.UntypedStorage:
        return materialize(self, ".untyped_storage()").untyped_storage()

    def storage(self) -> Any:
        return materialize(self, ".storage()").storage()

    def __dlpack__(self, *args: Any, **kwargs: Any) -> Any:
        return materialize(self, "__dlpack__").__dlpack__(*args, **kwargs)

    def __dlpack_device__(self) -> Any:
        return materialize(self, "__dlpack_device__").__dlpack_device__()

    def __reduce_ex__(self, proto: int) -> Any:
        # Pickling / torch.save: save the plain tensor.
        return materialize(self, "pickle").__reduce_ex__(proto)

    def __deepcopy__(self, memo: dict) -> torch.Tensor:
        real = materialize(self, "deepcopy")
        with torch._C._DisableTorchDispatch():       # a plain copy, not a recorded clone
            out = real.clone()
        memo[id(self)] = out
        return out


def new_wrapper(desc: tuple, device: torch.device, node: "LazyNode", k: int) -> LazyTensor:
    size, stride, offset, dtype = desc
    w = torch.Tensor._make_wrapper_subclass(LazyTensor, size, strides=stride, storage_offset=offset,
                                            dtype=dtype, device=device, requires_grad=False)
    w._lz_node = node
    w._lz_idx = k
    w._lz_real = None
    node.wrappers[k] = weakref.ref(w)
    return w


def materialized_wrapper(real: torch.Tensor) -> LazyTensor:
    """A wrapper that is already computed (see `mode.eager_call`: `detach` of a LazyTensor)."""
    w = torch.Tensor._make_wrapper_subclass(LazyTensor, real.size(), strides=real.stride(),
                                            storage_offset=real.storage_offset(), dtype=real.dtype,
                                            device=real.device, requires_grad=False)
    w._lz_node = None
    w._lz_idx = 0
    w._lz_real = None
    attach_real(w, real)
    return w


def attach_real(w: LazyTensor, real: torch.Tensor) -> None:
    """Make the computed `real` the wrapper's value: keep it for unwrapping and point the
    wrapper's own storage at it (without a version-counter bump: autograd may have saved `w`)."""
    w._lz_real = real
    w._lz_node = None
    sync_storage(w)


def sync_storage(w: LazyTensor) -> None:
    """Point `w`'s storage and metadata at `w._lz_real`'s (after a compute, or after an eager
    in-place op such as `resize_` / `t_` changed the real tensor)."""
    real = w._lz_real
    if real is None:
        return
    try:
        # Tensor.data's setter shallow-copies storage, sizes, strides and offset below the
        # dispatcher, keeping `w`'s version counter and its Python dispatch key: what `set_`
        # under guards that skip autograd and the Python key did, for 0.2 us instead of 3.
        w.data = real
    except Exception as e:   # e.g. an inference tensor outside inference mode: keep it storage-less
        log.debug("lazy: could not share storage with a computed value: %s", e)


def is_pending(t: Any) -> bool:
    return type(t) is LazyTensor and t._lz_real is None


def materialize(w: LazyTensor, reason: str) -> torch.Tensor:
    """The real tensor behind `w`, computing it (and only what it needs) first."""
    real = w._lz_real
    if real is not None:
        return real
    node, k = w._lz_node, w._lz_idx
    if node is None:
        raise RuntimeError("torchfuse.lazy: a LazyTensor without a value or a recorded op")
    if not node.resolved(k):
        hooks.flush([(node, k)], reason, current_context())
    real = node.results[k]
    if w._lz_real is None:       # published to another wrapper only (in-place rebinding)
        attach_real(w, real)
    return real


def unwrap(a: Any, reason: str) -> Any:
    """`a` with every LazyTensor replaced by its real tensor (lists/tuples recursively)."""
    if type(a) is LazyTensor:
        return a._lz_real if a._lz_real is not None else materialize(a, reason)
    if type(a) in (list, tuple):
        return type(a)(unwrap(x, reason) for x in a)
    return a
