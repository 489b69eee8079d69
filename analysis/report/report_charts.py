"""Inline SVG charts for the HTML report: no JavaScript, no network, one string per chart.

Every chart takes plain numbers (milliseconds, tokens, seconds) and returns an `<svg>` element.
Tooltips are SVG `<title>` children, which every browser shows natively.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from html import escape

WIDTH = 880
FONT = 'font-family="system-ui,-apple-system,Segoe UI,Roboto,sans-serif"'


@dataclass(slots=True)
class Series:
    """One named, coloured series: `xs` alone for a CDF, `xs` and `ys` for a scatter or a line."""

    name: str
    color: str
    xs: list[float]
    ys: list[float] = field(default_factory=list)


@dataclass(slots=True)
class Segment:
    """One stacked piece of a horizontal bar."""

    name: str
    color: str
    value: float


@dataclass(slots=True)
class BarRow:
    label: str
    segments: list[Segment]
    marker: float | None = None  # a reference total drawn as a tick (e.g. the TTFT percentile itself)
    marker_label: str = ""


@dataclass(slots=True)
class Lane:
    """One span of a waterfall: `start_ms` on the chart's own axis, `duration_ms` from one clock."""

    label: str
    start_ms: float
    duration_ms: float
    color: str
    depth: int = 0
    note: str = ""


@dataclass(slots=True)
class Frame:
    """Plot area and linear (or log10 x) scales; `sx`/`sy` map data to pixels."""

    x0: float
    x1: float
    y0: float
    y1: float
    height: int
    left: int = 64
    right: int = 24
    top: int = 16
    bottom: int = 44
    width: int = WIDTH
    log_x: bool = False

    def sx(self, v: float) -> float:
        if self.log_x:
            v, lo, hi = math.log10(max(v, 1e-9)), math.log10(self.x0), math.log10(self.x1)
        else:
            lo, hi = self.x0, self.x1
        span = (hi - lo) or 1.0
        return self.left + (v - lo) / span * (self.width - self.left - self.right)

    def sy(self, v: float) -> float:
        span = (self.y1 - self.y0) or 1.0
        return self.height - self.bottom - (v - self.y0) / span * (self.height - self.top - self.bottom)


def nice_ticks(lo: float, hi: float, count: int = 6) -> list[float]:
    """Round tick values (1, 2, 5 × 10^k steps) covering [lo, hi]."""
    if hi <= lo:
        hi = lo + 1.0
    raw = (hi - lo) / max(count - 1, 1)
    mag = 10 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1, 2, 5, 10) if m * mag >= raw)
    first = math.ceil(lo / step) * step
    return [round(first + i * step, 10) for i in range(int((hi - first) / step + 1e-9) + 1)]


def log_ticks(lo: float, hi: float) -> list[float]:
    """1, 2, 5 × 10^k ticks between lo and hi (both > 0)."""
    ticks = []
    for k in range(math.floor(math.log10(lo)), math.ceil(math.log10(hi)) + 1):
        ticks += [m * 10.0**k for m in (1, 2, 5) if lo <= m * 10.0**k <= hi]
    return ticks


def fmt(v: float) -> str:
    """Short number for ticks and labels: 1234 → 1234, 12.5 → 12.5, 0.123 → 0.12."""
    if v == 0:
        return "0"
    if abs(v) >= 100:
        return f"{v:.0f}"
    if abs(v) >= 10:
        return f"{v:.1f}".rstrip("0").rstrip(".")
    return f"{v:.2f}".rstrip("0").rstrip(".")


def _svg(width: int, height: int, body: list[str], label: str) -> str:
    return (
        f'<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {width} {height}" width="100%" '
        f'role="img" aria-label="{escape(label)}" {FONT} font-size="12">' + "".join(body) + "</svg>"
    )


def _text(x: float, y: float, s: str, anchor: str = "start", cls: str = "", extra: str = "") -> str:
    css = f' class="{cls}"' if cls else ""
    return f'<text x="{x:.1f}" y="{y:.1f}" text-anchor="{anchor}"{css} {extra}>{escape(s)}</text>'


