"""The package's import graph: no cycles between its modules (counting imports inside functions
too), and the kernel package `ops` importing only torch, triton, the standard library and
itself (it is meant to be lifted into other projects as it is)."""

from __future__ import annotations

import ast
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PKG = "replayssm_patch"


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
        if not name.startswith(f"{PKG}.ops"):
            continue
        inside, outside = _imports(name, path, modules)
        assert outside <= allowed, f"{name} imports {sorted(outside - allowed)}"
        assert all(m.startswith(f"{PKG}.ops") for m in inside), f"{name} imports {sorted(inside)}"


def test_the_graph_sees_known_edges():
    """The parser resolves relative and lazy imports (else the tests above would pass vacuously)."""
    modules = _modules()
    assert f"{PKG}.ops.decode_fused" in _imports(f"{PKG}.ops.decode", modules[f"{PKG}.ops.decode"],
                                                        modules)[0]
    kernels = _imports(f"{PKG}.kernels", modules[f"{PKG}.kernels"], modules)[0]
    assert {f"{PKG}.ops", f"{PKG}.ops.decode", f"{PKG}.cpu_ring"} <= kernels
