"""`compute_phases` in C (`_token_gaps.phase_terms`) against the Python it replaced, field for field,
on valid timelines and on any stamps at all (unstamped phases, open waits, out-of-order and
missing stamps, chunks and tokens past the first token, the inbound edge)."""

from __future__ import annotations

import dataclasses
from array import array
from types import SimpleNamespace
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from phaselens.instrumentation.hotpath.records import int64s
from phaselens.instrumentation.hotpath.timeline import CHUNK_FIELDS
from phaselens.instrumentation.pipeline._token_gaps import phase_terms, token_gaps
from phaselens.instrumentation.pipeline.phases import NO_GAPS, Phases, compute_phases
from tests.test_instrumentation_phases import timelines


def _overlap_ns(waits: list[tuple[int, int]], start: int, end: int) -> int:
    return sum(max(0, min(b, end) - max(a, start)) for a, b in waits)


def reference_phases(t: Any) -> Phases:
    """The terms as the Python before `phase_terms` computed them (the module docstring's steps)."""
    waits, tokens, chunks = t.waits.tolist(), t.token_ts, t.chunks
    end = max(t.responded_ts, t.received_ts, t.enqueued_ts, t.first_token_ts, t.finished_ts,
              waits[-1] if waits else 0, tokens[-1] if tokens else 0,
              chunks[len(chunks) - CHUNK_FIELDS + 1] if chunks else 0)  # fmt: skip
    p = Phases(received_ts=t.received_ts, end_ts=end, enqueued_ts=t.enqueued_ts)
    pairs = iter([*waits, max(end, waits[-1])] if len(waits) % 2 else waits)
    p.waits = list(zip(pairs, pairs, strict=True))
    if 0 < t.read_ts <= t.received_ts:
        p.read_ts, p.dispatch_ns = t.read_ts, t.received_ts - t.read_ts
        if 0 < t.arrived_ts <= t.read_ts:
            p.arrived_ts, p.kernel_wait_ns = t.arrived_ts, t.read_ts - t.arrived_ts
    if not p.enqueued_ts:
        return p
    p.ingress_ns = p.enqueued_ts - p.received_ts
    ft = p.first_token_ts = t.first_token_ts
    horizon = ft or end
    p.queue_ns = _overlap_ns(p.waits, p.enqueued_ts, horizon)
    if len(waits) < 2:
        return p
    p.scheduled_ts = waits[1]
    ends = [e for e in chunks[1::CHUNK_FIELDS] if e <= horizon]
    p.initial_chunks, p.prefill_end_ts = len(ends), max([p.scheduled_ts, *ends])
    p.prefill_ns = p.prefill_end_ts - p.scheduled_ts - _overlap_ns(p.waits, p.scheduled_ts, p.prefill_end_ts)
    if not ft:
        return p
    p.first_token_phase_ns = ft - p.prefill_end_ts - _overlap_ns(p.waits, p.prefill_end_ts, ft)
    p.last_token_ts = tokens[-1] if tokens else ft
    p.decode_ns, p.delivery_ns = p.last_token_ts - ft, max(0, end - p.last_token_ts)
    p.decode_tokens, gaps = token_gaps(ft, tokens, t.token_n)
    p.itl_sorted_ns, p.decode_steps = int64s(gaps), len(tokens)
    ready, first, sent = t.output_ready_ts, t.first_chunk_ts, t.first_chunk_sent_ts
    if ft <= ready <= first <= sent:
        p.first_chunk_ts, p.last_chunk_ts = first, t.last_chunk_ts
        visible, count = ft, 1
        if t.visible_tokens > 1:
            for stamp, n in zip(tokens, t.token_n, strict=False):
                count += n
                if count >= t.visible_tokens and stamp <= ready:
                    visible, p.held_back_tokens = stamp, t.visible_tokens - 1
                    break
        p.held_back_known = t.visible_tokens > 0
        p.visible_ts, p.held_back_ns = visible, visible - ft
        p.loop_wait_ns, p.encode_ns, p.write_ns = ready - visible, first - ready, sent - first
        p.first_chunk_phase_ns = first - visible
    return p


def fields(p: Phases) -> dict[str, Any]:
    """Every field, with its type (a bool stays a bool), the gaps as their int64s."""
    values = {f.name: getattr(p, f.name) for f in dataclasses.fields(p)}
    values["itl_sorted_ns"] = (values["itl_sorted_ns"].format, values["itl_sorted_ns"].tolist())
    return {name: (type(v).__name__, v) for name, v in values.items()}


