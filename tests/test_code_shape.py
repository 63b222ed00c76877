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
    runtime = _imports(f"{PKG}.ring.runtime", modules[f"{PKG}.ring.runtime"], modules)[0]
    assert {OPS, f"{OPS}.decode_reference", f"{PKG}.ring.cpu"} <= runtime


MAX_DEPTH = 7


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    graph = {m: _imports(m, p, modules)[0] for m, p in modules.items()}
    return {m: {t for t in ts if not m.startswith(t + ".")} for m, ts in graph.items()}


def _longest_chain(graph) -> list[str]:
    memo: dict[str, list[str]] = {}

    def chain(m):
        if m not in memo:
            memo[m] = [m]  # no cycles (test_no_import_cycles)
            memo[m] = [m] + max((chain(t) for t in graph[m]), key=len, default=[])
        return memo[m]

    return max((chain(m) for m in graph), key=len)


def test_import_graph_depth():
    """The longest chain of imports inside the package (imports in functions counted; the patch
    table names its replacements as strings, resolved when installed) is at most MAX_DEPTH modules."""
    chain = _longest_chain(_graph())
    assert len(chain) <= MAX_DEPTH, " -> ".join(chain)


def _mutable_module_state(path: str) -> list[str]:
    """Module-level bindings of mutable containers to lower-case names, and `global` statements."""
    tree = ast.parse(open(path).read())
    found = []
    mutable_calls = {"dict", "list", "set", "Counter", "defaultdict", "deque", "OrderedDict"}
    for node in tree.body:
        targets, value = [], None
        if isinstance(node, ast.Assign):
            targets, value = node.targets, node.value
        elif isinstance(node, ast.AnnAssign) and node.value is not None:
            targets, value = [node.target], node.value
        for t in targets:
            if not isinstance(t, ast.Name) or t.id.isupper() or t.id.startswith("__"):
                continue
            call = value.func.id if isinstance(value, ast.Call) and isinstance(value.func, ast.Name) else None
            if isinstance(value, (ast.Dict, ast.List, ast.Set, ast.DictComp, ast.ListComp, ast.SetComp)) \
                    or call in mutable_calls:
                found.append(f"{t.id} (line {node.lineno})")
    found += [f"global {', '.join(n.names)} (line {n.lineno})" for n in ast.walk(tree) if isinstance(n, ast.Global)]
    return found


def test_no_mutable_module_state_outside_the_state_object():
    """What the patch holds lives in replayssm_patch.state.STATE; no module keeps its own."""
    bad = {name: found for name, path in _modules().items() if (found := _mutable_module_state(path))}
    assert not bad, bad
    state = open(os.path.join(ROOT, PKG, "state.py")).read()
    assert "STATE = PatchState()" in state  # the one instance (an upper-case name, by design)


def test_no_measured_figures_in_the_package_source():
    """Measurements live in results files: the source states rules and links those files (whose
    dated folder names are links, not figures)."""
    import re

    figure = re.compile(r"\b\d+(\.\d+)?x\b|(?<!results/)(?<![\w/-])20\d\d-\d\d-\d\d")
    hits = []
    for name, path in _modules().items():
        for i, line in enumerate(open(path), 1):
            text = re.sub(r"benchmarks/results/[\w./-]+", "", line)
            if figure.search(text):
                hits.append(f"{name}:{i}: {line.strip()}")
    assert not hits, "\n".join(hits)


def _names_used(path: str) -> set[str]:
    """Every identifier and attribute name the module's code uses (not its strings or comments)."""
    tree = ast.parse(open(path).read())
    return {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)} | \
        {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)} | \
        {n.arg for n in ast.walk(tree) if isinstance(n, ast.keyword) and n.arg}


# min_batch's way from the environment to the metadata builder, inside a worker: parsed once in
# config (ReplayConfig.from_env, called by the plugin's activation), held by the state object,
# turned into the plan's value by plan, handed to the builder by gdn_backend through the layer's
# KV-cache spec; the layer (gdn_layer) passes the config and the plan along as parameters
# without reading the field.
MIN_BATCH_PATH = {f"{PKG}.config", f"{PKG}.plan", f"{PKG}.vllm.gdn_backend"}
MIN_BATCH_ELSEWHERE = {f"{PKG}.vllm.metrics_info": "the /metrics label"}  # names it for another reason
# modules that read or write the process environment, and why (everything else gets values)
ENVIRONMENT_USERS = {
    f"{PKG}.config": "parses the options", f"{PKG}.activation": "the plugin's read, and the options written for "
    "vLLM's other processes", PKG: "patch() writes the options for vLLM's processes",
    f"{PKG}.vllm.replayssm_flag": "writes the flag's options for vLLM's processes",
    f"{PKG}.ring.flashinfer": "the FlashInfer variable (a patch point)", f"{PKG}.__main__": "doctor",
    f"{PKG}.demo": "the demo's engines",
}


def test_options_reach_the_builder_as_values():
    """Following min_batch from the environment to the builder crosses the modules of
    MIN_BATCH_PATH only (at most 5 with the state object); outside the testing helpers only the
    modules of ENVIRONMENT_USERS touch the environment."""
    modules = {n: p for n, p in _modules().items() if not n.startswith(f"{PKG}.testing")}
    naming = {n for n, p in modules.items() if "min_batch" in _names_used(p)}
    assert naming - set(MIN_BATCH_ELSEWHERE) == MIN_BATCH_PATH, sorted(naming)
    assert len(MIN_BATCH_PATH | {f"{PKG}.state"}) <= 5
    environ = {n for n, p in modules.items() if {"environ", "getenv", "putenv"} & _names_used(p)}
    assert environ <= set(ENVIRONMENT_USERS), sorted(environ - set(ENVIRONMENT_USERS))
