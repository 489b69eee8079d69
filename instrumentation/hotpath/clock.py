"""Monotonic → wall time through one anchor per process (docs/budget-method.md#the-clock-anchor).

Every duration phaselens reports is a difference of two monotonic stamps taken in one process. Wall
time is needed only to place spans on a timeline, and it is derived, never read per stamp:

    wall_ns = anchor_wall_ns + (mono_ns − anchor_mono_ns)

The anchor is read once, so an NTP step (or any wall-clock jump) after it cannot bend a duration:
two spans 5 ms apart on the monotonic clock are 5 ms apart on the exported timeline too.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from dataclasses import dataclass

ClockNs = Callable[[], int]


@dataclass(slots=True, frozen=True)
class ClockAnchor:
    """One (monotonic, wall) pair read back to back; converts monotonic ns to wall ns."""

    mono_ns: int
    wall_ns: int

    @classmethod
    def capture(cls, mono_ns: ClockNs = time.monotonic_ns, wall_ns: ClockNs = time.time_ns) -> ClockAnchor:
        return cls(mono_ns=mono_ns(), wall_ns=wall_ns())

    def to_wall_ns(self, mono_ns: int) -> int:
        """wall_ns = anchor_wall_ns + (mono_ns − anchor_mono_ns)."""
        return self.wall_ns + (mono_ns - self.mono_ns)


@functools.cache
def process_anchor() -> ClockAnchor:
    """The anchor of this process for `time.monotonic_ns`, read on first use and then fixed."""
    return ClockAnchor.capture()