def _axes(fr: Frame, x_label: str, y_label: str, x_ticks: list[float], y_ticks: list[float]) -> list[str]:
    out = []
    for t in y_ticks:
        y = fr.sy(t)
        out.append(f'<line x1="{fr.left}" x2="{fr.width - fr.right}" y1="{y:.1f}" y2="{y:.1f}" class="grid"/>')
        out.append(_text(fr.left - 6, y + 4, fmt(t), "end", "tick"))
    base = fr.height - fr.bottom
    for t in x_ticks:
        x = fr.sx(t)
        out.append(f'<line x1="{x:.1f}" x2="{x:.1f}" y1="{fr.top}" y2="{base}" class="grid"/>')
        out.append(_text(x, base + 16, fmt(t), "middle", "tick"))
    out.append(f'<line x1="{fr.left}" x2="{fr.width - fr.right}" y1="{base}" y2="{base}" class="axis"/>')
    out.append(_text((fr.left + fr.width - fr.right) / 2, fr.height - 6, x_label, "middle", "label"))
    out.append(
        _text(
            14, (fr.top + base) / 2, y_label, "middle", "label", f'transform="rotate(-90 14 {(fr.top + base) / 2:.1f})"'
        )
    )
    return out


def legend(items: list[tuple[str, str]]) -> str:
    """HTML legend (name, colour) placed under a chart."""
    spans = "".join(f'<span class="key"><i style="background:{c}"></i>{escape(n)}</span>' for n, c in items)
    return f'<div class="legend">{spans}</div>'


def empty(message: str) -> str:
    return _svg(WIDTH, 60, [_text(WIDTH / 2, 34, message, "middle", "label")], message)


def stacked_bars(rows: list[BarRow], unit: str = "ms") -> str:
    """Horizontal stacked bars, one per row; the marker is the row's reference total."""
    if not rows:
        return empty("no requests in range")
    bar_h, gap = 26, 14
    height = 16 + len(rows) * (bar_h + gap) + 40
    top = max(max(sum(s.value for s in r.segments), r.marker or 0.0) for r in rows) * 1.08 or 1.0
    fr = Frame(0.0, top, 0.0, 1.0, height, left=96, bottom=40)
    body = _axes(fr, unit, "", nice_ticks(0.0, top), [])
    for i, row in enumerate(rows):
        y = 16 + i * (bar_h + gap)
        body.append(_text(fr.left - 8, y + bar_h / 2 + 4, row.label, "end", "rowlabel"))
        acc = 0.0
        for seg in row.segments:
            x, w = fr.sx(acc), fr.sx(acc + seg.value) - fr.sx(acc)
            tip = f"{row.label} · {seg.name}: {seg.value:.2f} {unit}"
            body.append(
                f'<rect x="{x:.1f}" y="{y}" width="{max(w, 0):.1f}" height="{bar_h}" '
                f'fill="{seg.color}"><title>{escape(tip)}</title></rect>'
            )
            acc += seg.value
        body.append(_text(fr.sx(acc) + 4, y + bar_h / 2 + 4, f"{acc:.1f} {unit}", "start", "value"))
        if row.marker is not None:
            mx = fr.sx(row.marker)
            body.append(
                f'<line x1="{mx:.1f}" x2="{mx:.1f}" y1="{y - 4}" y2="{y + bar_h + 4}" class="marker">'
                f"<title>{escape(row.marker_label)}: {row.marker:.2f} {unit}</title></line>"
            )
    return _svg(WIDTH, height, body, "latency budget stacked bars")


def cdf(series: list[Series], x_label: str, log_x: bool = True) -> str:
    """Empirical CDFs as step lines; x on a log scale by default (latencies span decades)."""
    values = [v for s in series for v in s.xs if v > 0 or not log_x]
    if not values:
        return empty("no samples")
    lo, hi = min(values), max(values)
    if log_x:
        lo, hi = 10 ** math.floor(math.log10(lo)), 10 ** math.ceil(math.log10(hi))
    fr = Frame(lo, hi if hi > lo else lo + 1, 0.0, 1.0, 300, log_x=log_x)
    xt = log_ticks(lo, hi) if log_x else nice_ticks(lo, hi)
    body = _axes(fr, x_label, "fraction of requests ≤ x", xt, [0, 0.25, 0.5, 0.75, 0.9, 1.0])
    for s in series:
        xs = sorted(v for v in s.xs if v > 0 or not log_x)
        n = len(xs)
        if not n:
            continue
        pts = [f"{fr.sx(xs[0]):.1f},{fr.sy(0):.1f}"]
        for i, v in enumerate(xs):
            pts.append(f"{fr.sx(v):.1f},{fr.sy(i / n):.1f} {fr.sx(v):.1f},{fr.sy((i + 1) / n):.1f}")
        body.append(
            f'<polyline points="{" ".join(pts)}" fill="none" stroke="{s.color}" stroke-width="2">'
            f"<title>{escape(s.name)} (n={n})</title></polyline>"
        )
    return _svg(WIDTH, 300, body, f"CDF of {x_label}")


