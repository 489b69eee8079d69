"""The SLO syntax every phaselens command takes: `ttft:MS,tpot:MS,e2el:MS` (each key at most once,
MS > 0). One parser, used by `phaselens bench --goodput` and by `phaselens budget|report|demo --slo`."""

from __future__ import annotations

SLO_KEYS = ("ttft", "tpot", "e2el")


def parse_slo_ms(items: str | list[str], allowed: tuple[str, ...] = SLO_KEYS) -> dict[str, float]:
    """`"ttft:200,tpot:50"` or `["ttft:200", "tpot:50"]` → `{"ttft": 200.0, "tpot": 50.0}`;
    a malformed, unknown, repeated or non-positive entry raises ValueError."""
    tokens = items.split(",") if isinstance(items, str) else [t for item in items for t in item.split(",")]
    values: dict[str, float] = {}
    for token in filter(None, (t.strip() for t in tokens)):
        key, _, ms = token.partition(":")
        try:
            value = float(ms)
        except ValueError:
            value = -1.0
        if key not in allowed or not value > 0 or key in values:
            spec = ", ".join(f"{k}:MS" for k in allowed)
            raise ValueError(f"bad SLO {token!r}: use {spec} (each once, MS > 0)")
        values[key] = value
    return values
