"""The README's SQL cookbook is the rendering of phaselens.analysis.queries, not a hand-copied variant."""

from pathlib import Path

from phaselens.analysis import cookbook

README = Path(__file__).resolve().parents[1] / "README.md"


def test_readme_cookbook_is_generated_from_the_queries():
    assert cookbook.markdown().rstrip("\n") in README.read_text()
