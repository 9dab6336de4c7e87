"""The calling conventions of compiled Triton binaries' launchers, for launch.py's direct launches.

A direct launch calls a launcher of the compiled binary itself instead of `kernel[grid](...)`:
torch's static CUDA launcher (Inductor's) where this torch has one and the binary allows it, else
Triton's own C launcher, else its Python one.  `conventions` lists the ways of calling them for
one binary, fastest first; launch.py verifies one against a launch through Triton before using it.
"""
from __future__ import annotations

from typing import Any, Callable, Iterator


# A direct launch is one call of a launcher with the binary's constants, the stream and the
# kernel's arguments in the launcher's order.  Each way of calling is generated once per layout
# (which constants, where the stream and the arguments go, how many arguments) as a function of
# exactly the kernel's arguments, with everything else bound: no per-launch `*args` unpacking,
# tuple concatenation or argument binding.
_GO_SOURCE = """
def make(launch, stream, device{consts}):
    def go({params}):
        launch({call})
    return go
"""
_go_factories: dict[tuple, Callable] = {}


def _go_factory(layout: tuple, n_consts: int, n_args: int, n_rest: int, keep: tuple | None) -> Callable:
    """`make(launch, stream, device, *consts, *rest) -> go(a0, ..., a{n_args-1})` for `layout`, a
    tuple of "c" (the next constant), "s" (the stream), "spread" or "packed" (the arguments
    `a... + rest...`, those at the positions `keep` if given, in place or as one tuple)."""
    key = (layout, n_consts, n_args, n_rest, keep)
    factory = _go_factories.get(key)
    if factory is None:
        names = [f"a{i}" for i in range(n_args)] + [f"r{i}" for i in range(n_rest)]
        if keep is not None:
            names = [names[i] for i in keep]
        parts, c = [], 0
        for token in layout:
            if token == "c":
                parts.append(f"c{c}")
                c += 1
            elif token == "s":
                parts.append("stream(device)")
            elif token == "packed":
                parts.append("(" + "".join(n + ", " for n in names) + ")")
            elif names:
                parts.append(", ".join(names))
        source = _GO_SOURCE.format(consts="".join(f", c{i}" for i in range(n_consts))
                                   + "".join(f", r{i}" for i in range(n_rest)),
                                   params=", ".join(f"a{i}" for i in range(n_args)), call=", ".join(parts))
        scope: dict[str, Any] = {}
        exec(compile(source, f"<torchfuse launcher {len(_go_factories)}>", "exec"), scope)
        factory = _go_factories[key] = scope["make"]
    return factory


def _binder(launcher: Callable, layout: tuple, consts: tuple, extra: tuple, device: int,
            keep: tuple | None = None, n_params: int | None = None) -> Callable:
    """`bind(grid, tail, n_args) -> go(*args)` for a launcher called as `layout` says (see
    `_go_factory`; grid dims are the constants "g"), with the kernel arguments `args + tail +
    extra` (`n_params` of them, where `keep` picks by position)."""
    stream = _raw_stream()
    shape = tuple("c" if t == "g" else t for t in layout)

    def bind(grid: tuple, tail: tuple, n_args: int) -> Callable:
        dims = iter(grid)
        values, rest, it = [], tuple(tail) + extra, iter(consts)
        if n_params is not None and n_args + len(rest) != n_params:
            raise ValueError(f"{n_args + len(rest)} arguments for a kernel of {n_params} parameters")
        for token in layout:
            if token == "g":
                values.append(next(dims))
            elif token == "c":
                values.append(next(it))
        return _go_factory(shape, len(values), n_args, len(rest), keep)(launcher, stream, device, *values, *rest)
    return bind


def _raw_stream() -> Callable[[int], int]:
    """The current stream of a device as an int.  torch.cuda.current_stream() costs ~5-10 us of
    Python per call (device lookup, availability checks); the raw getter is what Inductor's
    wrappers call too."""
    import torch
    return torch._C._cuda_getCurrentRawStream


def _static_launcher() -> Callable | None:
    """torch's C++ launcher of Triton binaries, `_launch_kernel(function, gx, gy, gz, warps,
    shared, arg_types, args, stream)`, where this torch has one (a CUDA build)."""
    try:
        from torch._C import _StaticCudaLauncher
        return _StaticCudaLauncher._launch_kernel
    except (ImportError, AttributeError):
        return None


_STATIC_TYPES = {"i1": "i", "i8": "b", "i16": "h", "i32": "i", "i64": "l", "u1": "I", "u8": "B", "u16": "H",
                 "u32": "I", "u64": "K", "fp16": "f", "bf16": "f", "fp32": "f", "f32": "f", "fp64": "d"}


