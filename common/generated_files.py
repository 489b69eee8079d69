"""Checked-in files rendered from code (dashboards JSON, the SQL files): write them, or say which
are out of date. `rendered` maps a path relative to `root` to its text; `managed` is the glob of the
files the rendering owns, so a file it no longer renders counts as stale and is removed on write."""

from __future__ import annotations

from pathlib import Path


def write(root: Path, rendered: dict[str, str], managed: str) -> list[Path]:
    """Write every rendered file under `root`; remove a managed file that is not rendered any more."""
    root = Path(root)
    for old in root.glob(managed):
        if old.relative_to(root).as_posix() not in rendered:
            old.unlink()
    written = []
    for rel, text in rendered.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
        written.append(path)
    return written


def stale(root: Path, rendered: dict[str, str], managed: str) -> list[Path]:
    """Rendered files that are missing or differ under `root`, then managed files left over."""
    root = Path(root)
    out = [
        root / rel
        for rel, text in rendered.items()
        if not (root / rel).is_file() or (root / rel).read_text(encoding="utf-8") != text
    ]
    return out + [p for p in sorted(root.glob(managed)) if p.relative_to(root).as_posix() not in rendered]
