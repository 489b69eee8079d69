"""The serving loop's records in C (`hotpath/_stamps.c`) against their definitions: a timeline's
per-token stamps against two lists, its content-chunk stamps against their Python definition, a
step's packed links against each member's `link`."""

from __future__ import annotations

import gc
import time
from array import array

import pytest
from hypothesis import given
from hypothesis import strategies as st

from phaselens.instrumentation import names
from phaselens.instrumentation.hotpath._stamps import FIRST_SENDS_MAX, StepRecorderCore, TimelineCore
from phaselens.instrumentation.hotpath.observer import NULL_REQUEST
from phaselens.instrumentation.hotpath.records import LINK, SpanIds, StepRecord, StepStats, pack_link, unpack_link
from phaselens.instrumentation.hotpath.timeline import RequestTimeline, StepRecorder
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


# --- an engine step's record: its members' links packed (StepRecorder) ---------------------------


class Foreign:
    """A loop's own batch member: linked when its `link` is a packed link, else only counted."""

    __slots__ = ("link",)

    def __init__(self, link: object) -> None:
        self.link = link


class Bare:
    __slots__ = ()


def linked_timeline(link: bytes | None) -> RequestTimeline:
    timeline = RequestTimeline(lambda: 0)
    timeline.link = link
    return timeline


LINKS = st.binary(min_size=LINK.size, max_size=LINK.size)
MEMBERS = st.one_of(
    st.builds(linked_timeline, st.none() | LINKS),
    st.just(NULL_REQUEST),
    st.builds(Foreign, st.one_of(st.none(), LINKS, st.binary(max_size=30), st.integers(), st.text(max_size=3))),
    st.builds(Bare),
)
STATS = st.builds(StepStats, *[st.integers(-(2**70), 2**70)] * 8)


def expected_links(members: list[object]) -> bytes:
    """The definition: each member's `link`, where it is a packed link, in batch order."""
    links = [getattr(member, "link", None) for member in members]
    return b"".join(link for link in links if isinstance(link, bytes) and len(link) == LINK.size)


@given(st.lists(st.tuples(STATS, st.lists(MEMBERS, max_size=70)), max_size=4))
def test_a_step_packs_its_members_links(steps: list[tuple[StepStats, list[object]]]) -> None:
    records: list[StepRecord] = []
    recorder = StepRecorder(records.append)
    for stats, members in steps:
        recorder.step(stats, members)
    assert [type(r) for r in records] == [StepRecord] * len(steps)
    assert records == [
        StepRecord(index, *stats, len(members), expected_links(members)) for index, (stats, members) in enumerate(steps)
    ]


def test_a_timelines_link_is_a_packed_link_or_none() -> None:
    ids = SpanIds(2**127 + 3, 2**63 + 5, 1)
    timeline = linked_timeline(pack_link(ids))
    assert timeline.link == pack_link(ids) and unpack_link(timeline.link) == (ids.trace_id, ids.span_id, 1)
    for bad in (b"x" * (LINK.size - 1), b"x" * (LINK.size + 1), "x" * LINK.size, bytearray(LINK.size), 0):
        with pytest.raises(TypeError, match="packed link"):
            timeline.link = bad  # type: ignore[assignment]
    with pytest.raises(TypeError):
        del timeline.link
    assert timeline.link == pack_link(ids)
    timeline.link = None
    assert timeline.link is None and RequestTimeline().link is None


def test_a_bad_step_raises_and_submits_nothing() -> None:
    class Raising:
        @property
        def link(self) -> bytes:
            raise RuntimeError("link")

    records: list[StepRecord] = []
    recorder = StepRecorder(records.append)
    stats = StepStats(1, 2)
    with pytest.raises(TypeError, match="StepStats"):
        recorder.step((1, 2), [])  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="sequence"):
        recorder.step(stats, 5)  # type: ignore[arg-type]
    with pytest.raises(RuntimeError):
        recorder.step(stats, [linked_timeline(b"l" * LINK.size), Raising()])
    with pytest.raises(TypeError):
        recorder.step(stats)  # type: ignore[call-arg]
    assert records == []
    recorder.step(stats, (linked_timeline(b"l" * LINK.size),))  # any sequence: a tuple too
    assert records == [StepRecord(0, *stats, 1, b"l" * LINK.size)]


def test_a_member_that_empties_the_batch_while_read() -> None:
    """A loop's own member whose `link` changes the list being read: the members read before stay,
    the count is the batch's size when the step was given, and nothing is read past the list."""
    members: list[object] = []

    class Clearing:
        @property
        def link(self) -> None:
            members.clear()

    members += [linked_timeline(b"a" * LINK.size), Clearing(), linked_timeline(b"b" * LINK.size)]
    records: list[StepRecord] = []
    StepRecorder(records.append).step(StepStats(1, 2), members)
    assert (records[0].num_seqs, records[0].links) == (3, b"a" * LINK.size)