def _static_launch(binary: Any) -> tuple | None:
    """(launch, constants, keep, scratch pointers) for launching `binary` through torch's own C++ launcher of
    Triton binaries (`torch._C._StaticCudaLauncher`, which Inductor launches with), or None
    where it cannot: no such launcher in this torch, launch hooks set, or a binary that needs
    what it lacks (clusters, cooperative or PDL launches, scratch memory, tensor descriptors).
    It takes only the binary's run-time parameters (`keep`: their positions among all of the
    kernel's parameters; constexprs and ints Triton specialized to constants are not passed)
    and the per-kernel scratch pointers the compiled code expects."""
    launch = _static_launcher()
    if launch is None:
        return None
    md, src = getattr(binary, "metadata", None), getattr(binary, "src", None)
    fn = getattr(src, "fn", None)
    names = getattr(fn, "arg_names", None)
    if md is None or names is None or not isinstance(getattr(src, "signature", None), dict):
        return None
    if (getattr(md, "num_ctas", 1) != 1 or getattr(md, "launch_cooperative_grid", False)
            or getattr(md, "launch_pdl", False) or getattr(md, "global_scratch_size", 0)
            or getattr(md, "profile_scratch_size", 0) or _launch_hooks()):
        return None

    def index(k: Any) -> Any:
        return names.index(k) if isinstance(k, str) else k[0] if isinstance(k, tuple) and len(k) == 1 else k

    signature = {index(k): v for k, v in src.signature.items()}
    constants = {index(k) for k in getattr(src, "constants", {})}
    keep, types = [], []
    for i in range(len(names)):
        ty = signature.get(i)
        if not isinstance(ty, str):
            return None
        if ty == "constexpr" or i in constants:
            continue
        code = "O" if ty.startswith("*") else _STATIC_TYPES.get(ty)
        if code is None:
            return None
        keep.append(i)
        types.append(code)
    # newer Triton binaries take a global (and a profile) scratch pointer after the parameters,
    # null when their size is 0
    scratch = sum(hasattr(md, a) for a in ("global_scratch_size", "profile_scratch_size"))
    shared = getattr(binary, "shared", None)
    shared = md.shared if shared is None else shared
    return launch, (binary.function, md.num_warps, shared, "".join(types) + "O" * scratch), tuple(keep), scratch


def _launch_hooks() -> bool:
    """Are Triton launch hooks set (a profiler's)?  Only Triton's own launchers call them."""
    try:
        from triton import knobs
        hooks = (knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook)
    except (ImportError, AttributeError):
        from triton.compiler.compiler import CompiledKernel
        hooks = (getattr(CompiledKernel, "launch_enter_hook", None), getattr(CompiledKernel, "launch_exit_hook", None))
    return any(h is not None and getattr(h, "calls", True) for h in hooks)


def conventions(binary: Any, constexprs: tuple, device: int) -> Iterator[tuple[str, Callable | None]]:
    """Ways to call the compiled binary's launcher, fastest first, each as (name,
    `bind(grid, tail, n_args) -> go(*args)`), the bind None where that way does not apply to this
    binary.  `args` are the kernel's arguments with pointers as ints: the C launchers take an int
    as the device pointer itself, where for a tensor they call `data_ptr()` and ask the driver
    about the pointer (`cuPointerGetAttribute`) on every launch.  Each convention is only
    trusted after it reproduced a launch (see launch.py's `_make_fast`)."""
    run, function, meta = binary.run, binary.function, binary.packed_metadata
    launch = getattr(run, "launch", None)
    # torch's C++ launcher, as Inductor launches: the least work per launch (one argument tuple
    # parsed by a type string, then cuLaunchKernel), the same on every Triton version
    static = _static_launch(binary)
    if static is not None:
        fn, consts, keep, scratch = static
        # the kernel's parameters are `args + tail + constexprs`, the scratch pointers after them
        n_params = len(binary.src.fn.arg_names)
        yield "static", _binder(fn, ("c", "g", "g", "g", "c", "c", "c", "packed", "s"), consts,
                                constexprs + (None,) * scratch, device,
                                keep + tuple(range(n_params, n_params + scratch)), n_params + scratch)
    else:
        yield "static", None
    # The C launcher itself, past the Python `CudaLauncher.__call__` (which allocates scratch
    # memory, none here, and builds two closures per launch).  Its arguments changed in Triton
    # 3.7-ish: one shared launcher taking the kernel's signature, instead of one per kernel.
    direct = launcher_kind(binary)[1]
    coop, pdl = getattr(run, "launch_cooperative_grid", False), getattr(run, "launch_pdl", False)
    for n, extra in enumerate((constexprs, ())):      # newer Triton: all params; older: the runtime ones
        if direct and hasattr(run, "kernel_signature"):
            consts = (function, coop, pdl, meta, None, None, None, None, None, run.arg_annotations,
                      run.kernel_signature)
            yield f"direct-packed-{n}", _binder(launch, ("g", "g", "g", "s") + ("c",) * len(consts) + ("packed",),
                                                consts, extra, device)
        elif direct:
            consts = (function, coop, pdl, None, None, meta, None, None, None)
            yield f"direct-{n}", _binder(launch, ("g", "g", "g", "s") + ("c",) * len(consts) + ("spread",),
                                         consts, extra, device)
    for n, extra in enumerate((constexprs, ())):      # the Python launcher, as Triton's own launch calls it
        consts = (function, meta, None, None, None)
        yield f"python-{n}", _binder(run, ("g", "g", "g", "s") + ("c",) * len(consts) + ("spread",), consts, extra,
                                     device)


def launcher_kind(binary: Any) -> tuple:
    """What a calling convention verified on one binary holds for: the type of its launcher,
    whether that can be called directly (no scratch memory), and whether it takes the signature."""
    run = binary.run
    launch = getattr(run, "launch", None)
    direct = (callable(launch) and getattr(run, "global_scratch_size", 1) == 0
              and getattr(run, "profile_scratch_size", 1) == 0 and not getattr(run, "gsan_enabled", False))
    return type(run), direct, hasattr(run, "kernel_signature")
