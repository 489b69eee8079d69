"""The byte format between the serving process and the span-builder process (`builder="process"`).

A stream of frames, each `<u32 payload length><u8 kind><payload>`; the payload is a `marshal`ed tuple
of ints, strings, floats and bytes (the timeline arrays travel as `array('q').tobytes()`):

    HELLO    (service_name, anchor_mono_ns, anchor_wall_ns, token_events)       first frame, once
    REQUEST  (trace_id, span_id, sampled, parent, stamps…, arrays…, info, outcome, http)
    STEP     (index, start_ns, end_ns, 7 counts, links)  links = 24 bytes per sampled request
    FLUSH    (sequence,)   the child builds what it has, flushes its exporters and acks `sequence`

`parent` is the incoming remote span context (trace_id, span_id, flags, tracestate header) or None.
The child answers on its own pipe with one JSON line of counters per report (see span_process).
"""

from __future__ import annotations

import marshal
import struct
from typing import Any

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace import NonRecordingSpan, SpanContext, TraceFlags, TraceState

from .handle import HttpFacts, RequestHandle, RequestInfo, RequestOutcome
from .timeline import StepRecord

HEADER = struct.Struct("<IB")
KIND_HELLO, KIND_REQUEST, KIND_STEP, KIND_FLUSH = 1, 2, 3, 4
LINK_BYTES = 24  # 16-byte trace id + 8-byte span id, big-endian
_TIMELINE_ARRAYS = ("waits", "chunks", "token_ns", "token_n")


def frame(kind: int, fields: tuple) -> bytes:
    payload = marshal.dumps(fields)
    return HEADER.pack(len(payload), kind) + payload


def link_key(span_context: SpanContext) -> bytes:
    """How a sampled request is named in a STEP frame's links."""
    return span_context.trace_id.to_bytes(16, "big") + span_context.span_id.to_bytes(8, "big")


def _remote_parent(parent: Context | None) -> tuple | None:
    context = trace.get_current_span(parent).get_span_context() if parent is not None else None
    if context is None or not context.is_valid:
        return None
    return (context.trace_id, context.span_id, int(context.trace_flags), context.is_remote,
            context.trace_state.to_header())


def _fields(record: Any) -> tuple | None:
    return None if record is None else tuple(getattr(record, name) for name in type(record).__slots__)


def encode_request(handle: RequestHandle) -> bytes:
    ids = handle.span.get_span_context()
    return frame(KIND_REQUEST, (
        ids.trace_id, ids.span_id, handle.sampled, _remote_parent(handle.parent),
        handle.received_ns, handle.enqueued_ns, handle.first_token_ns, handle.finished_ns,
        handle.responded_ns, handle.finish_reason,
        *(getattr(handle, name).tobytes() for name in _TIMELINE_ARRAYS),
        _fields(handle.info), _fields(handle.outcome), _fields(handle.http)))


def encode_step(step: StepRecord) -> bytes | None:
    """None when no request of the batch is sampled (the step span would not be built)."""
    try:
        links = b"".join([h.link_key for h in step.requests])  # every member a shipped handle: 4x faster
    except AttributeError:  # a loop that also batches foreign observers
        links = b"".join(getattr(h, "link_key", b"") for h in step.requests)
    if not links:
        return None
    return frame(KIND_STEP, (step.index, step.start_ns, step.end_ns, step.prefill_tokens, step.decode_tokens,
                             step.kv_blocks_used, step.kv_blocks_total, step.preemptions, step.queue_depth,
                             len(step.requests), links))


def parent_context(parent: tuple | None) -> Context:
    """The incoming parent as a Context for `start_span` (empty when there was none)."""
    if parent is None:
        return Context()
    trace_id, span_id, flags, is_remote, trace_state = parent
    return trace.set_span_in_context(NonRecordingSpan(SpanContext(
        trace_id, span_id, is_remote, TraceFlags(flags), TraceState.from_header([trace_state]))), Context())


def decode_request(fields: tuple, start_root) -> RequestHandle:
    """A closed RequestHandle again; `start_root(trace_id, span_id, parent_context, method, received_ns)`
    starts its SERVER span (only called for sampled requests)."""
    (trace_id, span_id, sampled, parent, received_ns, enqueued_ns, first_token_ns, finished_ns, responded_ns,
     finish_reason, waits, chunks, token_ns, token_n, info, outcome, http) = fields
    facts = HttpFacts(*http)
    context = parent_context(parent)
    span = (start_root(trace_id, span_id, context, facts.method, received_ns) if sampled
            else trace.INVALID_SPAN)
    # capture_content: the serving process kept prompt/completion only when capture was on
    handle = RequestHandle(span, _closed_already, capture_content=True, parent=context,
                           received_ns=received_ns)
    handle.enqueued_ns, handle.first_token_ns, handle.finished_ns = enqueued_ns, first_token_ns, finished_ns
    handle.responded_ns, handle.finish_reason = responded_ns, finish_reason
    for name, raw in zip(_TIMELINE_ARRAYS, (waits, chunks, token_ns, token_n)):
        getattr(handle, name).frombytes(raw)
    handle.info = RequestInfo(*info) if info is not None else None
    handle.outcome, handle.http = RequestOutcome(*outcome), facts
    return handle


def _closed_already(handle: RequestHandle) -> None:
    """Decoded handles were closed in the serving process; nothing hands them on again."""


class LinkedRequest:
    """A sampled request named in a STEP frame: what `build_step_span` reads for a link."""

    __slots__ = ("span",)
    sampled = True

    def __init__(self, span_context: SpanContext) -> None:
        self.span = NonRecordingSpan(span_context)


def decode_step(fields: tuple) -> StepRecord:
    *counts, num_seqs, links = fields
    flags = TraceFlags(TraceFlags.SAMPLED)
    linked = tuple(LinkedRequest(SpanContext(int.from_bytes(links[i:i + 16], "big"),
                                             int.from_bytes(links[i + 16:i + LINK_BYTES], "big"), False, flags))
                   for i in range(0, len(links), LINK_BYTES))
    # the batch's unsampled members only count towards num_seqs: pad with unsampled stand-ins
    return StepRecord(*counts, requests=linked + (UNSAMPLED,) * (num_seqs - len(linked)))


class _Unsampled:
    __slots__ = ()
    sampled = False


UNSAMPLED = _Unsampled()
