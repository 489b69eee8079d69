"""The repository's source tree as pyproject.toml maps it, for the tests that read sources."""

from __future__ import annotations

import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
_SETUPTOOLS = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
# Folder → import name: the package-dir mapping, plus `phaselens/` itself.
PACKAGES = {folder: name for name, folder in _SETUPTOOLS["package-dir"].items()} | {"phaselens": "phaselens"}
# Every folder with Python sources of ours.
SOURCE_DIRS = (*PACKAGES, "benchmarks", "tests")


def python_sources() -> list[Path]:
    return [path for folder in SOURCE_DIRS for path in sorted((ROOT / folder).rglob("*.py"))]