@settings(max_examples=300, deadline=None)
@given(timelines())
def test_phases_of_valid_timelines_are_the_pythons(timeline) -> None:
    assert fields(compute_phases(timeline)) == fields(reference_phases(timeline))


stamp = st.one_of(st.just(0), st.integers(1, 60))
STAMPS = ("received_ts", "enqueued_ts", "first_token_ts", "finished_ts", "responded_ts", "output_ready_ts",
          "first_chunk_ts", "first_chunk_sent_ts", "last_chunk_ts", "arrived_ts", "read_ts")  # fmt: skip


@st.composite
def any_stamps(draw) -> SimpleNamespace:
    """Stamps in a small range (so they tie, cross and fall inside waits), each possibly unstamped."""
    values: dict[str, Any] = {name: draw(stamp) for name in STAMPS}
    values["visible_tokens"] = draw(st.integers(0, 6))
    steps = draw(st.integers(0, 8))
    values["waits"] = array("q", draw(st.lists(st.integers(1, 60), max_size=7)))
    values["chunks"] = array("q", draw(st.lists(st.integers(0, 60), max_size=3 * CHUNK_FIELDS)))
    values["chunks"] = values["chunks"][: len(values["chunks"]) // CHUNK_FIELDS * CHUNK_FIELDS]
    values["token_ts"] = array("q", draw(st.lists(st.integers(1, 60), min_size=steps, max_size=steps)))
    values["token_n"] = array("q", draw(st.lists(st.integers(1, 3), min_size=steps, max_size=steps)))
    return SimpleNamespace(**values)


@settings(max_examples=1500, deadline=None)
@given(any_stamps())
def test_phases_of_any_stamps_are_the_pythons(timeline) -> None:
    assert fields(compute_phases(timeline)) == fields(reference_phases(timeline))


def test_phases_without_a_first_token_have_no_gaps() -> None:
    """An unstarted request: every term 0, the empty gaps, the waits it had (an open one closed)."""
    timeline = SimpleNamespace(**dict.fromkeys(STAMPS, 0), visible_tokens=0, chunks=array("q"),
                               token_ts=array("q"), token_n=array("q"), waits=array("q", [7]))  # fmt: skip
    timeline.received_ts, timeline.enqueued_ts = 5, 6
    p = compute_phases(timeline)
    assert (p.end_ts, p.waits, p.ingress_ns, p.queue_ns, p.scheduled_ts) == (7, [(7, 7)], 1, 0, 0)
    assert p.itl_sorted_ns.tolist() == NO_GAPS.tolist() == [] and p.first_token_ts == 0


def test_phase_terms_refuse_stamps_that_are_not_int64s() -> None:
    timeline = SimpleNamespace(**dict.fromkeys(STAMPS, 1), visible_tokens=0, chunks=b"\0" * 12,
                               token_ts=array("q"), token_n=array("q"), waits=array("q"))  # fmt: skip
    with pytest.raises(ValueError, match="int64"):
        phase_terms(timeline)
    del timeline.received_ts
    with pytest.raises(AttributeError):
        phase_terms(timeline)


@settings(max_examples=300, deadline=None)
@given(any_stamps())
def test_phases_set_at_their_slots_equal_the_ones_phases_init_makes(timeline) -> None:
    """compute_phases' Phases, its fields set at the slots' offsets, is the one `Phases(*terms)` makes."""
    made = Phases(*phase_terms(timeline))
    assert fields(phase_terms(timeline, Phases)) == fields(made) and phase_terms(timeline, Phases) == made


def test_phase_terms_refuse_a_type_without_the_fields_as_slots() -> None:
    timeline = SimpleNamespace(**dict.fromkeys(STAMPS, 0), visible_tokens=0, chunks=array("q"),
                               token_ts=array("q"), token_n=array("q"), waits=array("q"))  # fmt: skip
    for odd in (tuple, SimpleNamespace, type("Slotted", (), {"__slots__": ("a",)})):
        with pytest.raises(TypeError, match="a slotted class of the 32 fields"):
            phase_terms(timeline, odd)
    with pytest.raises(TypeError, match=r"phase_terms\(timeline\[, type\]\)"):
        phase_terms(timeline, 1)
