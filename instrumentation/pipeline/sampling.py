"""Which requests keep their full phase tree (docs/span-model.md#sampling).

Every request exports its compact record (the SERVER root, the CLIENT span: every term as an
attribute), so counts and percentiles cover every request whatever the sampler says. The full tree
(phase spans, step links, client events) is kept when

    full = head         the head sampler (OTEL_TRACES_SAMPLER/_ARG) sampled the trace;
         = tail_error   else when the request failed;
         = tail_slo     else when its TTFT or TPOT (ms, the emitter's own view) exceeds the tail
                        threshold (PHASELENS_TAIL_SLO, `ttft:MS,tpot:MS`; default the SLO; off: no threshold — a failed request keeps its tree all the same);
         = none         else: the compact record alone.

The head decision comes first, so the trees marked `head` stay an unbiased sample.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass

from opentelemetry.context import Context
from opentelemetry.sdk.trace.sampling import Decision, Sampler, SamplingResult, _get_from_env_or_default
from opentelemetry.trace import Link, NonRecordingSpan, Span, SpanContext, SpanKind, TraceFlags
from opentelemetry.trace.span import TraceState
from opentelemetry.util.types import Attributes

from phaselens.common.slo import goodput_slo
from phaselens.instrumentation import names

RATIO_SAMPLERS = ("traceidratio", "parentbased_traceidratio")
TAIL_OFF = "off"


def check_sampler_env() -> None:
    """A ratio sampler's OTEL_TRACES_SAMPLER_ARG must be a number in [0, 1] (the SDK would warn
    and trace everything): ValueError, to stop the process at start-up."""
    sampler = os.environ.get(names.ENV_TRACES_SAMPLER, "").strip().lower()
    arg = os.environ.get(names.ENV_TRACES_SAMPLER_ARG, "").strip()
    if sampler not in RATIO_SAMPLERS or not arg:
        return
    try:
        ratio = float(arg)
    except ValueError:
        ratio = -1.0
    if not 0.0 <= ratio <= 1.0:
        raise ValueError(
            f"{names.ENV_TRACES_SAMPLER_ARG}={arg!r}: {sampler} needs a sampling ratio, a number from 0 to 1"
        )


@dataclass(slots=True, frozen=True)
class TailRule:
    """Thresholds over which a request keeps its full tree (ms; None: not judged)."""

    ttft_ms: float | None = None
    tpot_ms: float | None = None

    @classmethod
    def from_env(cls) -> TailRule:
        """PHASELENS_TAIL_SLO (`slo.parse_slo` syntax, ttft and tpot; a key left out takes the
        default SLO's; `off`: no threshold, failures still kept); unset: the default SLO. ValueError when malformed."""
        text = os.environ.get(names.ENV_TAIL_SLO, "").strip()
        if text.lower() == TAIL_OFF:
            return cls()
        try:
            slo = goodput_slo(text or None)
        except ValueError as exc:
            raise ValueError(f"{names.ENV_TAIL_SLO}={text!r}: {exc} (or {TAIL_OFF})") from None
        return cls(slo.ttft_ms, slo.tpot_ms)

    def full(self, head: bool, failed: bool, ttft_ms: float | None, tpot_ms: float | None) -> str:
        """The request's `phaselens.trace.full` (module docstring)."""
        if head:
            return names.TRACE_FULL_HEAD
        if failed:
            return names.TRACE_FULL_TAIL_ERROR
        if _over(ttft_ms, self.ttft_ms) or _over(tpot_ms, self.tpot_ms):
            return names.TRACE_FULL_TAIL_SLO
        return names.TRACE_FULL_NONE


def _over(value_ms: float | None, threshold_ms: float | None) -> bool:
    return value_ms is not None and threshold_ms is not None and value_ms > threshold_ms


class CompactRecordSampler(Sampler):
    """`head`'s decision, recorded as `phaselens.trace.full` (head | none); every span is recorded and
    sampled, so a span the head sampler drops is still exported as its request's compact record.
    The caller propagates the head decision (`head_sampled`), not this sampled flag."""

    def __init__(self, head: Sampler) -> None:
        self.head = head

    def should_sample(
        self,
        parent_context: Context | None,
        trace_id: int,
        name: str,
        kind: SpanKind | None = None,
        attributes: Attributes = None,
        links: Sequence[Link] | None = None,
        trace_state: TraceState | None = None,
    ) -> SamplingResult:
        result = self.head.should_sample(parent_context, trace_id, name, kind, attributes, links, trace_state)
        sampled = result.decision.is_sampled()  # type: ignore[no-untyped-call]
        full = names.TRACE_FULL_HEAD if sampled else names.TRACE_FULL_NONE
        given = result.attributes if sampled else attributes  # a dropped span's result carries none
        merged = {**(given or {}), names.PL_TRACE_FULL: full}
        return SamplingResult(Decision.RECORD_AND_SAMPLE, merged, result.trace_state)

    def get_description(self) -> str:
        return f"CompactRecordSampler{{{self.head.get_description()}}}"


def head_sampled(span: Span) -> bool:
    """The head decision of a span started under a `CompactRecordSampler` (its attribute), else
    the span's own sampled flag (another sampler, or no SDK)."""
    full = (getattr(span, "attributes", None) or {}).get(names.PL_TRACE_FULL)
    return span.get_span_context().trace_flags.sampled if full is None else full == names.TRACE_FULL_HEAD


def propagated(span: Span) -> Span:
    """`span` as its downstream sees it (the traceparent to inject): the head decision's sampled
    flag, not the compact record's."""
    context = span.get_span_context()
    head = head_sampled(span)
    if head == context.trace_flags.sampled:
        return span
    flags = TraceFlags((context.trace_flags & ~TraceFlags.SAMPLED) | (TraceFlags.SAMPLED if head else 0))
    return NonRecordingSpan(
        SpanContext(context.trace_id, context.span_id, context.is_remote, flags, context.trace_state)
    )


def compact_env_sampler() -> CompactRecordSampler:
    """OTEL_TRACES_SAMPLER's sampler (checked: `check_sampler_env`) as a `CompactRecordSampler`."""
    check_sampler_env()
    return CompactRecordSampler(_get_from_env_or_default())


def check_sampling_env() -> None:
    """Both sampling variables (`check_sampler_env`, `TailRule.from_env`): ValueError saying which is
    wrong, for a command to refuse at start-up."""
    check_sampler_env()
    TailRule.from_env()
