"""Monotonic → wall time through one anchor per process (docs/budget-method.md#the-clock-anchor).

Every duration phaselens reports is a difference of two monotonic stamps taken in one process. Wall
time is needed only to place spans on a timeline, and it is derived, never read per stamp:

    wall_ts = anchor.wall_ts + (mono_ts − anchor.mono_ts)        (all ns)

The anchor is read once, so an NTP step (or any wall-clock jump) after it cannot bend a duration:
two spans 5 ms apart on the monotonic clock are 5 ms apart on the exported timeline too. The types
(`phaselens.common.clocks`) keep the two clocks apart: `to_wall_ts` takes a `MonoTs` only.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from phaselens.common.clocks import MonoClock, MonoTs, WallClock, WallTs, monotonic_ts, wall_clock_ts


@dataclass(slots=True, frozen=True)
class ClockAnchor:
    """One (monotonic, wall) pair read back to back; converts a monotonic instant to a wall one."""

    mono_ts: MonoTs
    wall_ts: WallTs

    @classmethod
    def capture(cls, mono_clock: MonoClock = monotonic_ts, wall_clock: WallClock = wall_clock_ts) -> ClockAnchor:
        return cls(mono_ts=mono_clock(), wall_ts=wall_clock())

    def to_wall_ts(self, mono_ts: MonoTs) -> WallTs:
        """wall_ts = anchor.wall_ts + (mono_ts − anchor.mono_ts)."""
        return WallTs(self.wall_ts + (mono_ts - self.mono_ts))

    def to_mono_ts(self, wall_ts: WallTs) -> MonoTs:
        """mono_ts = anchor.mono_ts + (wall_ts − anchor.wall_ts): a wall stamp another component took."""
        return MonoTs(self.mono_ts + (wall_ts - self.wall_ts))

    @property
    def wall_offset_ns(self) -> int:
        """wall_ts − mono_ts for every instant (ns): the formula as one addition, for loops over stamps."""
        return self.wall_ts - self.mono_ts


@functools.cache
def process_anchor() -> ClockAnchor:
    """The anchor of this process for `time.monotonic_ns`, read on first use and then fixed."""
    return ClockAnchor.capture()
