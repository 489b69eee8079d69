"""The SQL cookbook page (docs/sql-cookbook.md) is the rendering of phaselens.analysis.queries, not a
hand-copied variant; the README stays a page a newcomer finishes (its two commands are what CI and
setup.sh do, its servers table says how each server is tested, no dated figures), and the index
links every page."""

import re
import shlex
from pathlib import Path

import pytest

from phaselens.analysis.sql import cookbook
from phaselens.cli import build_parser

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
COOKBOOK = ROOT / "docs" / "sql-cookbook.md"
# What a newcomer goes to next: the README links these; docs/README.md links every page.
TOPICS = {
    "README.md",
    "quickstart.md",
    "budget-method.md",
    "span-model.md",
    "contracts.md",
    "vllm.md",
    "other-servers.md",
    "scaling.md",
    "faults.md",
    "benchmarks.md",
    "sql-cookbook.md",
    "instrument-your-loop.md",
}


def test_cookbook_page_is_generated_from_the_queries():
    assert cookbook.markdown().rstrip("\n") in COOKBOOK.read_text(encoding="utf-8")


def test_readme_is_short_and_links_the_index_and_the_topics():
    text = README.read_text(encoding="utf-8")
    assert len(text.splitlines()) <= 160
    linked = set(re.findall(r"\]\(docs/([\w-]+\.md)", text))
    assert sorted(TOPICS - linked) == []


def test_docs_index_links_every_page():
    index = (ROOT / "docs" / "README.md").read_text(encoding="utf-8")
    linked = set(re.findall(r"\]\(([\w-]+\.md)", index))
    pages = {p.name for p in (ROOT / "docs").glob("*.md")} - {"README.md"}
    assert sorted(pages - linked) == []


def _readme_commands() -> list[list[list[str]]]:
    """The README's first bash block: each line's command, split at `&&`, each part into words."""
    block = re.search(r"```bash\n(.*?)```", README.read_text(encoding="utf-8"), re.DOTALL)
    assert block, "the README shows its commands in a bash block"
    lines = [line.split("#")[0].strip() for line in block.group(1).splitlines()]
    return [[shlex.split(part) for part in line.split("&&")] for line in lines if line]


def _ci_steps() -> list[list[str]]:
    """.ci/run's `step` lines, the commands CI runs in order."""
    text = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    return [shlex.split(line)[1:] for line in text.splitlines() if line.startswith("step ")]


def test_readme_shows_the_two_commands_setup_and_ci_run():
    demo, tests = _readme_commands()
    assert demo == [["./setup.sh"], [".venv/bin/phaselens", "demo"]]
    assert tests == [["./setup.sh", "--test"], [".venv/bin/python", "-m", "pytest", "-q"]]
    steps = [s for s in _ci_steps() if s[-1] != "&"]
    assert steps[0] == tests[0] and steps[-1] == tests[1], steps
    setup = (ROOT / "setup.sh").read_text(encoding="utf-8")
    assert '"${1:-}" == "--test"' in setup and "python3 -m venv .venv\n" in setup
    assert build_parser().parse_args(["demo"]).command == "demo"
    assert '[project.scripts]\nphaselens = "phaselens.cli:main"' in (ROOT / "pyproject.toml").read_text()


def test_readme_has_no_dated_figures_or_before_after_tables():
    text = README.read_text(encoding="utf-8")
    assert re.findall(r"\b20\d\d-\d\d-\d\d\b", text) == []
    rows = [line for line in text.splitlines() if line.startswith("|")]
    assert [r for r in rows if re.search(r"\bbefore\b|\bafter\b|\d\s*→\s*\**\d", r, re.IGNORECASE)] == []
    assert re.findall(r"(?i)\b(?:was|fell from|down from)\s+[\d.,]+", text) == []


SERVERS = ("reference server", "vLLM", "SGLang", "TGI", "Dynamo", "your own serving loop")


def _servers_table() -> list[list[str]]:
    text = README.read_text(encoding="utf-8")
    section = text.split("## Servers", 1)[1].split("\n## ", 1)[0]
    return [[c.strip() for c in r.strip("|").split("|")] for r in section.splitlines() if r.startswith("| ")][1:]


def test_readme_servers_table_says_live_or_built_spans_per_row():
    rows = _servers_table()
    assert [s for s in SERVERS if not any(s in row[0] for row in rows)] == []
    assert [row for row in rows if not re.match(r"(live|built spans)\b", row[-1])] == []


@pytest.mark.parametrize(
    ("server", "kind"),
    [
        ("SGLang", "built spans"),
        ("TGI", "built spans"),
        ("Dynamo", "live"),
        ("vLLM, native", "live"),
        ("vLLM with the phaselens plugin", "live"),
    ],
)
def test_servers_table_matches_how_the_tests_test_them(server, kind):
    """A "live" row's tests start the server; a "built spans" row's tests build its spans in the test."""
    (row,) = [r for r in _servers_table() if r[0].startswith(server)]
    assert row[-1].startswith(kind)
    name = server.split(",")[0].split(" ")[0].lower()
    tests = [p for p in (ROOT / "tests").glob("test_*.py") if name in p.read_text(encoding="utf-8").lower()]
    if kind == "live":
        assert any("launch" in p.read_text(encoding="utf-8") and name in p.name for p in tests), tests
    else:
        built = [p.name for p in tests if "built as" in p.read_text(encoding="utf-8").split('"""')[1]]
        assert built, f"no test builds {server}'s spans"
