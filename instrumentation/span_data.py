"""Records → span descriptions: what every span of a record is, as plain values, once for both backends.

`request_spans` and `step_span` say which spans a record makes (the tree in `spans`' docstring),
with their ids, times, attributes, events, links and status. Two backends turn the descriptions
into exported spans: `emitter.SpanEmitter` makes SDK ReadableSpans for a tracer provider's span
processors (a provider the user brought, with their sampling and exporters), and
`otlp_fast.FastEmitter` encodes OTLP protobuf bytes in C (`_otlp_encode`) for a provider phaselens
owns. An attribute added here (or in `spans`' attribute functions) reaches both with no other code.

Times are wall-clock ns (the process anchor's), ids ints, `kind` and `status_code` OTLP's numbers.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any, NamedTuple, overload

from opentelemetry.context import Context
from opentelemetry.sdk.trace.id_generator import IdGenerator
from opentelemetry.sdk.trace.sampling import Sampler
from opentelemetry.trace import Link, SpanContext, SpanKind, TraceFlags

from . import names
from .clock import ClockAnchor
from .ids import child_flags
from .phases import Phases
from .record import RequestRecord, StepRecord
from .spans import _prefill_attributes as prefill_attributes  # moves into spans with the rest (issue 25)
from .spans import decode_attributes, first_chunk_split, request_attributes
from .timeline import CHUNK_FIELDS

KIND_INTERNAL, KIND_SERVER = 1, 2  # OTLP Span.SpanKind
STATUS_UNSET, STATUS_ERROR = 0, 2  # OTLP Status.StatusCode (= the API's StatusCode values)

Event = tuple[str, int, dict[str, Any]]  # (name, time_ns, attributes)
LinkIds = tuple[int, int, int] | tuple[int, int, int, dict[str, Any]]  # (trace_id, span_id, flags[, attributes])


class SpanData(NamedTuple):
    """One finished span. Field order is the C encoder's (`_otlp_encode.c`, enum F_*)."""

    name: str
    kind: int
    trace_id: int
    span_id: int
    parent_id: int | None
    parent_remote: bool
    trace_flags: int
    trace_state: str  # W3C tracestate header form
    start_ns: int
    end_ns: int
    attributes: dict[str, Any]
    events: tuple[Event, ...] = ()
    links: tuple[LinkIds, ...] = ()
    status_code: int = STATUS_UNSET
    status_message: str | None = None


class _Tree:
    """The spans of one request's trace, collected in the order they would have ended."""

    __slots__ = ("anchor", "ids", "root", "spans")

    def __init__(self, ids: IdGenerator, anchor: ClockAnchor, root: RequestRecord) -> None:
        self.ids, self.anchor, self.root = ids, anchor, root.root
        self.spans: list[SpanData] = []

    def leaf(
        self,
        name: str,
        start_ns: int,
        end_ns: int,
        attributes: dict[str, Any] | None = None,
        parent_id: int | None = None,
        span_id: int | None = None,
        events: tuple[Event, ...] = (),
    ) -> None:
        """A child span (of the root unless `parent_id`), with the root's trace, flags and state."""
        root, to_wall = self.root, self.anchor.to_wall_ns
        self.spans.append(
            SpanData(
                name,
                KIND_INTERNAL,
                root.trace_id,
                span_id or self.ids.generate_span_id(),
                parent_id or root.span_id,
                False,
                root.trace_flags,
                root.trace_state,
                to_wall(start_ns),
                to_wall(end_ns),
                attributes or {},
                events,
            )
        )