def test_the_recorder_takes_a_callable_and_a_record_type() -> None:
    with pytest.raises(TypeError):
        StepRecorderCore(5, StepRecord)  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        StepRecorderCore(print, dict)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="not initialised"):
        StepRecorderCore.__new__(StepRecorderCore).step(StepStats(1, 2), [])
    recorder = StepRecorder(print)
    with pytest.raises(TypeError, match="callable"):
        recorder.submit = None  # type: ignore[assignment]
    assert recorder.submit is print


class ContentChunks:
    """The content-chunk stamps' definition (handle.ServerRequest's, as Python wrote them before they
    moved to the C base): the model the C methods are held to."""

    def __init__(self, clock) -> None:
        self.clock = clock
        self.output_ready_ts = self.first_chunk_ts = self.first_chunk_sent_ts = self.last_chunk_ts = 0
        self.visible_tokens = self.body_bytes = 0
        self.output_pending = False
        self.sends: list[int] = []

    def output_ready(self, output_tokens: int = 0) -> None:
        if not self.output_ready_ts:
            self.output_ready_ts = self.clock()
            self.visible_tokens = output_tokens
        self.output_pending = True

    def body_sending(self, nbytes: int, carries_output: bool = False) -> None:
        t = 0
        if carries_output:
            t = self.clock()
            if not self.first_chunk_ts:
                self.first_chunk_ts = t
            self.last_chunk_ts = t
        self.body_bytes += nbytes
        if nbytes and self.first_chunk_ts and len(self.sends) < 2 * names.FIRST_SENDS_MAX:
            self.sends += [t or self.clock(), self.body_bytes]

    def chunk_sent(self) -> None:
        if not self.first_chunk_sent_ts:
            self.first_chunk_sent_ts = self.clock()
        self.output_pending = False


CONTENT_CALLS = st.one_of(
    st.tuples(st.just("output_ready"), st.integers(0, 99)),
    st.tuples(st.just("body_sending"), st.integers(0, 4096), st.booleans()),
    st.tuples(st.just("chunk_sent")),
)
CONTENT_FIELDS = ("output_ready_ts", "first_chunk_ts", "first_chunk_sent_ts", "last_chunk_ts", "visible_tokens")


@given(st.lists(CONTENT_CALLS, max_size=120))
def test_content_chunk_stamps_follow_their_definition(calls: list[tuple]) -> None:
    """Any sequence of the API layer's and the middleware's calls, past FIRST_SENDS_MAX sends, on a
    clock that ticks at every read: the same stamps, counts and sends as the definition."""
    ticks, model_ticks = iter(range(1_000, 10**9, 7)), iter(range(1_000, 10**9, 7))
    timeline, model = RequestTimeline(lambda: next(ticks), received_ts=1), ContentChunks(lambda: next(model_ticks))
    for name, *args in calls:
        getattr(timeline, name)(*args)
        getattr(model, name)(*args)
        assert timeline.output_pending is model.output_pending
    for field in (*CONTENT_FIELDS, "body_bytes"):
        assert getattr(timeline, field) == getattr(model, field), field
    assert timeline.sends.tolist() == model.sends
    assert timeline.sends.format == "q" and timeline.sends.readonly


def test_the_sends_bound_is_the_names_one() -> None:
    assert FIRST_SENDS_MAX == names.FIRST_SENDS_MAX


def test_content_chunk_writers_refuse_bad_arguments_and_a_raising_clock_stamps_nothing() -> None:
    timeline = RequestTimeline(lambda: 5)
    for bad in BAD:
        with pytest.raises((OverflowError, TypeError, ValueError)):
            timeline.output_ready(bad)  # type: ignore[arg-type]
        with pytest.raises((OverflowError, TypeError, ValueError)):
            timeline.body_sending(bad, True)  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        timeline.body_sending()  # type: ignore[call-arg]
    with pytest.raises(TypeError):
        timeline.output_pending = 1  # type: ignore[assignment]

    def broken() -> int:
        raise RuntimeError("clock")

    timeline.clock_ns = broken
    for call in (timeline.output_ready, lambda: timeline.body_sending(3, True), timeline.chunk_sent):
        with pytest.raises(RuntimeError):
            call()
    assert [getattr(timeline, f) for f in CONTENT_FIELDS] == [0] * len(CONTENT_FIELDS)
    assert not timeline.output_pending and timeline.sends.tolist() == []
