"""A Diagnosis as text: rich tables (terminal), JSON (`primary_cause`, `causes`, …) or Markdown."""

from __future__ import annotations

import json

from rich.console import Group
from rich.table import Table

from phaselens.analysis.diagnose.diagnosis import Diagnosis


def headline(d: Diagnosis) -> str:
    """One line: the verdict and each level's cause."""
    levels = "; ".join(f"{v.level}: {v.primary_cause}" for v in d.levels.values())
    slo = ", ".join(f"{k.removesuffix('_ms')} {v:g} ms" for k, v in d.slo.items())
    measured = f" (client views: {', '.join(d.client_harnesses)})" if d.client_harnesses else ""
    return f"verdict: {d.primary_cause} ({levels}) over {d.requests} requests{measured}, SLO {slo}"


def _signal(x: float | None) -> str:
    return "–" if x is None else f"{x:.2f}"


def to_rich(d: Diagnosis) -> Group:
    steps = Table(title="Diagnosis, step by step", title_justify="left", show_lines=True)
    for header in ("step", "finding", "evidence"):
        steps.add_column(header)
    for s in d.steps:
        steps.add_row(f"{s.number}. {s.question}", s.finding, "\n".join(s.evidence))
    signals = Table(
        title="Causes (signal ≥ threshold while the SLO it acts on is at risk = flagged)", title_justify="left"
    )
    for i, header in enumerate(
        ("cause", "role", "p50 signal", "p99 signal", "threshold", "flagged p50", "flagged p99")
    ):
        signals.add_column(header, justify="left" if i < 2 else "right")
    for sig in d.signals:
        signals.add_row(
            sig.cause,
            sig.role,
            _signal(sig.p50_signal),
            _signal(sig.p99_signal),
            f"{sig.threshold:g}",
            "yes" if sig.flagged_p50 else "",
            "yes" if sig.flagged_p99 else "",
        )
    levers = Table(title="Levers", title_justify="left", show_lines=True)
    for header in ("cause", "lever", "evidence"):
        levers.add_column(header)
    for lever in d.levers:
        levers.add_row(lever.cause, lever.action, lever.evidence)
    parts = [steps, signals] + ([levers] if d.levers else [])
    return Group(*parts, f"[bold]{headline(d)}[/bold]")


def to_json(d: Diagnosis) -> str:
    return json.dumps(d.to_dict(), indent=2, default=str)


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", "<br>")


def to_markdown(d: Diagnosis) -> str:
    lines = [f"**{headline(d)}**", "", "| step | finding | evidence |", "|---|---|---|"]
    lines += [
        f"| {s.number}. {_cell(s.question)} | {_cell(s.finding)} | {_cell('; '.join(s.evidence))} |" for s in d.steps
    ]
    if d.levers:
        lines += ["", "| cause | lever | evidence |", "|---|---|---|"]
        lines += [f"| {lv.cause} | {_cell(lv.action)} | {_cell(lv.evidence)} |" for lv in d.levers]
    return "\n".join(lines) + "\n"
