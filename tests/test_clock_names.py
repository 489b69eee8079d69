"""Names and types carry their clock (phaselens.common.clocks): an instant is `*_ts`, a duration
`*_ns`/`*_ms`, and mypy rejects a monotonic instant where a wall one is expected."""

from __future__ import annotations

import ast
import re
import subprocess
import sys

from source_tree import PACKAGES, ROOT

# a call that reads a clock: the `time` functions, their typed aliases, an injected clock reader
CLOCK_READ = re.compile(
    r"^(_?clock_ns|(monotonic|perf_counter|time|clock_gettime)_ns|monotonic_ts|perf_counter_ts|wall_clock_ts)$"
)


KEEPS_KIND = {"MonoTs", "WallTs", "int"}  # wrappers whose value is their argument's kind


def _callee(call: ast.Call) -> str:
    return call.func.attr if isinstance(call.func, ast.Attribute) else getattr(call.func, "id", "")


def _instant(node: ast.expr) -> bool:
    """An expression whose value is an instant: a clock read, ± a duration (instant − instant is not)."""
    if isinstance(node, ast.Call):
        callee = _callee(node)
        return bool(CLOCK_READ.match(callee)) or (callee in KEEPS_KIND and bool(node.args) and _instant(node.args[0]))
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        return _instant(node.left) or _instant(node.right)
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Sub):
        return _instant(node.left) and not _instant(node.right)
    if isinstance(node, ast.IfExp):
        return _instant(node.body) or _instant(node.orelse)
    return isinstance(node, ast.BoolOp) and any(_instant(value) for value in node.values)


def _name(target: ast.expr) -> str:
    return target.attr if isinstance(target, ast.Attribute) else getattr(target, "id", "")


def _bindings(node: ast.AST) -> list[tuple[str, ast.expr]]:
    """(name, value) pairs a node binds: assignment targets, a call's keyword arguments."""
    if isinstance(node, ast.Assign):
        pairs: list[tuple[ast.expr, ast.expr]] = []
        for target in node.targets:
            if isinstance(target, ast.Tuple) and isinstance(node.value, ast.Tuple):
                pairs += zip(target.elts, node.value.elts, strict=False)
            else:
                pairs.append((target, node.value))
        return [(_name(target), value) for target, value in pairs]
    if isinstance(node, ast.AnnAssign) and node.value is not None:
        return [(_name(node.target), node.value)]
    if isinstance(node, ast.Call):
        return [(keyword.arg, keyword.value) for keyword in node.keywords if keyword.arg]
    return []


def instants_named_ns(source: str) -> list[tuple[int, str]]:
    """(line, name) of every `*_ns` name bound to an instant: a clock read (± a duration)."""
    return [
        (node.lineno, name)
        for node in ast.walk(ast.parse(source))
        for name, value in _bindings(node)
        if name.endswith("_ns") and _instant(value)
    ]


def test_the_scan_tells_instants_from_durations() -> None:
    source = """
a_ns = time.monotonic_ns()
self.b_ns = self._clock_ns() + lead_ns
c_ts, d_ns = perf_counter_ts(), clock_ns()
e_ns: int = MonoTs(time.perf_counter_ns() + 5)
delay_ns = start_ts - time.perf_counter_ns()
cpu_ns = time.process_time_ns()
f_ts = time.monotonic_ns()
record = Record(g_ns=time.monotonic_ns(), h_ns=interval_ns)
"""
    found = [(2, "a_ns"), (3, "b_ns"), (4, "d_ns"), (5, "e_ns"), (9, "g_ns")]
    assert sorted(instants_named_ns(source)) == found


def test_shipped_code_names_no_instant_ns() -> None:
    """The packages installed under `phaselens.*` (not tests, not benchmarks)."""
    found = [
        f"{path.relative_to(ROOT)}:{line}: {name}"
        for folder in PACKAGES
        for path in sorted((ROOT / folder).rglob("*.py"))
        for line, name in instants_named_ns(path.read_text())
    ]
    assert found == []


def test_mypy_rejects_one_clock_for_another(tmp_path) -> None:
    """Each `# error: CODE` line of clock_types_example.py gets that error, no other line any."""
    example = ROOT / "tests/clock_types_example.py"
    subprocess.run([sys.executable, str(ROOT / ".ci/linktree")], check=True)
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "mypy",
            "--no-error-summary",
            "--show-error-codes",
            "--follow-imports=silent",
            "--cache-dir",
            str(tmp_path),
            str(example),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env={"MYPYPATH": str(ROOT / "build/src"), "PATH": ""},
        check=False,
    )
    errors = set(re.findall(r"clock_types_example\.py:(\d+): error: .*\[([\w-]+)\]$", done.stdout, re.MULTILINE))
    expected = {
        (str(number), marker.group(1))
        for number, line in enumerate(example.read_text().splitlines(), 1)
        if (marker := re.search(r"# error: ([\w-]+)$", line))
    }
    assert len(expected) == 5 and errors == expected, done.stdout + done.stderr
