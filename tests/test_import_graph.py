"""No two modules of phaselens import each other, not even through an import inside a function:
a cycle hides which module owns a type, and a lazy import that breaks one only hides it."""

from __future__ import annotations

import ast
from pathlib import Path

from tests.source_tree import PACKAGES, ROOT


def _modules() -> dict[str, Path]:
    """Module name → source; a C extension (setup.py) is named after its `.c` file."""
    out = {}
    for folder, package in PACKAGES.items():
        for path in [*(ROOT / folder).rglob("*.py"), *(ROOT / folder).rglob("*.c")]:
            parts = [p for p in path.relative_to(ROOT / folder).with_suffix("").parts if p != "__init__"]
            out[".".join([package, *parts])] = path
    return out


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The phaselens modules `name` imports; `from pkg import mod` counts as importing `pkg.mod`."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = package
            for _ in range(node.level - 1):
                base = base.rpartition(".")[0]
            module = node.module if not node.level else ".".join(filter(None, (base, node.module)))
            for alias in node.names:
                found.add(f"{module}.{alias.name}" if f"{module}.{alias.name}" in modules else module)
    return {m for m in found if m in modules and m != name}


def _cycle_from(start: str, graph: dict[str, set[str]]) -> list[str] | None:
    """A path start → … → start, or None (depth-first)."""
    stack, seen = [(start, [start])], set()
    while stack:
        node, path = stack.pop()
        for nxt in graph[node]:
            if nxt == start:
                return [*path, start]
            if nxt not in seen:
                seen.add(nxt)
                stack.append((nxt, [*path, nxt]))
    return None


def test_cycle_finder_finds_a_cycle_and_only_a_cycle():
    assert _cycle_from("a", {"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle_from("a", {"a": {"b"}, "b": {"c"}, "c": set()}) is None


def test_no_module_imports_itself_through_others():
    modules = _modules()
    graph = {name: _imports(name, path, modules) if path.suffix == ".py" else set() for name, path in modules.items()}
    assert graph["phaselens.analysis.report.report"] >= {
        "phaselens.analysis.report.report_page",
        "phaselens.analysis.report.report_data",
    }
    cycles = [" → ".join(c) for name in sorted(graph) if (c := _cycle_from(name, graph))]
    assert cycles == []
