"""The budget identities of phaselens.instrumentation.pipeline.phases hold exactly for any valid timeline."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from phaselens.instrumentation.hotpath.timeline import RequestTimeline
from phaselens.instrumentation.pipeline.phases import compute_phases, stall_ns
from tests.instrumentation_fixtures import ScriptedClock

gap = st.integers(min_value=0, max_value=10**9)


@st.composite
def timelines(draw) -> RequestTimeline:
    clock = ScriptedClock(now_ns=draw(st.integers(min_value=1, max_value=10**12)))
    timeline = RequestTimeline(clock)
    clock.advance(draw(gap))
    timeline.enqueued()
    clock.advance(draw(gap))
    timeline.scheduled()
    for _index in range(draw(st.integers(min_value=0, max_value=4))):
        start = clock.advance(draw(gap))
        timeline.prefill_chunk(start, clock.advance(draw(gap)), 8, 0)
        if draw(st.booleans()):  # preempted between chunks, before the first token
            clock.advance(draw(gap))
            timeline.preempted()
            clock.advance(draw(gap))
            timeline.scheduled()
    clock.advance(draw(gap))
    timeline.first_token()
    if draw(st.booleans()):  # streamed: the first content chunk's stamps (event loop, same clock)
        timeline.output_ready_ts = clock.advance(draw(gap))
        timeline.first_chunk_ts = timeline.last_chunk_ts = clock.advance(draw(gap))
        timeline.first_chunk_sent_ts = clock.advance(draw(gap))
    for _ in range(draw(st.integers(min_value=0, max_value=6))):
        if draw(st.booleans()):
            clock.advance(draw(gap))
            timeline.preempted()
            clock.advance(draw(gap))
            timeline.scheduled()
        clock.advance(draw(gap))
        timeline.token(draw(st.integers(min_value=1, max_value=3)))
    clock.advance(draw(gap))
    timeline.finished("stop")
    timeline.responded_ts = clock.advance(draw(gap))
    return timeline


@settings(max_examples=150, deadline=None)
@given(timelines())
def test_ttft_and_e2e_identities_hold_exactly(timeline):
    p = compute_phases(timeline)
    terms = (p.ingress_ns, p.queue_ns, p.prefill_ns, p.first_token_phase_ns, p.decode_ns, p.delivery_ns)
    assert all(term >= 0 for term in terms)
    assert p.ingress_ns + p.queue_ns + p.prefill_ns + p.first_token_phase_ns == p.ttft_ns
    assert p.ttft_ns + p.decode_ns + p.delivery_ns == p.e2e_ns
    assert sum(p.itl_ns) == p.decode_ns and p.decode_steps == len(p.itl_ns)
    if timeline.first_chunk_ts:
        assert p.loop_wait_ns + p.encode_ns == p.first_chunk_phase_ns
        assert min(p.loop_wait_ns, p.encode_ns, p.write_ns) >= 0
        assert p.ttft_ns + p.first_chunk_phase_ns == p.ttfc_ns
    else:
        assert p.first_chunk_phase_ns == p.ttfc_ns == 0


def test_stall_definition():
    gaps = [10, 10, 10, 10, 210, 40]  # p50 = 10 (linear: position 2.5 between two 10s)
    assert stall_ns(gaps) == (210 - 10) + (40 - 10)  # both gaps exceed 2 × p50
    assert stall_ns([10, 20]) == 0  # p50 = 15: no gap above 30
    assert stall_ns([]) == 0