def scatter(series: list[Series], x_label: str, y_label: str) -> str:
    """Points, one colour per series; y from zero so that growth with x reads honestly."""
    xs = [x for s in series for x in s.xs]
    ys = [y for s in series for y in s.ys]
    if not xs:
        return empty("no samples")
    x_hi, y_hi = max(xs) * 1.05 or 1.0, max(ys) * 1.08 or 1.0
    fr = Frame(0.0, x_hi, 0.0, y_hi, 320)
    body = _axes(fr, x_label, y_label, nice_ticks(0.0, x_hi), nice_ticks(0.0, y_hi))
    for s in series:
        for x, y in zip(s.xs, s.ys, strict=False):
            body.append(
                f'<circle cx="{fr.sx(x):.1f}" cy="{fr.sy(y):.1f}" r="3" fill="{s.color}" '
                f'fill-opacity="0.7"><title>{escape(s.name)}: {fmt(x)} → {y:.1f}</title></circle>'
            )
    return _svg(WIDTH, 320, body, f"{y_label} against {x_label}")


def waterfall(lanes: list[Lane], total_ms: float) -> str:
    """One row per span, indented by depth; bars on a shared ms axis starting at 0."""
    if not lanes:
        return empty("trace not found")
    row_h, left = 22, 250
    height = 12 + len(lanes) * row_h + 44
    end = max([total_ms] + [ln.start_ms + ln.duration_ms for ln in lanes]) * 1.02 or 1.0
    fr = Frame(0.0, end, 0.0, 1.0, height, left=left, bottom=40)
    body = _axes(fr, "ms since the client sent the request", "", nice_ticks(0.0, end), [])
    for i, ln in enumerate(lanes):
        y = 12 + i * row_h
        body.append(_text(8 + 12 * ln.depth, y + 15, ln.label, "start", "rowlabel"))
        x, w = fr.sx(ln.start_ms), max(fr.sx(ln.start_ms + ln.duration_ms) - fr.sx(ln.start_ms), 1.5)
        tip = f"{ln.label}: {ln.duration_ms:.2f} ms" + (f" · {ln.note}" if ln.note else "")
        body.append(
            f'<rect x="{x:.1f}" y="{y + 3}" width="{w:.1f}" height="{row_h - 6}" rx="2" '
            f'fill="{ln.color}"><title>{escape(tip)}</title></rect>'
        )
        text = f"{ln.duration_ms:.1f} ms"
        if w > 70:  # long bars carry their duration inside, short ones beside (left at the far right)
            body.append(_text(x + w - 4, y + 15, text, "end", "inbar"))
        elif x + w + 60 < WIDTH - fr.right:
            body.append(_text(x + w + 4, y + 15, text, "start", "value"))
        else:
            body.append(_text(x - 4, y + 15, text, "end", "value"))
    return _svg(WIDTH, height, body, "request waterfall")


def stacked_columns(t_s: list[float], stacks: list[Series], x_label: str, y_label: str, height: int = 300) -> str:
    """Columns over time, one per x, with the series' ys stacked (e.g. prefill vs decode tokens)."""
    if not t_s:
        return empty("no engine steps in range")
    totals = [sum(s.ys[i] for s in stacks) for i in range(len(t_s))]
    x_hi = max(t_s) + (t_s[1] - t_s[0] if len(t_s) > 1 else 1.0)
    y_hi = max(totals) * 1.08 or 1.0
    fr = Frame(min(t_s), x_hi, 0.0, y_hi, height)
    body = _axes(fr, x_label, y_label, nice_ticks(min(t_s), x_hi), nice_ticks(0.0, y_hi))
    width = max((fr.sx(x_hi) - fr.sx(min(t_s))) / len(t_s) - 0.5, 0.8)
    for i, t in enumerate(t_s):
        acc = 0.0
        for s in stacks:
            y_top, y_base = fr.sy(acc + s.ys[i]), fr.sy(acc)
            body.append(
                f'<rect x="{fr.sx(t):.1f}" y="{y_top:.1f}" width="{width:.1f}" '
                f'height="{max(y_base - y_top, 0):.1f}" fill="{s.color}">'
                f"<title>t={fmt(t)} s · {escape(s.name)}: {fmt(s.ys[i])}</title></rect>"
            )
            acc += s.ys[i]
    return _svg(WIDTH, height, body, f"{y_label} over time")
