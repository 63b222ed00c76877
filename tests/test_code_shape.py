"""The package's import graph: no cycles between its modules (counting imports inside functions
too), and the kernel package `ops` importing only torch, triton, the standard library and
itself (it is meant to be lifted into other projects as it is); the cursor word's bit layout
spelled out only in ops/cursor.py."""

from __future__ import annotations

import ast
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PKG = "replayssm_patch"
OPS = f"{PKG}.ops"


def _in_ops(name: str) -> bool:
    return name == OPS or name.startswith(OPS + ".")


def _modules() -> dict[str, str]:
    """Dotted module name -> file path, for every module of the package."""
    out = {}
    base = os.path.join(ROOT, PKG)
    for dirpath, _, files in os.walk(base):
        for f in files:
            if f.endswith(".py"):
                rel = os.path.relpath(os.path.join(dirpath, f), ROOT)[:-3].replace(os.sep, ".")
                out[rel[: -len(".__init__")] if rel.endswith(".__init__") else rel] = os.path.join(dirpath, f)
    return out


def _imports(name: str, path: str, modules: dict[str, str]) -> tuple[set[str], set[str]]:
    """(package modules it imports, top-level names of outside packages it imports)."""
    is_pkg = path.endswith("__init__.py")
    inside, outside = set(), set()
    for node in ast.walk(ast.parse(open(path).read())):
        if isinstance(node, ast.Import):
            for a in node.names:
                top = a.name.split(".")[0]
                if top == PKG:
                    inside.add(a.name)
                else:
                    outside.add(top)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = name.split(".") if is_pkg else name.split(".")[:-1]
                base = ".".join(parts[: len(parts) - (node.level - 1)])
                target = f"{base}.{node.module}" if node.module else base
            elif node.module.split(".")[0] == PKG:
                target = node.module
            else:
                if node.module != "__future__":
                    outside.add(node.module.split(".")[0])
                continue
            for a in node.names:  # `from . import x` names a submodule when there is one
                sub = f"{target}.{a.name}"
                inside.add(sub if sub in modules else target)
    inside.discard(name)
    return {m for m in inside if m in modules}, outside


def test_no_import_cycles():
    modules = _modules()
    graph = {m: _imports(m, p, modules)[0] for m, p in modules.items()}
    # A package's __init__ runs before its submodules, so "a submodule imports its own package"
    # is not a cycle through code; drop those edges.
    graph = {m: {t for t in ts if not m.startswith(t + ".")} for m, ts in graph.items()}
    cycles = []
    state: dict[str, int] = {}

    def visit(m, stack):
        state[m] = 1
        for t in sorted(graph[m]):
            if state.get(t) == 1:
                cycles.append(stack[stack.index(t):] + [t])
            elif t not in state:
                visit(t, stack + [t])
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m, [m])
    assert not cycles, "import cycles: " + "; ".join(" -> ".join(c) for c in cycles)


def test_kernel_package_imports_only_torch_and_triton():
    modules = _modules()
    allowed = {"torch", "triton"} | set(sys.stdlib_module_names)
    for name, path in modules.items():
        if not _in_ops(name):
            continue
        inside, outside = _imports(name, path, modules)
        assert outside <= allowed, f"{name} imports {sorted(outside - allowed)}"
        assert all(_in_ops(m) for m in inside), f"{name} imports {sorted(inside)}"


def test_cursor_bits_only_in_cursor_module():
    """No kernel or launcher of `ops` spells the cursor word's fields itself (masks 0xFF /
    0xFFFF, shifts by 8 / 16, the ticket 1 << 16, the 16-bit limit): they use ops/cursor.py's
    names."""
    def constant(node, values):
        return isinstance(node, ast.Constant) and type(node.value) is int and node.value in values

    found = []
    for name, path in _modules().items():
        if not _in_ops(name) or name == f"{OPS}.cursor":
            continue
        for node in ast.walk(ast.parse(open(path).read())):
            mask = (isinstance(node, ast.BinOp) and isinstance(node.op, ast.BitAnd)
                    and (constant(node.left, (0xFF, 0xFFFF)) or constant(node.right, (0xFF, 0xFFFF))))
            shift = (isinstance(node, ast.BinOp) and isinstance(node.op, (ast.LShift, ast.RShift))
                     and constant(node.right, (8, 16)))
            if mask or shift or constant(node, (0xFFFF,)):
                found.append(f"{name}:{node.lineno}")
    assert not found, f"cursor bit operations outside ops/cursor.py: {found}"


def test_the_graph_sees_known_edges():
    """The parser resolves relative and lazy imports (else the tests above would pass vacuously)."""
    modules = _modules()
    assert f"{OPS}.decode_fused" in _imports(f"{OPS}.decode", modules[f"{OPS}.decode"], modules)[0]
    assert {f"{OPS}.commit", f"{OPS}.cursor"} <= _imports(f"{OPS}.verify", modules[f"{OPS}.verify"], modules)[0]
    kernels = _imports(f"{PKG}.kernels", modules[f"{PKG}.kernels"], modules)[0]
    assert {OPS, f"{OPS}.decode", f"{PKG}.cpu_ring"} <= kernels
