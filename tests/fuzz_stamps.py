"""Random and broken calls on the timeline's per-token stamps (instrumentation/hotpath/_stamps.c),
meant to run under sanitizers (tests/test_collector_render_asan.py builds it so).

Each iteration makes one call on a timeline (the C base itself, or a slotted subclass as
`RequestTimeline` is), mirrored on two lists, its reference: a `token` (no count, a count that fits
or an odd one: negative, past int64, not an int) on the monotonic clock, on an injected clock (that
gives a stamp, an odd value or raises), a `token_at` of values that fit or odd ones, or a new clock
(callable or not); then the timeline's `token_ts` / `token_n` must read as the references. A call
that raises must store nothing. Every so often the timeline is dropped (sometimes in a cycle through
its clock, left to the collector) and a new one grows from empty. Prints one JSON object.
"""

from __future__ import annotations

import gc
import importlib
import json
import random
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.fuzz_render import arguments

MODULE = "phaselens.instrumentation.hotpath._stamps"
ODD = (None, 1.5, "x", b"", -1, -(2**63), 2**63, -(2**63) - 1, 2**128, (), [1], object())
REJECTED = (OverflowError, TypeError, ValueError, LookupError)


def _value(rng: random.Random) -> Any:
    if rng.random() < 0.2:
        return rng.choice(ODD)
    return rng.choice((0, 1, rng.randrange(2**31), rng.randrange(2**63), 2**63 - 1))


def _clock(rng: random.Random) -> Any:
    choice = rng.random()
    if choice < 0.4:
        return time.monotonic_ns
    if choice < 0.9:
        value = _value(rng)
        return lambda: value
    return {}.__getitem__  # raises KeyError: a clock that fails


def _call(rng: random.Random, timeline: Any, reference: tuple[list, list]) -> None:
    """One call, mirrored on the references when it does not raise."""
    choice = rng.random()
    if choice < 0.1:
        clock = _clock(rng) if rng.random() < 0.9 else rng.choice(ODD)
        timeline.clock_ns = clock
        assert timeline.clock_ns is clock
        return
    if choice < 0.4:
        t, n = _value(rng), _value(rng)
        timeline.token_at(t, n)
    else:
        n = _value(rng) if rng.random() < 0.7 else None
        before = time.monotonic_ns()
        timeline.token() if n is None else timeline.token(n)
        n = 1 if n is None else n
        t = timeline.token_ts[-1]
        if timeline.clock_ns is time.monotonic_ns:
            assert before <= t <= time.monotonic_ns()
        else:
            assert t == timeline.clock_ns()
    reference[0].append(t)
    reference[1].append(n)


def _fresh(rng: random.Random, module: Any, subclass: type, old: Any) -> Any:
    if rng.random() < 0.3:  # the old one left in a cycle through its clock: the collector's to free
        old.clock_ns = old.token  # a builtin method: no tp_clear of its own
    timeline = module.TimelineCore() if rng.random() < 0.5 else subclass()
    if rng.random() < 0.1:
        gc.collect()
    return timeline


def main() -> None:
    args = arguments(__doc__, MODULE, 20_000)
    module = importlib.import_module(MODULE)

    class Slotted(module.TimelineCore):  # as RequestTimeline: the C base under a slotted class
        __slots__ = ("received_ts",)

    rng, accepted = random.Random(args.seed), 0
    timeline, reference = Slotted(), ([], [])
    for _ in range(args.iterations):
        if rng.random() < 0.02:
            timeline, reference = _fresh(rng, module, Slotted, timeline), ([], [])
        try:
            _call(rng, timeline, reference)
            accepted += 1
        except REJECTED:
            pass
        stamps, counts = timeline.token_ts, timeline.token_n
        assert stamps.tolist() == reference[0] and counts.tolist() == reference[1]
        assert stamps.format == counts.format == "q" and stamps.readonly
    print(json.dumps({"iterations": args.iterations, "accepted": accepted, "module": module.__file__}))


if __name__ == "__main__":
    main()
