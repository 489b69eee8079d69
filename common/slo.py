"""The SLO syntax every phaselens command takes: `ttft:MS,tpot:MS,e2el:MS` (each key at most once,
MS > 0). One parser, used directly by `phaselens bench --goodput|sweep --slo` (loadgen) and by
`phaselens budget|diagnose|report|demo --slo` (analysis, which takes ttft and tpot only and judges
against DEFAULT_SLO where no `--slo` is given, or against its keys where a key is left out)."""

from __future__ import annotations

from dataclasses import asdict, dataclass

SLO_KEYS = ("ttft", "tpot", "e2el")
GOODPUT_SLO_KEYS = ("ttft", "tpot")  # what the analysis's goodput judges
# The SLOs goodput is judged against when the user gives none (the dashboards' defaults too):
# interactive chat targets.
DEFAULT_TTFT_SLO_MS = 500.0
DEFAULT_TPOT_SLO_MS = 50.0


@dataclass(slots=True, frozen=True)
class SLO:
    """Latency objectives in ms; None = not set."""

    ttft_ms: float | None = None
    tpot_ms: float | None = None
    e2el_ms: float | None = None

    def describe(self) -> dict[str, float]:
        return {k: v for k, v in asdict(self).items() if v is not None}


def parse_slo(items: str | list[str], allowed: tuple[str, ...] = SLO_KEYS) -> SLO:
    """`"ttft:200,tpot:50"` or `["ttft:200", "tpot:50"]` → `SLO(ttft_ms=200.0, tpot_ms=50.0)`;
    an empty, malformed, unknown, repeated or non-positive entry raises ValueError."""
    spec = ", ".join(f"{k}:MS" for k in allowed)
    tokens = items.split(",") if isinstance(items, str) else [t for item in items for t in item.split(",")]
    values: dict[str, float] = {}
    for token in filter(None, (t.strip() for t in tokens)):
        key, _, ms = token.partition(":")
        try:
            value = float(ms)
        except ValueError:
            value = -1.0
        if key not in allowed or not value > 0 or key in values:
            raise ValueError(f"bad SLO {token!r}: use {spec} (each once, MS > 0)")
        values[key] = value
    if not values:
        raise ValueError(f"no SLO given: use {spec}")
    return SLO(**{f"{key}_ms": ms for key, ms in values.items()})


DEFAULT_SLO = SLO(ttft_ms=DEFAULT_TTFT_SLO_MS, tpot_ms=DEFAULT_TPOT_SLO_MS)


def goodput_slo(text: str | None) -> SLO:
    """The TTFT and TPOT SLOs of `--slo` text (parse_slo) with_defaults; None → DEFAULT_SLO. Raises
    ValueError as parse_slo."""
    return DEFAULT_SLO if text is None else with_defaults(parse_slo(text, GOODPUT_SLO_KEYS))


def with_defaults(slo: SLO) -> SLO:
    """`slo`'s TTFT and TPOT, each left out taking DEFAULT_SLO's."""
    return SLO(ttft_ms=slo.ttft_ms or DEFAULT_TTFT_SLO_MS, tpot_ms=slo.tpot_ms or DEFAULT_TPOT_SLO_MS)
