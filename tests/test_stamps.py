"""The timeline's per-token stamps (the C base `hotpath/_stamps.c`) against a reference: two lists."""

from __future__ import annotations

import gc
import time
from array import array

import pytest
from hypothesis import given
from hypothesis import strategies as st

from phaselens.instrumentation.hotpath._stamps import TimelineCore
from phaselens.instrumentation.hotpath.timeline import RequestTimeline
from phaselens.instrumentation.pipeline._token_gaps import token_gaps

STAMP = st.integers(min_value=0, max_value=2**63 - 1)
BAD = (2**63, -1, -(2**63) - 1, "1", 1.5, None)


@given(st.lists(st.tuples(st.booleans(), STAMP, STAMP), max_size=80))
def test_reads_as_two_int64_arrays(calls: list[tuple[bool, int, int]]) -> None:
    """Any mix of `token` (an injected clock) and `token_at`, past the buffer's first growths."""
    clock_values = iter([t for by_clock, t, _ in calls if by_clock])
    timeline = RequestTimeline(lambda: next(clock_values), received_ts=0)
    for by_clock, t, n in calls:
        if by_clock:
            timeline.token(n)
        else:
            timeline.token_at(t, n)
    stamps, counts = timeline.token_ts, timeline.token_n
    assert stamps.tolist() == [t for _, t, _ in calls] and counts.tolist() == [n for _, _, n in calls]
    assert stamps.format == counts.format == "q" and stamps.readonly and counts.readonly
    assert stamps.tobytes() == array("q", [t for _, t, _ in calls]).tobytes()
    if calls:
        assert (stamps[-1], counts[-1]) == calls[-1][1:]


def test_token_counts_one_by_default() -> None:
    ticks = iter([10, 20, 30])
    timeline = RequestTimeline(lambda: next(ticks))
    timeline.token()
    timeline.token(4)
    assert (timeline.received_ts, timeline.token_ts.tolist(), timeline.token_n.tolist()) == (10, [20, 30], [1, 4])


def test_bad_values_raise_and_store_nothing() -> None:
    timeline = RequestTimeline(lambda: 5)
    timeline.token(2)
    for bad in BAD:
        with pytest.raises((OverflowError, TypeError, ValueError)):
            timeline.token(bad)  # type: ignore[arg-type]
        with pytest.raises((OverflowError, TypeError, ValueError)):
            timeline.token_at(bad, 1)  # type: ignore[arg-type]
        with pytest.raises((OverflowError, TypeError, ValueError)):
            timeline.token_at(1, bad)  # type: ignore[arg-type]
        timeline.clock_ns = lambda bad=bad: bad
        with pytest.raises((OverflowError, TypeError, ValueError)):
            timeline.token()
    with pytest.raises(ValueError, match="negative"):
        timeline.token_at(-1, 1)
    with pytest.raises(TypeError):
        timeline.token(1, 2)  # type: ignore[call-arg]
    with pytest.raises(TypeError):
        timeline.token_at(1)  # type: ignore[call-arg]
    assert (timeline.token_ts.tolist(), timeline.token_n.tolist()) == ([5], [2])


def test_a_clock_that_raises_stores_nothing() -> None:
    def broken() -> int:
        raise RuntimeError("clock")

    timeline = RequestTimeline(lambda: 1)
    timeline.clock_ns = broken
    with pytest.raises(RuntimeError):
        timeline.token()
    assert len(timeline.token_ts) == len(timeline.token_n) == 0


def test_the_clock_must_be_callable() -> None:
    timeline = RequestTimeline()
    with pytest.raises(TypeError, match="callable"):
        timeline.clock_ns = 5  # type: ignore[assignment]
    with pytest.raises(TypeError, match="callable"):
        del timeline.clock_ns
    assert timeline.clock_ns is time.monotonic_ns


def test_the_base_takes_no_arguments_and_starts_on_the_monotonic_clock() -> None:
    with pytest.raises(TypeError):
        TimelineCore(1)  # type: ignore[call-arg]
    core = TimelineCore()
    assert core.clock_ns is time.monotonic_ns
    core.token_at(3, 1)
    assert core.token_ts.tolist() == [3]


def test_token_on_the_monotonic_clock_reads_that_clock() -> None:
    """The stamp read with clock_gettime lies between two time.monotonic_ns() reads."""
    timeline = RequestTimeline()
    before = time.monotonic_ns()
    timeline.token(2)
    after = time.monotonic_ns()
    assert before <= timeline.token_ts[-1] <= after
    assert timeline.token_n.tolist() == [2]


def test_the_copies_do_not_hold_the_buffer() -> None:
    """A reader's view (the shipper freezing a request the loop still stamps) never stops a token."""
    timeline = RequestTimeline(lambda: 7)
    timeline.token()
    held = timeline.token_ts
    for _ in range(40):  # past the first growth
        timeline.token()
    assert held.tolist() == [7] and len(timeline.token_ts) == 41


class Cyclic(RequestTimeline):
    __slots__ = ()


def test_a_cycle_through_the_clock_is_collected() -> None:
    """The clock a C method of the timeline itself: a builtin method has no tp_clear, so only the
    timeline's breaks the cycle."""
    timeline = Cyclic()
    timeline.clock_ns = timeline.token_at
    del timeline
    gc.collect()
    assert not [o for o in gc.get_objects() if type(o) is Cyclic]


@given(
    st.integers(min_value=1, max_value=10**12),
    st.lists(st.tuples(st.integers(1, 10**6), st.integers(1, 4)), max_size=60),
)
def test_token_gaps_read_the_stamps_as_arrays(first: int, steps: list[tuple[int, int]]) -> None:
    timeline, reference_ts, reference_n = RequestTimeline(lambda: 0), array("q"), array("q")
    t = first
    for gap, n in steps:
        t += gap
        timeline.token_at(t, n)
        reference_ts.append(t)
        reference_n.append(n)
    assert token_gaps(first, timeline.token_ts, timeline.token_n) == token_gaps(first, reference_ts, reference_n)
