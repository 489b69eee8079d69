"""Span ids and the one sampling decision per request, taken at receipt.

The serving process decides a request's trace id, SERVER span id and sampling when it is received
(its children and the engine-step links need them at once), with the tracer provider's own sampler
and id generator, as the SDK's `Tracer.start_span` would (same trace flags: sampled, and the W3C
random-trace-id bit). No span is started: the builder emits the SERVER span later with these ids.
`SpanIds` (plain values) and `SpanContext` (OTel) convert here, and only here.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from opentelemetry.context import Context
from opentelemetry.sdk.trace.id_generator import IdGenerator, RandomIdGenerator
from opentelemetry.sdk.trace.sampling import (
    ALWAYS_OFF,
    ALWAYS_ON,
    Decision,
    ParentBased,
    Sampler,
    TraceIdRatioBased,
    _get_from_env_or_default,
)
from opentelemetry.trace import SpanContext, SpanKind, TraceFlags, TraceState, get_current_span

from phaselens.instrumentation.hotpath.records import SpanIds

SAMPLED_DECISIONS = (Decision.RECORD_AND_SAMPLE,)  # the SDK's Decision.is_sampled(), typed

UNSAMPLED_ROOT = SpanIds(0, 0, TraceFlags.DEFAULT)  # tracing off: invalid ids, nothing is built


def state_header(state: TraceState | None) -> str:
    """A tracestate as it is sent on ("" for none): `to_header()`, except for the usual empty one,
    whose generator and join cost ~1 µs a call on the event loop for ""."""
    return state.to_header() if state else ""


def span_ids(context: SpanContext) -> SpanIds:
    return SpanIds(context.trace_id, context.span_id, int(context.trace_flags), state_header(context.trace_state))


def span_context(ids: SpanIds, is_remote: bool = False) -> SpanContext:
    state = TraceState.from_header([ids.trace_state]) if ids.trace_state else TraceState()
    return SpanContext(ids.trace_id, ids.span_id, is_remote, TraceFlags(ids.trace_flags), state)


def child_flags(sampled: bool, random_trace_id: bool) -> int:
    """Trace flags as the SDK sets them: SAMPLED per the decision, RANDOM_TRACE_ID when the trace
    id came from a random generator (or the parent said so)."""
    return (TraceFlags.SAMPLED if sampled else 0) | (TraceFlags.RANDOM_TRACE_ID if random_trace_id else 0)


def parent_based_rule(sampler: Sampler | None) -> Callable[[int], bool] | None:
    """The SDK's parent-based sampler as a rule, where its decision needs no call: `ParentBased`
    (its `should_sample` not overridden) with the default delegates for a remote parent (ALWAYS_ON
    when it is sampled, ALWAYS_OFF when not) and a root of ALWAYS_ON, ALWAYS_OFF or an exact
    `TraceIdRatioBased` (the OTEL_TRACES_SAMPLER choices `parentbased_always_on`, `_always_off`,
    `_traceidratio`). With a valid remote parent the decision is its sampled flag and the trace
    state its own; without one, the rule's (trace id → sampled) and no trace state: what
    `should_sample` returns, without its ~30k instructions a request (SamplingResult, the parent's
    span read three times). None for any other sampler: asked each time."""
    if not isinstance(sampler, ParentBased) or type(sampler).should_sample is not ParentBased.should_sample:
        return None
    delegates = (getattr(sampler, "_remote_parent_sampled", None), getattr(sampler, "_remote_parent_not_sampled", None))
    if delegates != (ALWAYS_ON, ALWAYS_OFF):
        return None
    root = getattr(sampler, "_root", None)
    if root is ALWAYS_ON or root is ALWAYS_OFF:
        sampled = root is ALWAYS_ON
        return lambda trace_id: sampled
    if type(root) is TraceIdRatioBased:
        limit, bound = TraceIdRatioBased.TRACE_ID_LIMIT, root.bound
        return lambda trace_id: trace_id & limit < bound
    return None


class RootDecider:
    """Sampling decision and root ids for a request, without starting a span. `sampler=None`: no
    SDK to emit spans to, so every request is unsampled."""

    def __init__(self, sampler: Sampler | None, ids: IdGenerator) -> None:
        self._sampler = sampler
        self._ids = ids
        self._rule = parent_based_rule(sampler)

    @classmethod
    def of_provider(cls, tracer_provider: Any) -> RootDecider:
        """An SDK provider's sampler and id generator (public attributes); for another provider the
        OTEL_TRACES_SAMPLER sampler and random ids."""
        return cls(
            getattr(tracer_provider, "sampler", None) or _get_from_env_or_default(),
            getattr(tracer_provider, "id_generator", None) or RandomIdGenerator(),
        )

    def decide(self, parent: Context, name: str) -> tuple[SpanIds, SpanIds | None]:
        """(the SERVER span's ids, the remote parent's or None)."""
        remote = get_current_span(parent).get_span_context()
        valid = remote.is_valid
        if self._sampler is None:
            return UNSAMPLED_ROOT, span_ids(remote) if valid else None
        trace_id = remote.trace_id if valid else self._ids.generate_trace_id()
        rule = self._rule
        if rule is not None and valid and remote.is_remote:
            sampled, state = remote.trace_flags.sampled, state_header(remote.trace_state)
        elif rule is not None and not valid:
            sampled, state = rule(trace_id), ""
        else:
            result = self._sampler.should_sample(parent, trace_id, name, SpanKind.SERVER)
            sampled, state = result.decision in SAMPLED_DECISIONS, state_header(result.trace_state)
        random_trace_id = remote.trace_flags.random_trace_id if valid else self._ids.is_trace_id_random()
        root = SpanIds(trace_id, self._ids.generate_span_id(), child_flags(sampled, random_trace_id), state)
        return root, span_ids(remote) if valid else None
