"""The timeline's per-token stamp log (`hotpath/_stamps.c`) against an int64 array, its reference."""

from __future__ import annotations

import time
from array import array

import pytest
from hypothesis import given
from hypothesis import strategies as st

from phaselens.instrumentation.hotpath._stamps import Int64Log
from phaselens.instrumentation.hotpath.records import int64s
from phaselens.instrumentation.hotpath.timeline import RequestTimeline
from phaselens.instrumentation.pipeline._token_gaps import token_gaps

INT64 = st.integers(min_value=-(2**63), max_value=2**63 - 1)


@given(st.lists(INT64, max_size=80))
def test_reads_as_an_int64_array_does(values: list[int]) -> None:
    log, reference = Int64Log(), array("q")
    for v in values:
        log.append(v)
        reference.append(v)
    assert len(log) == len(reference) and bool(log) == bool(reference)
    assert log.tolist() == reference.tolist() == list(log)
    assert log.tobytes() == reference.tobytes() == bytes(memoryview(log))
    assert int64s(log.tobytes()).tolist() == values
    if values:
        assert (log[0], log[-1], log[len(values) // 2]) == (values[0], values[-1], values[len(values) // 2])
    with pytest.raises(IndexError):
        log[len(values)]


def test_bad_values_raise_and_store_nothing() -> None:
    log = Int64Log()
    log.append(7)
    for bad in (2**63, -(2**63) - 1, "1", 1.5, None):
        with pytest.raises((OverflowError, TypeError)):
            log.append(bad)  # type: ignore[arg-type]
    assert log.tolist() == [7]


def test_no_append_while_a_view_is_held() -> None:
    log = Int64Log()
    log.append(1)
    view = memoryview(log)
    with pytest.raises(BufferError):
        log.append(2)
    assert view.tolist() == [1] and view.readonly and view.format == "q"
    view.release()
    log.append(2)
    assert log.tolist() == [1, 2]


def test_stamp_appends_the_clock_and_the_count_both_or_neither() -> None:
    ticks = iter([5, 9, "late"])
    stamps, counts = Int64Log(), Int64Log()
    stamps.stamp(counts, 1, lambda: next(ticks))
    stamps.stamp(counts, 3, lambda: next(ticks))
    with pytest.raises(TypeError):  # the clock gave no int
        stamps.stamp(counts, 1, lambda: next(ticks))
    with pytest.raises(OverflowError):
        stamps.stamp(counts, 2**63, time.monotonic_ns)
    with pytest.raises(TypeError):
        stamps.stamp(array("q"), 1, time.monotonic_ns)  # type: ignore[arg-type]
    assert (stamps.tolist(), counts.tolist()) == ([5, 9], [1, 3])


def test_token_on_the_monotonic_clock_reads_that_clock() -> None:
    """The stamp read with clock_gettime lies between two time.monotonic_ns() reads."""
    timeline = RequestTimeline()
    before = time.monotonic_ns()
    timeline.token(2)
    after = time.monotonic_ns()
    assert before <= timeline.token_ts[-1] <= after
    assert timeline.token_n.tolist() == [2]


@given(
    st.integers(min_value=1, max_value=10**12),
    st.lists(st.tuples(st.integers(1, 10**6), st.integers(1, 4)), max_size=60),
)
def test_token_gaps_read_the_log_as_an_array(first: int, steps: list[tuple[int, int]]) -> None:
    stamps, counts, reference_ts, reference_n = Int64Log(), Int64Log(), array("q"), array("q")
    t = first
    for gap, n in steps:
        t += gap
        stamps.stamp(counts, n, lambda t=t: t)
        reference_ts.append(t)
        reference_n.append(n)
    assert token_gaps(first, stamps, counts) == token_gaps(first, reference_ts, reference_n)
