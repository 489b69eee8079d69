"""What `dashboards generate|check` and `sql write|check` print and return (shared, not a command)."""

from __future__ import annotations

import sys
from pathlib import Path


def report_written(paths: list[Path]) -> int:
    for path in paths:
        print(path)
    return 0


def report_stale(paths: list[Path], fix: str) -> int:
    """Exit status 1 (and each file, and the command that fixes them, on stderr) when any is stale."""
    for path in paths:
        print(f"out of date: {path}", file=sys.stderr)
    if paths:
        print(f"run `{fix}`", file=sys.stderr)
    return 1 if paths else 0
