"""The SQL cookbook page (docs/sql-cookbook.md) is the rendering of phaselens.analysis.queries, not a
hand-copied variant; the README stays a page a newcomer finishes, and the index links every page."""

import re
from pathlib import Path

from phaselens.analysis import cookbook

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
    assert len(text.splitlines()) <= 300
    linked = set(re.findall(r"\]\(docs/([\w-]+\.md)", text))
    assert sorted(TOPICS - linked) == []


def test_docs_index_links_every_page():
    index = (ROOT / "docs" / "README.md").read_text(encoding="utf-8")
    linked = set(re.findall(r"\]\(([\w-]+\.md)", index))
    pages = {p.name for p in (ROOT / "docs").glob("*.md")} - {"README.md"}
    assert sorted(pages - linked) == []
