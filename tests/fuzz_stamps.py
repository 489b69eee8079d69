"""Random and broken calls on the serving loop's C records (instrumentation/hotpath/_stamps.c), meant
to run under sanitizers (tests/test_collector_render_asan.py builds it so).

Each iteration makes one call on a timeline (the C base itself, or a slotted subclass as
`RequestTimeline` is), mirrored on two lists, its reference: a `token` (no count, a count that fits
or an odd one: negative, past int64, not an int) on the monotonic clock, on an injected clock (that
gives a stamp, an odd value or raises), a `token_at` of values that fit or odd ones, a new clock
(callable or not) or a new link (a packed one, None or odd); then the timeline's `token_ts` /
`token_n` must read as the references. A call that raises must store nothing. Every so often the
timeline is dropped (sometimes in a cycle through its clock, left to the collector) and a new one
grows from empty. Between calls, an engine step over the timelines kept so far and odd members (no
`link`, an odd one, one that raises or empties the batch), with stats that fit or not, must submit
the record of the definition (each member's `link` where it is a packed link) or raise and submit
nothing. Prints one JSON object.
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
LINK_BYTES = 25  # records.LINK


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
    if choice < 0.15:
        link = _link(rng)
        timeline.link = link
        assert timeline.link == link
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


class _Member:
    """A loop's own batch member, its `link` any value, or a `link` that raises or empties the batch."""

    def __init__(self, link: Any, batch: list) -> None:
        self._link, self._batch = link, batch

    @property
    def link(self) -> Any:
        if self._link == "raise":
            raise KeyError("link")
        if self._link == "clear":
            self._batch.clear()
            return None
        return self._link


def _link(rng: random.Random) -> Any:
    return rng.choice((None, rng.randbytes(LINK_BYTES), rng.randbytes(LINK_BYTES - 1), 7, "x" * LINK_BYTES))


def _step(rng: random.Random, recorder: Any, submitted: list, timelines: list, index: int) -> bool:
    """One step (the recorder's `index`-th) over some of the timelines and odd members; True when
    it was recorded."""
    batch = rng.sample(timelines, rng.randrange(len(timelines) + 1))
    for _ in range(rng.randrange(3)):
        batch.insert(rng.randrange(len(batch) + 1), _Member(rng.choice((_link(rng), "raise", "clear")), batch))
    stats = tuple(_value(rng) for _ in range(8 if rng.random() < 0.9 else rng.randrange(10)))
    members, before = list(batch), len(submitted)
    try:
        recorder.step(stats, batch)
    except REJECTED:
        assert len(submitted) == before
        return False
    read = []  # the members read before any that emptied the batch
    for member in members:
        read.append(member.link)
        if type(member) is _Member and member._link == "clear":
            break
    links = b"".join(x for x in read if isinstance(x, bytes) and len(x) == LINK_BYTES)
    assert submitted[-1] == (index, *stats, len(members), links) and len(submitted) == before + 1
    return True


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
    from phaselens.instrumentation.hotpath.records import StepRecord

    class Slotted(module.TimelineCore):  # as RequestTimeline: the C base under a slotted class
        __slots__ = ("received_ts",)

    rng, accepted, steps, submitted = random.Random(args.seed), 0, 0, []
    recorder = module.StepRecorderCore(submitted.append, StepRecord)
    timeline, reference, kept = Slotted(), ([], []), []
    for _ in range(args.iterations):
        if rng.random() < 0.02:
            kept = [*kept[-7:], timeline]  # a batch's members: the last few timelines
            timeline, reference = _fresh(rng, module, Slotted, timeline), ([], [])
        try:
            _call(rng, timeline, reference)
            accepted += 1
        except REJECTED:
            pass
        stamps, counts = timeline.token_ts, timeline.token_n
        assert stamps.tolist() == reference[0] and counts.tolist() == reference[1]
        assert stamps.format == counts.format == "q" and stamps.readonly
        if rng.random() < 0.2:
            steps += _step(rng, recorder, submitted, [*kept, timeline], steps)
            del submitted[:-1]
    assert steps > 0
    print(json.dumps({"iterations": args.iterations, "accepted": accepted, "module": module.__file__}))


if __name__ == "__main__":
    main()
