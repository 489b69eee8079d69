"""The records the span pipeline carries: frozen plain data, no OpenTelemetry object inside.

A closed request becomes one `RequestRecord`, an engine iteration one `StepRecord`. Both cross a
process pipe as they are (`wire`), and one builder turns either into spans (`builder`). Ids are
ints as in OTel (128-bit trace id, 64-bit span id); trace flags an int (bit 0 sampled, bit 1
random trace id); trace state its W3C header string. Records are NamedTuples: immutable and
plain, and ~6x cheaper to make than frozen slotted dataclasses, whose __init__ goes through
object.__setattr__ per field (15 fields, measured here). Timelines are read-only int64 views over
bytes (`int64s`): they index, slice and sum like tuples of ints, but freezing one is a memcpy of
the loop's int64 `array` and the pipe carries it as those bytes (a tuple of 128 stamps costs ~4 µs
to make and ~6 µs to marshal: large ints, one object each). A step's links are 25-byte strings
(`pack_link`, made once per request at receipt and kept in its timeline's C struct) packed end to
end in one bytes by the loop (`timeline.StepRecorder`) for the same reason: one bytes marshals and
frees in a few instructions where 64 tuples of three ints took ~10 µs, and the OTLP encoder copies
its bytes as they are.
"""

from __future__ import annotations

import struct
from typing import Any, NamedTuple

from phaselens.common.clocks import NOT_STAMPED, MonoTs

Int64s = memoryview  # format "q", read-only

LINK = struct.Struct(">QQQB")  # a step link: trace id (high, low 64 bits), span id, trace flags; big-endian as OTLP
_LOW64 = (1 << 64) - 1


def int64s(raw: bytes) -> Int64s:
    """A read-only int64 view of `raw` (native byte order, as an int64 array's tobytes() writes it)."""
    return memoryview(raw).cast("q")


class SpanIds(NamedTuple):
    """A span context as plain values."""

    trace_id: int
    span_id: int
    trace_flags: int
    trace_state: str = ""  # W3C tracestate header form

    @property
    def sampled(self) -> bool:
        return bool(self.trace_flags & 1)


class RequestInfo(NamedTuple):
    """What `describe()` was told: GenAI request attributes."""

    operation: str
    model: str
    request_id: str | None = None
    input_tokens: int | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stream: bool | None = None
    prompt: Any = None  # str or chat messages; kept only when content capture is on


class RequestOutcome(NamedTuple):
    """What `complete()` or `fail()` was told."""

    output_tokens: int | None = None
    finish_reason: str | None = None
    cached_tokens: int = 0
    reasoning_tokens: int = 0
    completion: str | None = None  # kept only when content capture is on
    error_type: str | None = None
    status_code: int | None = None


class HttpFacts(NamedTuple):
    """What the ingress middleware saw of the HTTP exchange."""

    method: str = ""
    path: str = ""
    server_address: str | None = None
    server_port: int | None = None
    status_code: int | None = None
    client_disconnected: bool = False
    exception_type: str | None = None
    x_request_id: str | None = None  # the X-Request-ID header, cut at names.X_REQUEST_ID_MAX_CHARS


class KvStamps(NamedTuple):
    """A KV connector's work for the request on this server (a vLLM instance's connector, timed by
    `integrations/vllm/kv_connector.py`): per direction, its first call's start → last call's end
    (monotonic ns of this host), the time spent inside the calls (ns; a per-layer save interleaves
    with the forward pass, so this is less than end − start) and the bytes moved (None: not known)."""

    save_start_ts: MonoTs = NOT_STAMPED
    save_end_ts: MonoTs = NOT_STAMPED
    save_ns: int = 0
    save_bytes: int | None = None
    load_start_ts: MonoTs = NOT_STAMPED
    load_end_ts: MonoTs = NOT_STAMPED
    load_ns: int = 0
    load_bytes: int | None = None


NO_OUTCOME = RequestOutcome()
NO_HTTP = HttpFacts()


class RequestRecord(NamedTuple):
    """One closed request: the SERVER root's ids (chosen at receipt), the sampling decision, the
    remote parent (None: a root trace), the timeline (monotonic ns of the serving process; layout
    in `timeline`; the four stamps of the response's content chunks in `handle.ServerRequest`, the inbound
    edge's two in `inbound`), and
    what the API layer and the middleware reported; `kv` what a KV connector moved for it (None:
    nothing)."""

    root: SpanIds
    parent: SpanIds | None
    received_ts: MonoTs
    enqueued_ts: MonoTs
    first_token_ts: MonoTs
    finished_ts: MonoTs
    responded_ts: MonoTs
    output_ready_ts: MonoTs
    first_chunk_ts: MonoTs
    first_chunk_sent_ts: MonoTs
    last_chunk_ts: MonoTs
    arrived_ts: MonoTs
    read_ts: MonoTs
    visible_tokens: int
    finish_reason: str
    waits: Int64s
    chunks: Int64s
    token_ts: Int64s
    token_n: Int64s
    sends: Int64s
    info: RequestInfo | None
    outcome: RequestOutcome
    http: HttpFacts
    kv: KvStamps | None = None

    @property
    def sampled(self) -> bool:
        return self.root.sampled


class StepStats(NamedTuple):
    """What a serving loop reports of one engine iteration (`StepObserver.step`): its interval on the
    loop's clock and the batch's shape."""

    start_ts: MonoTs
    end_ts: MonoTs
    prefill_tokens: int = 0
    decode_tokens: int = 0
    kv_blocks_used: int = 0
    kv_blocks_total: int = 0
    preemptions: int = 0
    queue_depth: int = 0


def pack_link(ids: SpanIds) -> bytes:
    """A SERVER span's ids as a step links them (`LINK`, 25 bytes)."""
    return LINK.pack(ids.trace_id >> 64, ids.trace_id & _LOW64, ids.span_id, ids.trace_flags & 0xFF)


def unpack_link(link: bytes) -> tuple[int, int, int]:
    """(trace_id, span_id, trace_flags) of a packed link."""
    high, low, span_id, flags = LINK.unpack(link)
    return (high << 64) | low, span_id, flags


class StepRecord(NamedTuple):
    """One engine iteration, as the loop reported it: its stats, its batch size `num_seqs`, and
    `links`, the SERVER span ids of the members that are sampled and ours packed end to end
    (`pack_link`, `LINK.size` bytes each; empty: nothing to link, no span). The builder takes it
    as it is, from the thread sink or the span-builder process's pipe (`spans.PackedStep`)."""

    step_index: int
    start_ts: MonoTs
    end_ts: MonoTs
    prefill_tokens: int
    decode_tokens: int
    kv_blocks_used: int
    kv_blocks_total: int
    preemptions: int
    queue_depth: int
    num_seqs: int
    links: bytes


Record = RequestRecord | StepRecord
