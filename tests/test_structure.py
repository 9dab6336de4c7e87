"""The package's structure: no import cycles in src/torchfuse (function-level imports count: a
cycle hidden inside a function is still a cycle), and no backend-name comparisons outside
`backends/` (the rest of the compiler asks the backend for what it supports instead)."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"
PACKAGE = "torchfuse"
BACKEND_NAMES = {"cpp", "triton"}
DEVICE_KINDS = {"cpu", "cuda"}
# Modules outside backends/ that may compare device kinds, because the device itself (not the
# code generator) is what they are about.  Backend names are compared nowhere outside backends/.
DEVICE_RULES = {
    "torchfuse/runtime/cudagraphs.py": "CUDA graphs capture CUDA work only",
    "torchfuse/codegen/wrapper.py": "the generated wrapper allocates with each device's empty_strided",
    "torchfuse/passes/host_scalars.py": "host memory against device memory",
    "torchfuse/passes/strided_1x1_grads.py": "a workaround for oneDNN, ATen's CPU convolution",
    "torchfuse/runtime/cpu_conv.py": "oneDNN, ATen's CPU convolution, called with a weight reordered once",
    "torchfuse/passes/layout_rule.py": "convolution layouts as oneDNN (CPU) and cuDNN (CUDA) run them, ATen's libraries",
    "torchfuse/lazy/mode.py": "the lazy mode records CPU and CUDA tensors; it pipelines GPU work",
    "torchfuse/lowering/values.py": "a 0-dim CPU tensor is a host scalar on any device",
    "torchfuse/lowering/realize.py": "a CPU cache cost rule, whatever generates the code",
    "torchfuse/frontend/constant_masks.py": "the tensor methods .cuda() and .cpu(), not devices",
}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted((SRC / PACKAGE).rglob("*.py"))}


def imports_of(name: str, path: Path, known: set[str]) -> set[str]:
    """The package's modules that `name` imports anywhere in its body (relative imports
    resolved; `from pkg import mod` counts as importing `pkg.mod` where that is a module)."""
    is_package = path.name == "__init__.py"
    out: set[str] = set()
    tree = ast.parse(path.read_text(), str(path))
    # imports for type checkers only never run
    typing_only = {id(n) for block in ast.walk(tree) if isinstance(block, ast.If) and _is_type_checking(block.test)
                   for stmt in block.body for n in ast.walk(stmt)}
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".") if is_package else name.split(".")[:-1]
                base = base[:len(base) - (node.level - 1)]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            targets = [f"{mod}.{a.name}" if f"{mod}.{a.name}" in known else mod for a in node.names]
        else:
            continue
        for t in targets:
            while t and t not in known:
                t = t.rpartition(".")[0]
            # importing a.b.c runs the package a.b's __init__ too (torchfuse's own is left out:
            # it only gathers the public API)
            while t.startswith(PACKAGE + "."):
                if t != name and not name.startswith(t + "."):
                    out.add(t)
                t = t.rpartition(".")[0]
    return out


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or \
        (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def import_graph() -> dict[str, set[str]]:
    mods = modules()
    return {name: imports_of(name, path, set(mods)) for name, path in mods.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def _names(node: ast.AST, names: set[str]) -> bool:
    if isinstance(node, ast.Constant) and node.value in names:
        return True
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return any(_names(e, names) for e in node.elts)
    return False


def backend_comparisons(path: Path) -> list[str]:
    """`x == "triton"`, `x != "cpp"`, `x in ("cpp", ...)` and the like in one file, and
    `device.type == "cuda"` and the like where the file is not in DEVICE_RULES."""
    names = BACKEND_NAMES if str(path.relative_to(SRC)) in DEVICE_RULES else BACKEND_NAMES | DEVICE_KINDS
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Compare) and any(_names(c, names) for c in [node.left, *node.comparators]):
            found.append(f"{path.relative_to(SRC)}:{node.lineno}: {ast.unparse(node)}")
    return found


# Cycles not broken yet; the test fails when one grows or a new one appears, and asks for an
# entry to be removed once it is gone.
KNOWN_CYCLES: list[list[str]] = []


def test_no_import_cycles():
    found = cycles(import_graph())
    new = [c for c in found if c not in KNOWN_CYCLES]
    assert not new, "import cycles in src/torchfuse:\n" + "\n".join(" <-> ".join(c) for c in new)
    gone = [c for c in KNOWN_CYCLES if c not in found]
    assert not gone, f"these cycles are gone (or changed): remove them from KNOWN_CYCLES: {gone}"


def test_no_backend_name_comparisons_outside_backends():
    found = [line for name, path in modules().items() if not name.startswith(f"{PACKAGE}.backends")
             for line in backend_comparisons(path)]
    assert not found, "compare backend names only in torchfuse/backends/:\n" + "\n".join(found)


def test_the_checks_can_fail(tmp_path):
    """The detectors themselves: a two-module cycle through a function-level relative import,
    and a device-kind comparison."""
    assert cycles({"a": {"b"}, "b": {"a"}, "c": {"a"}}) == [["a", "b"]]
    pkg = tmp_path / "p"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "x.py").write_text("def f():\n    from . import y\n")
    (pkg / "y.py").write_text("from .x import f\nok = f is None or 'cuda' in ('cpu', 'cuda') or f == 'cpp'\n")
    known = {"p", "p.x", "p.y"}
    assert imports_of("p.x", pkg / "x.py", known) == set()       # outside the package's name
    global SRC
    old, SRC = SRC, tmp_path
    try:
        assert len(backend_comparisons(pkg / "y.py")) == 2
    finally:
        SRC = old


if __name__ == "__main__":       # a summary: python tests/test_structure.py
    g = import_graph()
    for c in cycles(g):
        print("cycle:", " ".join(c))
    for name, path in modules().items():
        if not name.startswith(f"{PACKAGE}.backends"):
            for line in backend_comparisons(path):
                print("compare:", line)
    pytest.main  # (keeps the import used when run as a script)
