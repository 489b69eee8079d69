"""docs/: the pages name every span, attribute, metric and view column the code defines, every
citation of a page (and of a section of it) resolves, and every file a page names exists."""

from __future__ import annotations

import re

from phaselens.analysis.schema import schema as analysis_schema
from phaselens.collectors import schema as collector_schema
from phaselens.instrumentation import names
from phaselens.instrumentation.hotpath import observer
from tests.source_tree import ROOT, python_sources

DOCS = ROOT / "docs"
CITATION = re.compile(r"docs/([\w-]+\.md)(?:#([\w-]+))?")
# Citations of texts a reader of the repository cannot see (spelt so this file does not match itself).
OLD_CITATION = re.compile(r"design\s§|contract\s[A-Z]\b|project\sbrief|issue\s\d+")
# An issue of this project by number (the word and its number, "#" and a number, an anchor's
# "issue-" and one); an upstream one names its project (vllm#22454) or links its address.
OUR_ISSUE = re.compile(r"(?i)\bissues?[\s-]+#?\d+|(?<![\w/#&])#\d+\b")


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


def test_contracts_state_the_hand_offs_bound_as_the_code_sets_it():
    from phaselens.instrumentation.process.process_sink import SHIP_INTERVAL_S
    from phaselens.instrumentation.server.telemetry import DEFAULT_QUEUE_CAPACITY

    text = " ".join(_page("contracts.md").split())
    assert f"they hold {DEFAULT_QUEUE_CAPACITY:,} records of each kind" in text
    assert f"the shipper takes them every {SHIP_INTERVAL_S:g} s" in text
    assert f"a sustained rate past {DEFAULT_QUEUE_CAPACITY / SHIP_INTERVAL_S:,.0f} requests" in text


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


def _doc_texts() -> dict[str, str]:
    return {"README.md": (ROOT / "README.md").read_text(encoding="utf-8")} | {
        f"docs/{p.name}": p.read_text(encoding="utf-8") for p in sorted(DOCS.glob("*.md"))
    }


def test_our_issue_pattern_tells_ours_from_upstream():
    n = 23  # spelt apart, so this file does not cite an issue itself
    ours = [f"Issue {n}, one run", f"after issue {n}'s pass", f"see #{n}.", f"(#{n})", f"pass-issue-{n}-the"]
    upstream = ["vllm#22454", "[guidellm#986](https://github.com/vllm-project/guidellm/issues/986)", "#fourth-pass"]
    assert [t for t in ours if not OUR_ISSUE.search(t)] == []
    assert [t for t in upstream if OUR_ISSUE.search(t)] == []


def test_no_page_cites_an_issue_of_ours_by_number():
    found = [f"{name}: {m.group(0)!r}" for name, text in _doc_texts().items() for m in OUR_ISSUE.finditer(text)]
    assert found == []


def _glossary_terms() -> list[str]:
    return [
        t
        for line in re.findall(r"^- (.+)$", _page("glossary.md"), re.MULTILINE)
        for t in re.findall(r"\*\*(.+?)\*\*", line.split(":")[0])
    ]


def test_glossary_defines_the_projects_words():
    terms = {t.lower() for t in _glossary_terms()}
    assert len(terms) >= 40
    assert {"shipper", "span-builder child", "sealed", "live rows", "client_late_est", "first_chunk"} <= terms
    assert {"residual", "anchor", "witness", "rollup", "p/d", "kv transfer"} <= terms


def test_every_glossary_term_is_used_in_the_docs_or_the_code():
    used = "\n".join(text for name, text in _doc_texts().items() if name != "docs/glossary.md")
    used += "\n".join(p.read_text(encoding="utf-8") for p in python_sources())
    used += "\n".join(p.read_text(encoding="utf-8") for p in ROOT.glob("*/**/*.c") if ".venv" not in p.parts)
    used = used.lower()
    assert [t for t in _glossary_terms() if t.lower() not in used] == []


def test_span_backends_keeps_the_present_and_history_the_passes():
    """The design page stays one sitting long; the optimisation passes are told on the history page."""
    present = _page("span-backends.md")
    assert len(present.splitlines()) <= 200
    assert re.findall(r"(?im)^#+ \w+ pass\b", present) == []
    assert len(re.findall(r"(?m)^### \w+ pass: ", _page("history.md"))) >= 10
