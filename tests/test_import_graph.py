"""The import graph of phaselens, from the sources (imports inside functions too):
- no two modules import each other: a cycle hides which module owns a type, and a lazy import that
  breaks one only hides it;
- code outside instrumentation comes in through its public API only (`phaselens.instrumentation`,
  a room's `__init__`, `names`), never a room's modules;
- the arrows docs/contracts.md promises (its package table, the reference server's rooms table) are
  the arrows the code has: the tables are parsed from the page, so page and code cannot drift."""

from __future__ import annotations

import ast
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from tests.source_tree import PACKAGES, ROOT

INSTRUMENTATION = "phaselens.instrumentation"
CONTRACTS = ROOT / "docs/contracts.md"


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
    assert graph["phaselens.analysis.report"] >= {"phaselens.analysis.report_page", "phaselens.analysis.report_data"}
    cycles = [" → ".join(c) for name in sorted(graph) if (c := _cycle_from(name, graph))]
    assert cycles == []


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(name, path, modules) if path.suffix == ".py" else set() for name, path in modules.items()}


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
    graph = _graph()
    deep = sorted(
        f"{name} → {imported}" for name, imports in graph.items() for imported in imports if _too_deep(name, imported)
    )
    assert deep == []
    assert "phaselens.instrumentation.pipeline" in graph["phaselens.reference_server.pd.pd_spans"]


@dataclass(slots=True, frozen=True)
class Row:
    """One row of an arrows table: what a unit may import (dotted names under the table's base)."""

    targets: frozenset[str]
    all_above: bool  # "all of the above": any unit listed before it


def _table(text: str, heading: str, units: set[str]) -> dict[str, Row]:
    """The table under `heading`: its first column names a unit (`name` or `name.py`), its last
    column what that unit imports; backticked names whose first part is a unit count, the rest
    (files, functions) is prose."""
    section = text.split(f"{heading}\n", 1)[1].split("\n## ", 1)[0]
    table: dict[str, Row] = {}
    for name, last in re.findall(r"^\| `(\w+)(?:\.py)?`[^|]*\|(?:.*\|)? ([^|]+) \|$", section, re.MULTILINE):
        named = {t for t in re.findall(r"`([\w.]+)`", last) if t.split(".")[0] in units}
        all_above = "all of the above" in last
        table[name] = Row(frozenset(named | (set(table) if all_above else set())), all_above)
    return table


def _covers(target: str, module: str) -> bool:
    return module == target or module.startswith(target + ".")


def _module(base: str, name: str) -> str:
    """The module a table's name stands for: under `base`, except a name of the base itself
    (`phaselens.stack` in the package table)."""
    return name if name.split(".")[0] == base.rpartition(".")[2] else f"{base}.{name}"


def _arrow_report(
    table: dict[str, Row], graph: dict[str, set[str]], unit_of: Callable[[str], str | None], base: str
) -> tuple[list[str], list[str]]:
    """(the code's arrows the table does not list, the table's arrows no code draws); an arrow is
    a unit importing a module of another unit."""
    arrows = {
        (unit, imported)
        for name, imports in graph.items()
        if (unit := unit_of(name))
        for imported in imports
        if unit_of(imported) not in (None, unit)
    }
    row = {name: table.get(name, Row(frozenset(), False)) for name, _ in arrows}
    undocumented = sorted(
        f"{unit} → {imported}"
        for unit, imported in arrows
        if not any(_covers(_module(base, t), imported) for t in row[unit].targets)
    )
    unused = sorted(
        f"{unit} → {target}"
        for unit, r in table.items()
        if not r.all_above
        for target in r.targets
        if not any(u == unit and _covers(_module(base, target), i) for u, i in arrows)
    )
    return undocumented, unused


_PACKAGE_NAMES = {name: name.removeprefix("phaselens.") for name in PACKAGES.values()}


def _package_of(module: str) -> str:
    return _PACKAGE_NAMES[max((n for n in _PACKAGE_NAMES if _covers(n, module)), key=len)]


def _room_of(module: str) -> str | None:
    parts = module.split(".")
    return parts[2] if len(parts) > 2 and parts[1] == "reference_server" else None


def test_the_arrow_report_finds_an_unlisted_and_an_unused_arrow():
    text = "## T\n\n| unit | from |\n|---|---|\n| `a` | `b`, `c.x` |\n| `b` | none |\n| `c` | all of the above |\n"
    table = _table(text, "## T", {"a", "b", "c"})
    assert table["c"] == Row(frozenset({"a", "b"}), True)
    graph = {"p.a.m": {"p.c.x.y"}, "p.b.m": {"p.a.m"}, "p.c.m": {"p.a.m", "p.b.m"}}
    undocumented, unused = _arrow_report(table, graph, lambda m: m.split(".")[1], "p")
    assert (undocumented, unused) == (["b → p.a.m"], ["a → b"])


def test_the_package_table_is_the_code_s_arrows():
    packages = set(_PACKAGE_NAMES.values())
    table = _table(CONTRACTS.read_text(encoding="utf-8"), "## Package arrows", packages)
    assert set(table) == packages
    assert _arrow_report(table, _graph(), _package_of, "phaselens") == ([], [])


def test_the_reference_server_rooms_table_is_the_code_s_arrows():
    graph = _graph()
    rooms = {room for name in graph if (room := _room_of(name))}
    assert {"engine", "serving", "process", "pd", "serve"} <= rooms
    table = _table(CONTRACTS.read_text(encoding="utf-8"), "## Reference server rooms", rooms)
    assert set(table) == rooms
    assert _arrow_report(table, graph, _room_of, "phaselens.reference_server") == ([], [])
