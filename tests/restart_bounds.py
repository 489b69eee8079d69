"""How long a restart may take: a ratio to a cold start of the same part in the same run. The
machine's load slows a cold start and a restart alike, so the bound holds on a loaded machine and
still catches a restart that waits (out a minute of TIME_WAIT, for a replay before serving)."""

from __future__ import annotations

import time
from typing import Protocol


class Part(Protocol):
    def start_serving(self) -> object: ...

    def stop(self) -> object: ...


def restart_bound_s(cold_start_s: float, floor_s: float) -> float:
    """A restart is "at once" when it takes no longer than `floor_s` or 3 cold starts of the same
    run, whichever is more."""
    return max(floor_s, 3 * cold_start_s)


def cold_start_s(part: Part) -> float:
    """Seconds `part` takes from spawn to serving (`start_serving()`); it is stopped afterwards."""
    started = time.monotonic()
    part.start_serving()
    elapsed_s = time.monotonic() - started
    part.stop()
    return elapsed_s
