"""How long and how hard each fault scenario runs (the suite's SHORT and FULL sets)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class Params:
    load_spans_per_s: float = 2000.0
    warm_s: float = 3.0  # load before the fault
    after_s: float = 3.0  # load after recovery
    outage_s: float = 30.0
    store_timeout_s: float = 60.0  # longest wait for acknowledged spans to be visible (Pipeline)
    slow_s: float = 10.0
    slow_delay_s: float = 0.2
    full_s: float = 6.0
    spool_cap_bytes: int = 512 << 10
    builder_kills: int = 3
    capacity_s: float = 4.0  # closed-loop measurement of the server's capacity before the overload
    overload_s: float = 5.0
    disconnects: int = 8
