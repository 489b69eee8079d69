"""The budget identities of phaselens.instrumentation.pipeline.phases hold exactly for any valid timeline."""

from __future__ import annotations

import bisect
import random
import struct
from array import array

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from phaselens.common.quantile import quantile
from phaselens.instrumentation.hotpath.records import int64s
from phaselens.instrumentation.hotpath.timeline import RequestTimeline
from phaselens.instrumentation.pipeline._token_gaps import itl_ms, token_gaps
from phaselens.instrumentation.pipeline.phases import compute_phases
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
    late = draw(st.booleans())  # the first content came with a later token (held back) or the first
    if not late and draw(st.booleans()):  # streamed: the first content chunk's stamps (event loop, same clock)
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
    if late:
        timeline.visible_tokens = draw(st.integers(min_value=0, max_value=20))
        timeline.output_ready_ts = clock.advance(draw(gap))
        timeline.first_chunk_ts = timeline.last_chunk_ts = clock.advance(draw(gap))
        timeline.first_chunk_sent_ts = clock.advance(draw(gap))
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
    assert sum(p.itl_sorted_ns) == p.decode_ns and p.decode_steps == len(p.itl_sorted_ns)
    if timeline.first_chunk_ts:
        assert p.loop_wait_ns + p.encode_ns == p.first_chunk_phase_ns
        assert min(p.loop_wait_ns, p.encode_ns, p.write_ns, p.held_back_ns) >= 0
        assert p.ttft_ns + p.held_back_ns + p.first_chunk_phase_ns == p.ttfc_ns
    else:
        assert p.first_chunk_phase_ns == p.ttfc_ns == 0


def test_decode_steps_before_the_first_visible_text_are_held_back_not_loop_wait():
    """A byte-level first token (half of a UTF-8 character) renders no text: the content comes with
    the 3rd token, two decode steps later. Those steps are `held_back` (2 tokens); the event loop's
    lateness is measured from the step that made the text."""
    clock = ScriptedClock(now_ns=1_000)
    timeline = RequestTimeline(clock)
    timeline.enqueued()
    timeline.scheduled()
    clock.now_ns = 5_000
    timeline.first_token()
    for stamp in (15_000, 25_000, 35_000):
        clock.now_ns = stamp
        timeline.token()
    timeline.visible_tokens = 3  # the API layer: the first content came with the 3rd output token
    timeline.output_ready_ts, timeline.first_chunk_ts, timeline.first_chunk_sent_ts = 27_000, 27_500, 27_600
    timeline.last_chunk_ts = 27_500
    timeline.finished("stop")
    timeline.responded_ts = 40_000
    p = compute_phases(timeline)
    assert (p.held_back_ns, p.held_back_tokens, p.visible_ts) == (20_000, 2, 25_000)
    assert (p.loop_wait_ns, p.encode_ns, p.first_chunk_phase_ns) == (2_000, 500, 2_500)
    assert p.ttfc_ns == p.ttft_ns + p.held_back_ns + p.first_chunk_phase_ns
    timeline.visible_tokens = 1  # the first token rendered text: nothing held back
    p = compute_phases(timeline)
    assert (p.held_back_ns, p.held_back_tokens, p.loop_wait_ns) == (0, 0, 22_000)


def packed(values: list[int]) -> memoryview:
    return int64s(array("q", values).tobytes())


def reference_itl_ms(itl: list[int]) -> tuple[float, float, float, float]:
    """llm.decode's ITL figures as the Python before `itl_ms` computed them: `common.quantile`, then
    stall = Σ (g − p50) over the gaps g > 2·p50 (the module docstring), each / 1e6."""
    median = quantile(itl, 0.5) or 0
    stalls = itl[bisect.bisect_right(itl, 2 * median) :]
    stall = sum(stalls) - median * len(stalls) if itl else 0
    return median / 1e6, (quantile(itl, 0.99) or 0) / 1e6, (itl[-1] if itl else 0) / 1e6, stall / 1e6


def test_stall_definition():
    p50, _, _, stall = itl_ms(packed([10, 10, 10, 10, 40, 210]))  # p50 = 10 (linear: between two 10s)
    assert (p50, stall) == (10 / 1e6, ((210 - 10) + (40 - 10)) / 1e6)  # both gaps exceed 2 × p50
    assert itl_ms(packed([10, 20]))[3] == 0  # p50 = 15: no gap above 30
    assert itl_ms(packed([])) == (0.0, 0.0, 0.0, 0.0)


@given(
    st.one_of(
        st.lists(st.integers(-(2**63), 2**63 - 1), max_size=300),
        st.lists(st.integers(-3, 40), max_size=40),  # ties, zeros, half-int medians, gaps on 2·p50
        st.lists(st.integers(2**53 - 8, 2**53 + 8), max_size=9),  # ints a float cannot hold
    )
)
@settings(max_examples=500)
def test_itl_figures_are_the_python_formulas_bit_for_bit(gaps: list[int]) -> None:
    """Signed zeros included (`quantile(...) or 0` makes a -0.0 a 0): compared as bytes."""
    itl = sorted(gaps)
    assert struct.pack("<4d", *itl_ms(packed(itl))) == struct.pack("<4d", *reference_itl_ms(itl))


def test_itl_figures_refuse_a_buffer_that_is_not_int64s() -> None:
    with pytest.raises(ValueError, match="int64s"):
        itl_ms(b"\0" * 12)


@given(
    st.integers(min_value=0, max_value=10**15),
    st.lists(st.tuples(gap, st.integers(min_value=1, max_value=64)), max_size=300),
)
@settings(max_examples=200, deadline=None)
def test_token_gaps_are_the_sorted_stamp_differences_and_the_token_sum(first_ns, steps) -> None:
    """The C helper against the definition: gaps from the first token on, ascending; Σ token_n."""
    stamps, counts, now = array("q"), array("q"), first_ns
    for step_gap, tokens in steps:
        now += step_gap
        stamps.append(now)
        counts.append(tokens)
    tokens, packed = token_gaps(first_ns, stamps, counts)
    gaps = int64s(packed)
    expected = sorted(b - a for a, b in zip([first_ns, *stamps], stamps, strict=False))
    assert gaps.tolist() == expected and tokens == sum(counts)
    assert all(type(g) is int for g in gaps)


@given(st.integers(-(2**61), 2**61), st.lists(st.integers(-(2**61), 2**61), max_size=700))
@settings(max_examples=200, deadline=None)
def test_token_gaps_sort_any_int64_gaps(first_ns, stamps) -> None:
    """The radix sort on gaps of either sign and any width, past its stack scratch (512 values)."""
    _, packed = token_gaps(first_ns, array("q", stamps), array("q"))
    assert int64s(packed).tolist() == sorted(b - a for a, b in zip([first_ns, *stamps], stamps, strict=False))


def test_token_gaps_refuse_a_buffer_that_is_not_int64s() -> None:
    with pytest.raises(ValueError, match="int64"):
        token_gaps(0, b"\0" * 12, b"")


@pytest.mark.parametrize("n", [*range(0, 70), 127, 128, 129, 255, 256, 257, 300])
def test_token_gaps_sort_at_every_size_around_the_sorts_bounds(n) -> None:
    """Insertion (< 16), runs merged (≤ 256), radix (above): ties, both signs, any width."""
    rng = random.Random(n)
    stamps = array("q", [rng.choice((rng.randint(-50, 50), rng.randint(-(2**61), 2**61))) for _ in range(n)])
    _, packed = token_gaps(7, stamps, array("q"))
    assert int64s(packed).tolist() == sorted(b - a for a, b in zip([7, *stamps], stamps, strict=False))
