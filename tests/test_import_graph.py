"""No two modules of phaselens import each other, not even through an import inside a function:
a cycle hides which module owns a type, and a lazy import that breaks one only hides it."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from tests.source_tree import PACKAGES, ROOT

INSTRUMENTATION = "phaselens.instrumentation"
REFERENCE_SERVER = "phaselens.reference_server"


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


def _table(heading: str) -> dict[str, set[str]]:
    """The `| name | imports from |` table under a heading of docs/contracts.md: each row's name →
    the backticked names of its second column."""
    text = (ROOT / "docs/contracts.md").read_text(encoding="utf-8")
    section = text.split(f"\n## {heading}\n", 1)[1].split("\n## ", 1)[0]
    rows = [line.split("|") for line in section.splitlines() if line.startswith("| `")]
    return {re.findall(r"`([^`]+)`", row[1])[0]: set(re.findall(r"`([\w./]+)`", row[-2])) for row in rows}


def _owner(module: str, owners: list[str]) -> str | None:
    """The longest of `owners` that `module` is or lies inside."""
    inside = [o for o in owners if module == o or module.startswith(f"{o}.")]
    return max(inside, key=len, default=None)


def _arrows(owners: list[str], within: str = "phaselens") -> set[tuple[str, str, str]]:
    """(owner, imported module, importer) for every import from one owner's module into another's."""
    modules = _modules()
    found = set()
    for name, path in modules.items():
        src = _owner(name, owners)
        if path.suffix != ".py" or src is None or not name.startswith(within):
            continue
        found |= {(src, dep, name) for dep in _imports(name, path, modules) if _owner(dep, owners) not in (src, None)}
    return found


def test_packages_import_only_what_the_contracts_table_says():
    """docs/contracts.md's package table is the rule: an entry `pkg` allows all of it, `pkg.mod` that
    module alone; `phaselens` (the CLI) may import every package."""
    table = {
        f"phaselens.{name}" if name != "phaselens" else name: deps for name, deps in _table("Package arrows").items()
    }
    assert set(table) == {*PACKAGES.values()}
    owners = [*table]
    wrong = []
    for src, dep, importer in _arrows(owners):
        named = [
            d if d.split(".")[0] == "phaselens" else f"phaselens.{d}" for d in table[src] if d.split(".")[0] in PACKAGES
        ]
        allowed = named if src != "phaselens" else owners
        if not any(dep == a or dep.startswith(f"{a}.") for a in allowed):
            wrong.append(f"{importer} → {dep}")
    assert sorted(wrong) == []


ANALYSIS = "phaselens.analysis"


def test_analysis_rooms_import_only_what_the_rooms_table_says():
    """The arrows between analysis/'s rooms are the rooms table's, and they have no cycle."""
    table = {
        f"{ANALYSIS}.{name.strip('/')}": {f"{ANALYSIS}.{d.strip('/')}" for d in deps}
        for name, deps in _table("Analysis rooms").items()
    }
    rooms = [p.parent.name for p in (ROOT / "analysis").glob("*/__init__.py")]
    declarations = [p.stem for p in (ROOT / "analysis").glob("*.py") if p.stem != "__init__"]
    assert set(table) == {f"{ANALYSIS}.{name}" for name in (*rooms, *declarations)}
    assert [
        c for name in sorted(table) if (c := _cycle_from(name, {k: v & set(table) for k, v in table.items()}))
    ] == []
    wrong = [
        f"{importer} → {dep}"
        for src, dep, importer in _arrows([*table], ANALYSIS)
        if _owner(dep, [*table]) not in table[src]
    ]
    assert sorted(wrong) == []


def test_code_outside_analysis_imports_only_what_a_room_exports():
    """Outside analysis/ (tests aside: they test modules), an import names `phaselens.analysis` or one of
    its rooms, and only a name that room lists in `__all__`."""
    import importlib

    wrong = []
    for path in [p for folder in PACKAGES if folder != "analysis" for p in sorted((ROOT / folder).rglob("*.py"))]:
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                wrong += [f"{path}: import {a.name}" for a in node.names if a.name.startswith(f"{ANALYSIS}.")]
            elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith(ANALYSIS):
                room = node.module or ""
                exported = set(getattr(importlib.import_module(room), "__all__", ())) if room != ANALYSIS else None
                names = {a.name for a in node.names}
                if room.count(".") > 2 or (exported is not None and not names <= exported):
                    wrong.append(f"{path}: from {room} import {', '.join(sorted(names))}")
    assert wrong == []


def test_reference_server_rooms_import_what_the_rooms_table_says_and_nothing_listed_goes_unused():
    """docs/contracts.md's reference-server rooms table, both ways: an arrow the code has and the
    table lacks, and an entry no import uses, both fail."""
    table = {
        f"{REFERENCE_SERVER}.{name.removesuffix('.py')}": {f"{REFERENCE_SERVER}.{d}" for d in deps}
        for name, deps in _table("Reference server rooms").items()
    }
    folder = ROOT / "reference_server"
    rooms = [p.parent.name for p in folder.glob("*/__init__.py")] + [p.stem for p in folder.glob("*.py")]
    assert set(table) == {f"{REFERENCE_SERVER}.{name}" for name in rooms if name != "__init__"}
    arrows = _arrows([*table], REFERENCE_SERVER)
    wrong = [f"{importer} → {dep}" for src, dep, importer in arrows if _owner(dep, [*table]) not in table[src]]
    used = {(src, _owner(dep, [*table])) for src, dep, _ in arrows}
    unused = [f"{src} → {dep}" for src, deps in table.items() for dep in deps if (src, dep) not in used]
    assert (sorted(wrong), sorted(unused)) == ([], [])


def _too_deep(importer: str, imported: str) -> bool:
    """An import from outside instrumentation past its public API: deeper than
    `phaselens.instrumentation.<room or names>`."""
    inside = importer == INSTRUMENTATION or importer.startswith(INSTRUMENTATION + ".")
    return not inside and imported.startswith(INSTRUMENTATION + ".") and imported.count(".") > 2


def test_the_public_api_rule_tells_a_room_from_its_modules():
    assert _too_deep("phaselens.loadgen.runner", "phaselens.instrumentation.client.traced_client")
    assert not _too_deep("phaselens.loadgen.runner", "phaselens.instrumentation.client")
    assert not _too_deep("phaselens.analysis.schema", "phaselens.instrumentation.names")
    assert not _too_deep("phaselens.instrumentation.server.telemetry", "phaselens.instrumentation.hotpath.handle")


def test_outside_instrumentation_only_its_public_api_is_imported():
    """`phaselens.instrumentation`, a room's `__init__` or `names`; never a room's modules (tests and
    benchmarks aside: they test and time modules)."""
    modules = _modules()
    deep = sorted(
        f"{name} → {imported}"
        for name, path in modules.items()
        if path.suffix == ".py"
        for imported in _imports(name, path, modules)
        if _too_deep(name, imported)
    )
    assert deep == []
