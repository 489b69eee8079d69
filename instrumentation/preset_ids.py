"""Starting a span with ids chosen elsewhere (the span-builder process, `builder="process"`).

The serving process decides a request's trace id, root span id and sampling before the root span
exists (its children and the engine-step links need them at once); the builder process must then
create the SERVER span with exactly those ids. The SDK has no API for that, but it asks the
provider's IdGenerator for the ids and its Sampler for the decision inside `start_span`. This
process owns its TracerProvider, so it installs a generator that hands out ids preset for the
calling thread just before `start_span`, and a sampler that samples such a preset span (the
decision was taken once, upstream; only sampled requests get a root span here) and defers to the
configured sampler for every other span (children: parent-based; engine steps: the root ratio).
"""

from __future__ import annotations

import threading
from typing import Any

from opentelemetry.context import Context
from opentelemetry.sdk.trace.id_generator import IdGenerator, RandomIdGenerator
from opentelemetry.sdk.trace.sampling import Decision, Sampler, SamplingResult
from opentelemetry.trace import Span, Tracer, get_current_span


class PresetIdGenerator(IdGenerator):
    """Random ids, except inside `start_span_with_ids` on the same thread."""

    def __init__(self) -> None:
        self._random = RandomIdGenerator()
        self._preset = threading.local()  # the builder and decoder threads both start spans

    def start_span_with_ids(self, tracer: Tracer, trace_id: int, span_id: int, **start_span: Any) -> Span:
        """`tracer.start_span(**start_span)` with these ids (the trace id is the parent's when there is
        a valid parent: the SDK does not ask for one then)."""
        preset = self._preset
        preset.trace_id, preset.span_id = trace_id, span_id
        try:
            return tracer.start_span(**start_span)
        finally:
            preset.trace_id = preset.span_id = 0

    def presetting(self) -> bool:
        return bool(getattr(self._preset, "span_id", 0))

    def generate_trace_id(self) -> int:
        return getattr(self._preset, "trace_id", 0) or self._random.generate_trace_id()

    def generate_span_id(self) -> int:
        span_id = getattr(self._preset, "span_id", 0)
        if not span_id:
            return self._random.generate_span_id()
        self._preset.span_id = 0  # the SDK asks once per span; children get random ids
        return span_id


class PresetSampler(Sampler):
    """RECORD_AND_SAMPLE for a preset span, `delegate` for the rest."""

    def __init__(self, delegate: Sampler, ids: PresetIdGenerator) -> None:
        self._delegate = delegate
        self._ids = ids

    def should_sample(self, parent_context: Context | None, trace_id: int, name: str, kind=None,
                      attributes=None, links=None, trace_state=None) -> SamplingResult:
        if not self._ids.presetting():
            return self._delegate.should_sample(parent_context, trace_id, name, kind, attributes, links,
                                                trace_state)
        parent = get_current_span(parent_context).get_span_context()
        return SamplingResult(Decision.RECORD_AND_SAMPLE, attributes,
                              parent.trace_state if parent.is_valid else None)

    def get_description(self) -> str:
        return f"PresetSampler{{{self._delegate.get_description()}}}"