def _chunk_spans(tree: _Tree, record: RequestRecord, phases: Phases, prefill: int | None, decode: int | None) -> None:
    """llm.prefill.chunk spans: initial chunks under llm.prefill (when more than one), recompute
    chunks after the first token under llm.decode."""
    chunks = record.chunks
    for index in range(len(chunks) // CHUNK_FIELDS):
        start, end, tokens, cached = chunks[index * CHUNK_FIELDS : (index + 1) * CHUNK_FIELDS]
        recompute = index >= phases.initial_chunks
        parent = decode if recompute else prefill
        if parent is None or (not recompute and phases.initial_chunks < 2):
            continue
        attributes = {
            names.PL_CHUNK_INDEX: index,
            names.PL_CHUNK_TOKENS: tokens,
            names.PL_CACHED_TOKENS: cached,
            names.PL_PREFILL_RECOMPUTE: recompute,
        }
        tree.leaf(names.SPAN_PREFILL_CHUNK, start, end, attributes, parent)


def _token_events(anchor: ClockAnchor, record: RequestRecord) -> tuple[Event, ...]:
    to_wall = anchor.to_wall_ns
    return tuple(
        (names.EVENT_TOKEN, to_wall(t_ns), {names.PL_TOKEN_COUNT: n})
        for t_ns, n in zip(record.token_ns, record.token_n, strict=False)
    )


def request_spans(
    ids: IdGenerator, anchor: ClockAnchor, record: RequestRecord, phases: Phases, token_events: bool
) -> list[SpanData]:
    """The spans of one sampled request: phase spans, then the SERVER span (docs/span-model.md)."""
    tree = _Tree(ids, anchor, record)
    # rejected before reaching the engine: the whole request was ingress
    tree.leaf(names.SPAN_INGRESS, phases.received_ns, phases.enqueued_ns or phases.end_ns)
    for index, (start, end) in enumerate(phases.waits):
        tree.leaf(names.SPAN_QUEUE, start, end, {names.PL_QUEUE_WAIT_INDEX: index})
    prefill = ids.generate_span_id() if phases.scheduled_ns else None
    decode = None
    if phases.first_token_ns:
        tree.leaf(names.SPAN_FIRST_TOKEN, phases.prefill_end_ns, phases.first_token_ns)
        if phases.first_chunk_ns:
            tree.leaf(names.SPAN_FIRST_CHUNK, phases.first_token_ns, phases.first_chunk_ns, first_chunk_split(phases))
        decode = ids.generate_span_id()
        tree.leaf(names.SPAN_DELIVERY, phases.last_token_ns, phases.end_ns)
    _chunk_spans(tree, record, phases, prefill, decode)
    if prefill is not None:
        attributes = prefill_attributes(record, phases)
        tree.leaf(names.SPAN_PREFILL, phases.scheduled_ns, phases.prefill_end_ns, attributes, span_id=prefill)
    if decode is not None:
        events = _token_events(anchor, record) if token_events else ()
        attributes = decode_attributes(phases)
        tree.leaf(names.SPAN_DECODE, phases.first_token_ns, phases.last_token_ns, attributes, None, decode, events)
    tree.spans.append(_root_span(anchor, record, phases))
    return tree.spans


def _root_span(anchor: ClockAnchor, record: RequestRecord, phases: Phases) -> SpanData:
    attributes = request_attributes(record, phases, anchor)
    info, root, parent = record.info, record.root, record.parent
    name = names.root_span_name(info.operation, info.model) if info is not None else record.http.method or "request"
    failure = attributes.get(names.ERROR_TYPE)
    return SpanData(
        name,
        KIND_SERVER,
        root.trace_id,
        root.span_id,
        parent.span_id if parent is not None else None,
        parent is not None,
        root.trace_flags,
        root.trace_state,
        anchor.to_wall_ns(phases.received_ns),
        anchor.to_wall_ns(phases.end_ns),
        attributes,
        status_code=STATUS_ERROR if failure else STATUS_UNSET,
        status_message=failure or None,
    )


class _SamplerLinks(Sequence[Link]):
    """A step's links as the sampler's `links` argument: SDK Links made only if it reads them (the
    SDK's own samplers do not; 64 Links would cost ~0.5 ms a step)."""

    __slots__ = ("_links",)

    def __init__(self, links: Sequence[tuple[int, int, int]]) -> None:
        self._links = links

    def __len__(self) -> int:
        return len(self._links)

    @overload
    def __getitem__(self, index: int) -> Link: ...
    @overload
    def __getitem__(self, index: slice) -> Sequence[Link]: ...
    def __getitem__(self, index: int | slice) -> Link | Sequence[Link]:
        if isinstance(index, slice):
            return [_link(ids) for ids in self._links[index]]
        return _link(self._links[index])

    def __iter__(self) -> Iterator[Link]:
        return (_link(ids) for ids in self._links)


def _link(ids: tuple[int, int, int]) -> Link:
    return Link(SpanContext(ids[0], ids[1], False, TraceFlags(ids[2])))


def step_span(ids: IdGenerator, sampler: Sampler, anchor: ClockAnchor, step: StepRecord) -> SpanData | None:
    """One llm.engine_step span in a trace of its own, linked to the batch's sampled SERVER spans;
    None when no member is sampled or the sampler does not record the step's trace."""
    links = step.sampled_links()
    if not links:
        return None
    attributes = {
        names.PL_STEP_INDEX: step.index,
        names.PL_STEP_NUM_SEQS: len(step.links),
        names.PL_STEP_PREFILL_TOKENS: step.prefill_tokens,
        names.PL_STEP_DECODE_TOKENS: step.decode_tokens,
        names.PL_STEP_KV_BLOCKS_USED: step.kv_blocks_used,
        names.PL_STEP_KV_BLOCKS_TOTAL: step.kv_blocks_total,
        names.PL_STEP_PREEMPTIONS: step.preemptions,
        names.PL_STEP_QUEUE_DEPTH: step.queue_depth,
        names.PL_STEP_DURATION_MS: (step.end_ns - step.start_ns) / 1e6,
    }
    trace_id = ids.generate_trace_id()
    result = sampler.should_sample(
        Context(), trace_id, names.SPAN_ENGINE_STEP, SpanKind.INTERNAL, attributes, _SamplerLinks(links)
    )
    if not result.decision.is_recording():
        return None
    return SpanData(
        names.SPAN_ENGINE_STEP,
        KIND_INTERNAL,
        trace_id,
        ids.generate_span_id(),
        None,
        False,
        child_flags(result.decision.is_sampled(), ids.is_trace_id_random()),
        result.trace_state.to_header() if result.trace_state is not None else "",
        anchor.to_wall_ns(step.start_ns),
        anchor.to_wall_ns(step.end_ns),
        dict(result.attributes) if result.attributes is not None else {},
        links=tuple(links),
    )
