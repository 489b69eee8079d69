"""Which clock a nanosecond integer is on, as types mypy checks (docs/budget-method.md#the-clock-anchor).

- `MonoTs`     an instant on this process's monotonic clock (`time.monotonic_ns`, or the
               `perf_counter_ns` a client stamps with), ns since an arbitrary origin of that clock.
- `WallTs`     an instant on the wall clock, ns since the Unix epoch: only for placing spans on a timeline.

Names follow the types: an instant is `*_ts` (`*_wall_ts` where it is on the wall clock), a duration
`*_ns` / `*_ms`. Passing a `MonoTs` where a `WallTs` is expected is a type error. A duration stays a
plain `int`: subtracting two `MonoTs` gives one, and a duration type would cost a wrapper call at
every subtraction of the span pipeline for no check the names do not already give. NewTypes cost nothing once annotated, so the hot path keeps its bare
integers: a value gets its type from the clock that read it (`monotonic_ts`, …: the `time`
functions themselves, typed) or from the field it is read from, never from a wrapper call per stamp.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import NewType, cast

MonoTs = NewType("MonoTs", int)
WallTs = NewType("WallTs", int)

MonoClock = Callable[[], MonoTs]
WallClock = Callable[[], WallTs]

# the very functions of `time` (an `is` test against them still holds), typed with their clock
monotonic_ts = cast(MonoClock, time.monotonic_ns)
perf_counter_ts = cast(MonoClock, time.perf_counter_ns)
wall_clock_ts = cast(WallClock, time.time_ns)

# a stamp not taken yet: 0 (a monotonic clock has run far past it when a process starts)
NOT_STAMPED = MonoTs(0)
NOT_STAMPED_WALL = WallTs(0)
