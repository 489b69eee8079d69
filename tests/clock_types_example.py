"""Type-checked by tests/test_clock_names.py (mypy), never imported: mixing the clocks is a type error.

A line ending in `# error: CODE` must get exactly that mypy error; every other line none."""

from phaselens.common.clocks import MonoTs, WallTs, monotonic_ts, wall_clock_ts
from phaselens.instrumentation.hotpath.clock import ClockAnchor

anchor = ClockAnchor.capture()
mono: MonoTs = monotonic_ts()
wall: WallTs = anchor.to_wall_ts(mono)
back: MonoTs = anchor.to_mono_ts(wall_clock_ts())
duration_ns: int = mono - back  # two instants of one clock: a plain int (ns)

anchor.to_wall_ts(wall)  # error: arg-type
anchor.to_mono_ts(mono)  # error: arg-type
placed: WallTs = mono  # error: assignment
stamped: MonoTs = 12  # error: assignment
ClockAnchor(mono_ts=wall, wall_ts=wall)  # error: arg-type
