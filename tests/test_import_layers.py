"""The runtime's import graph: no cycles, and no module imports a layer above its own.

Layers, lowest first: the method and its kernels (``sfi_vllm.<module>``, ``sfi_vllm.kernels``),
the platform backends (``sfi_vllm.backends``), the patches into vLLM (``sfi_vllm.patches``), the
plugin entry (``sfi_vllm.plugin``, ``sfi_vllm.startup_errors``), the tooling (``sfi_vllm.tools``).
Imports made inside functions count: they hide a cycle from Python, not from the design.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "sfi_vllm"
LAYERS = {"backends": 1, "patches": 2, "plugin": 3, "startup_errors": 3, "tools": 4}
KNOWN_UPWARD: set[tuple[str, str]] = set()  # exceptions, each with its reason (none today)


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(("sfi_vllm",) + parts).removesuffix(".__init__")


def runtime_modules() -> dict[str, Path]:
    files = list(ROOT.glob("*.py")) + [p for sub in ("backends", "patches", "kernels", "tools")
                                       for p in (ROOT / sub).rglob("*.py")]
    return {module_name(p): p for p in files}


def layer(name: str) -> int:
    parts = name.split(".")
    return LAYERS.get(parts[1], 0) if len(parts) > 1 else 0


def imports(path: Path, known: set[str]) -> set[str]:
    """The sfi_vllm modules ``path`` imports, at module level or inside functions."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        else:
            continue
        for n in names:
            while n and n not in known:
                n = n.rpartition(".")[0]
            if n and n != "sfi_vllm":
                found.add(n)
    return found


def graph() -> dict[str, set[str]]:
    mods = runtime_modules()
    return {m: imports(p, set(mods)) - {m} for m, p in mods.items()}


def test_the_walk_sees_the_whole_runtime():
    mods = runtime_modules()
    for name in ("sfi_vllm.controller", "sfi_vllm.backends.common", "sfi_vllm.kernels.fast_decode",
                 "sfi_vllm.patches.runner_hooks", "sfi_vllm.plugin", "sfi_vllm.tools.cli"):
        assert name in mods, name
    assert "sfi_vllm.patches.runner_hooks" in graph()["sfi_vllm.plugin"]  # lazy imports count


def test_no_module_imports_a_layer_above_its_own():
    upward = sorted((a, b) for a, deps in graph().items() for b in deps
                    if layer(b) > layer(a) and (a, b) not in KNOWN_UPWARD)
    assert upward == [], upward


def test_the_known_upward_imports_are_still_there():
    """A known exception that has gone must leave the list too."""
    g = graph()
    assert all(b in g[a] for a, b in KNOWN_UPWARD)


def test_no_import_cycles():
    g = graph()
    cycles, state = [], {}

    def visit(node, stack):
        state[node] = "open"
        stack.append(node)
        for dep in sorted(g.get(node, ())):
            if state.get(dep) == "open":
                cycles.append(stack[stack.index(dep):] + [dep])
            elif dep not in state:
                visit(dep, stack)
        stack.pop()
        state[node] = "done"

    for node in sorted(g):
        if node not in state:
            visit(node, [])
    assert cycles == [], cycles
