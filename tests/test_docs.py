"""docs/: the pages name every span, attribute, metric and view column the code defines, every
citation of a page (and of a section of it) resolves, and every file a page names exists."""

from __future__ import annotations

import re

from phaselens.analysis import schema as analysis_schema
from phaselens.collectors import schema as collector_schema
from phaselens.instrumentation import names
from phaselens.instrumentation.hotpath import observer
from tests.source_tree import ROOT, python_sources

DOCS = ROOT / "docs"
CITATION = re.compile(r"docs/([\w-]+\.md)(?:#([\w-]+))?")
# Citations of texts a reader of the repository cannot see (spelt so this file does not match itself).
OLD_CITATION = re.compile(r"design\s§|contract\s[A-Z]\b|project\sbrief|issue\s\d+")


def _page(name: str) -> str:
    return (DOCS / name).read_text(encoding="utf-8")


def _anchors(page: str) -> set[str]:
    """GitHub's heading ids: lower case, punctuation dropped, spaces to hyphens."""
    headings = re.findall(r"^#+ (.+)$", _page(page), re.MULTILINE)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in headings}


def test_span_model_names_every_name_of_the_names_module():
    text = _page("span-model.md")
    constants = {k: v for k, v in vars(names).items() if k.isupper() and isinstance(v, str)}
    missing = sorted(f"{k} = {v!r}" for k, v in constants.items() if f"`{v}`" not in text)
    assert missing == []
    for buckets in (names.BUCKETS_TTFT_S, names.BUCKETS_TPOT_S):
        assert " ".join(f"{b:g}" for b in buckets) in text
    assert f"{names.BUCKETS_DURATION_S[0]:g} … {names.BUCKETS_DURATION_S[-1]:g}" in text


def test_contracts_name_every_column_and_observer_method():
    text = _page("contracts.md")
    columns = [
        name
        for name, _ in (*analysis_schema.REQUEST_COLUMNS, *analysis_schema.EXTRA_COLUMNS, *analysis_schema.STEP_COLUMNS)
    ]
    columns += [c for c in collector_schema.INSERT_COLUMNS if "." not in c] + ["Events", "Links"]
    assert [c for c in columns if f"`{c}`" not in text] == []
    methods = [
        m for cls in (observer.RequestObserver, observer.StepObserver) for m in vars(cls) if not m.startswith("_")
    ]
    assert [m for m in methods if f"`{m}(" not in text] == []


def test_every_citation_of_a_page_resolves():
    cited = [
        (path, page, anchor)
        for path in [*python_sources(), *DOCS.glob("*.md"), ROOT / "README.md"]
        for page, anchor in CITATION.findall(path.read_text(encoding="utf-8"))
    ]
    cited += [
        (path, page, anchor)
        for path in DOCS.glob("*.md")
        for page, anchor in re.findall(r"\]\(([\w-]+\.md)(?:#([\w-]+))?\)", path.read_text(encoding="utf-8"))
    ]
    assert len(cited) > 10
    broken = [
        f"{path.relative_to(ROOT)}: {page}#{anchor}"
        for path, page, anchor in cited
        if not (DOCS / page).is_file() or (anchor and anchor not in _anchors(page))
    ]
    assert broken == []


def test_every_file_a_page_names_exists():
    named = {
        (page.name, path)
        for page in DOCS.glob("*.md")
        for path in re.findall(r"`((?:[\w-]+/)+[\w-]+\.(?:py|c|md|sql|yaml|toml))`", page.read_text(encoding="utf-8"))
    }
    assert {page for page, _ in named} >= {"budget-method.md", "span-model.md", "contracts.md", "benchmarks.md"}
    assert sorted(f"{page}: {path}" for page, path in named if not (ROOT / path).is_file()) == []


def test_no_source_cites_a_text_the_repository_lacks():
    holding = {str(p.relative_to(ROOT)) for p in python_sources() if OLD_CITATION.search(p.read_text(encoding="utf-8"))}
    assert holding == set()
