"""Arrival processes: when each request is meant to be sent, as offsets in seconds from the start.

Open-loop processes fix every intended send time in advance, independent of how the server copes,
so a slow server shows up as latency (measured from the intended time), not as fewer requests:
- Poisson at rate λ: exponential gaps with mean 1/λ (coefficient of variation 1).
- Gamma with burstiness B (as `vllm bench serve`): gaps ~ Gamma(shape=B, scale=1/(λ·B)); mean 1/λ,
  CV = 1/√B. B = 1 is Poisson, B < 1 burstier, B > 1 smoother.
- rate = inf: every request at offset 0.
- Trace replay: the offsets recorded in a JSONL file.
Closed loop (`--concurrency C`) has no schedule: a request is due when a worker is free.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np


@dataclass(slots=True)
class GammaArrivals:
    """Open-loop arrivals at `rate` req/s; `burstiness` 1.0 = Poisson. Seeded and reproducible."""

    rate: float
    burstiness: float = 1.0
    seed: int = 0

    def __post_init__(self):
        if not self.rate > 0:
            raise ValueError(f"rate must be > 0 (or inf), not {self.rate}")
        if not (self.burstiness > 0 and math.isfinite(self.burstiness)):
            raise ValueError(f"burstiness must be a positive number, not {self.burstiness}")

    @property
    def kind(self) -> str:
        return "poisson" if self.burstiness == 1.0 else "gamma"

    def offsets_s(self) -> Iterator[float]:
        """Intended send times in seconds from the start, endless (the runner bounds it)."""
        if math.isinf(self.rate):
            while True:
                yield 0.0
        rng = np.random.default_rng(self.seed)
        scale = 1.0 / (self.rate * self.burstiness)
        t = 0.0
        while True:
            for gap in rng.gamma(self.burstiness, scale, size=1024):
                yield t  # the first request goes at 0
                t += float(gap)

    def describe(self) -> dict:
        return {"process": self.kind, "rate": self.rate, "burstiness": self.burstiness, "seed": self.seed}


@dataclass(slots=True)
class TraceEntry:
    """One line of a replay trace: intended offset plus optional request shape."""

    offset_s: float
    input_len: int | None = None
    output_len: int | None = None
    prompt: str | None = None


@dataclass(slots=True)
class TraceArrivals:
    """Replay of a timestamped JSONL trace. Each line: `timestamp` (s) or `timestamp_ms`, and
    optionally `input_len`/`input_length`, `output_len`/`output_length`, `prompt`. Offsets are
    relative to the first line (absolute epoch stamps work too); lines must be in time order."""

    path: str
    entries: list[TraceEntry] = field(default_factory=list)

    def __post_init__(self):
        self.entries = load_trace(self.path)

    @property
    def kind(self) -> str:
        return "trace"

    def offsets_s(self) -> Iterator[float]:
        return (e.offset_s for e in self.entries)

    def describe(self) -> dict:
        return {"process": "trace", "path": self.path, "requests": len(self.entries)}


def load_trace(path: str) -> list[TraceEntry]:
    entries: list[TraceEntry] = []
    first: float | None = None
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                stamp = float(row["timestamp_ms"]) / 1e3 if "timestamp_ms" in row else float(row["timestamp"])
            except (ValueError, KeyError, TypeError) as exc:
                raise ValueError(
                    f"{path}:{lineno}: need a JSON object with `timestamp` (s) or `timestamp_ms` ({exc})"
                ) from None
            first = stamp if first is None else first
            if entries and stamp - first < entries[-1].offset_s:
                raise ValueError(f"{path}:{lineno}: timestamps go backwards")
            entries.append(
                TraceEntry(
                    offset_s=stamp - first,
                    input_len=_opt_int(row, "input_len", "input_length"),
                    output_len=_opt_int(row, "output_len", "output_length"),
                    prompt=row.get("prompt"),
                )
            )
    if not entries:
        raise ValueError(f"{path}: the trace holds no requests")
    return entries


def _opt_int(row: dict, *keys: str) -> int | None:
    for key in keys:
        if row.get(key) is not None:
            return int(row[key])
    return None


def coefficient_of_variation(offsets: list[float]) -> float:
    """std / mean of the gaps between consecutive offsets."""
    gaps = np.diff(np.asarray(offsets, dtype=float))
    return float(gaps.std() / gaps.mean())
