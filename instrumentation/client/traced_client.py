"""Traced streaming client for OpenAI-compatible `/v1/completions` and `/v1/chat/completions`.

One `stream()` call = one CLIENT span `{gen_ai.operation.name} {model}`, started when the request
is sent, carrying a W3C `traceparent` (global propagator) so the server span becomes its child.
Every stamp is `time.perf_counter_ns()` of this process; wall time only places the span, through
one anchor (`phaselens.instrumentation.hotpath.clock`). Formulas (docs/budget-method.md#formulas), all on the client's monotonic clock:

    content chunk  = a chunk whose delta carries non-empty text: `text` (completions),
                     `content`, `reasoning_content`, `reasoning` or `tool_calls` (chat).
                     A role-only or empty chunk is not content.
    TTFT   = first content chunk − sent          (reasoning text counts: the model produced output)
    TTFO   = first non-reasoning content chunk − sent   (= TTFT for non-reasoning models)
    e2e    = last content chunk − sent
    read, end_read = first, last content chunk − the kernel's receive stamp of its bytes (the
             client's own lateness at either end of the stream; left out when not stamped)
    TPOT   = (e2e − TTFT) / (output_tokens − 1), output_tokens from `usage` when the server sent
             it, else the counted tokens; undefined for output_tokens ≤ 1
    ITL    = gaps between consecutive content chunks; per-token ITL = gap / k, k = tokens in the
             later chunk (1 per content chunk unless the server's cumulative per-chunk usage or a
             `token_counter` says otherwise)
    usage_mismatch = usage output_tokens − counted tokens

Errors (non-200, an error event mid-stream, malformed SSE, timeout, connection refused) end the
span with status ERROR and `error.type` and come back in `StreamResult`: `stream()` does not raise
them. A cancellation of the caller's task is recorded the same way (`error.type=cancelled`) and then
re-raised, as asyncio requires: an outer `asyncio.timeout` or task group still works.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import ssl
from collections.abc import AsyncIterator, Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Self
from urllib.parse import urlsplit

import httpx
import orjson
from opentelemetry import metrics, propagate, trace
from opentelemetry.trace import SpanKind, Status, StatusCode
from opentelemetry.util.types import AttributeValue

from phaselens.common.clocks import NOT_STAMPED, NOT_STAMPED_WALL, MonoClock, MonoTs, WallTs, perf_counter_ts
from phaselens.common.env import env_flag
from phaselens.common.quantile import quantile
from phaselens.instrumentation import names as N
from phaselens.instrumentation.client.sse import DONE, SSEError, SSEParser
from phaselens.instrumentation.client.transport import RECEIPTS, StreamingTransport
from phaselens.instrumentation.hotpath.clock import ClockAnchor
from phaselens.instrumentation.pipeline.sampling import TailRule, head_sampled, propagated

ENDPOINT_PATHS = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}
OPERATIONS = {"completions": N.OP_TEXT_COMPLETION, "chat": N.OP_CHAT}
ERROR_TIMEOUT = "timeout"
ERROR_CONNECTION = "connection_error"
ERROR_CANCELLED = "cancelled"
ERROR_MALFORMED_SSE = "malformed_sse"
ERROR_MALFORMED_CHUNK = "malformed_chunk"
ERROR_STREAM = "stream_error"
ERROR_TRUNCATED = "truncated_stream"
_MAX_ERROR_BODY = 64 * 1024
_REQUEST_ATTRS = (
    ("max_tokens", N.GEN_AI_REQUEST_MAX_TOKENS),
    ("max_completion_tokens", N.GEN_AI_REQUEST_MAX_TOKENS),
    ("temperature", N.GEN_AI_REQUEST_TEMPERATURE),
    ("top_p", N.GEN_AI_REQUEST_TOP_P),
    ("top_k", N.GEN_AI_REQUEST_TOP_K),
    ("seed", N.GEN_AI_REQUEST_SEED),
)


class StreamFailure(Exception):
    """Internal: ends a stream with an `error.type` (never leaves `stream()`)."""

    def __init__(self, error_type: str, message: str):
        super().__init__(message)
        self.error_type = error_type


@dataclass(slots=True)
class StreamResult:
    """One streamed request as the client saw it. Stamps: `perf_counter_ns` of this process."""

    endpoint: str
    model: str
    intended_ts: MonoTs | None = None
    sent_ts: MonoTs = NOT_STAMPED
    first_event_ts: MonoTs | None = None  # first SSE event of any kind (role-only included)
    first_chunk_ts: MonoTs | None = None  # first content chunk (TTFT)
    first_chunk_arrived_ts: MonoTs = NOT_STAMPED  # the kernel's receive stamp of its bytes (0: not observed)
    # later events came in the same read as the first content chunk: TCP merged their packets while
    # the client was late and stamped the read with the newest one, so `read_ms` understates the wait
    read_coalesced: bool = False
    # the response body bytes received through the newest byte of that read (0: not observed); with
    # the server's stamped sends it estimates the client's wait that TCP hid (`client_late_est_ms`)
    read_body_bytes: int = 0
    written_ts: MonoTs = NOT_STAMPED  # the request's first bytes handed to the transport (0: not observed)
    connect_ns: int = 0  # the network's part of the new connection's connect it waited for (its handshake)
    first_output_ts: MonoTs | None = None  # first non-reasoning content chunk (TTFO)
    last_chunk_ts: MonoTs | None = None  # last content chunk (e2e)
    last_chunk_arrived_ts: MonoTs = NOT_STAMPED  # the kernel's receive stamp of its bytes (0: not observed)
    done_ts: MonoTs = NOT_STAMPED  # response closed (or failure seen)
    sent_wall_ts: WallTs = NOT_STAMPED_WALL
    done_wall_ts: WallTs = NOT_STAMPED_WALL
    chunk_ts: list[MonoTs] = field(default_factory=list)  # arrival of each content chunk
    chunk_tokens: list[int] = field(default_factory=list)  # tokens carried by each content chunk
    chunk_text: list[str] = field(default_factory=list)  # only with keep_text or content capture
    events: int = 0  # SSE data events, [DONE] excluded
    status: int = 0  # HTTP status; 0 when no response arrived
    error_type: str | None = None
    error: str | None = None
    ttft_ms: float | None = None
    read_ms: float | None = None  # first content bytes in this host's kernel → this client read them
    end_read_ms: float | None = None  # the same for the last content bytes (the stream's end)
    send_ms: float | None = None  # sent → the request's bytes handed to the kernel, less the handshake
    ttfo_ms: float | None = None
    tpot_ms: float | None = None
    e2e_ms: float | None = None
    itl_ms: list[float] = field(default_factory=list)
    itl_per_token_ms: list[float] = field(default_factory=list)
    schedule_lag_ms: float | None = None  # sent − intended
    input_tokens: int | None = None  # from usage
    output_tokens: int | None = None  # from usage
    reasoning_tokens: int | None = None
    cached_tokens: int | None = None
    counted_tokens: int = 0
    usage_mismatch: int | None = None  # usage output_tokens − counted_tokens
    response_id: str | None = None
    response_model: str | None = None
    finish_reasons: list[str] = field(default_factory=list)
    saw_done: bool = False
    trace_id: str = ""
    span_id: str = ""

    @property
    def ok(self) -> bool:
        return self.error_type is None

    @property
    def no_output(self) -> bool:
        """Completed without a content chunk (the first token was EOS, or text that decodes to
        nothing): a success with no TTFT, counted apart rather than dropped from the figures."""
        return self.ok and self.first_chunk_ts is None

    @property
    def output_tokens_used(self) -> int:
        """The output token count the formulas use: `usage` when present, else counted."""
        return self.output_tokens if self.output_tokens is not None else self.counted_tokens

    @property
    def elapsed_ms(self) -> float:
        """done − sent: how long the request took, failed or not."""
        return (self.done_ts - self.sent_ts) / 1e6


def _read_ms(sent_ts: MonoTs, arrived_ts: MonoTs, read_ts: MonoTs) -> float | None:
    """read − the kernel's receive stamp of those bytes (ms): the client's own lateness reading them;
    None when the stamp is not within [sent, read] (not observed)."""
    return (read_ts - arrived_ts) / 1e6 if sent_ts <= arrived_ts <= read_ts else None


def compute_metrics(result: StreamResult) -> None:
    """Fill the derived figures of `result` from its stamps (formulas in the module docstring)."""
    sent = result.sent_ts
    if result.intended_ts is not None:
        result.schedule_lag_ms = (sent - result.intended_ts) / 1e6
    if result.first_chunk_ts is not None and result.last_chunk_ts is not None:  # set together
        result.ttft_ms = (result.first_chunk_ts - sent) / 1e6
        result.read_ms = _read_ms(sent, result.first_chunk_arrived_ts, result.first_chunk_ts)
        if sent + result.connect_ns <= result.written_ts <= result.first_chunk_ts:
            result.send_ms = (result.written_ts - sent - result.connect_ns) / 1e6
        result.e2e_ms = (result.last_chunk_ts - sent) / 1e6
        result.end_read_ms = _read_ms(sent, result.last_chunk_arrived_ts, result.last_chunk_ts)
    if result.first_output_ts is not None:
        result.ttfo_ms = (result.first_output_ts - sent) / 1e6
    times, tokens = result.chunk_ts, result.chunk_tokens
    result.itl_ms = [(b - a) / 1e6 for a, b in itertools.pairwise(times)]
    result.itl_per_token_ms = [gap / max(k, 1) for gap, k in zip(result.itl_ms, tokens[1:], strict=False)]
    result.counted_tokens = sum(tokens)
    if result.output_tokens is not None:
        result.usage_mismatch = result.output_tokens - result.counted_tokens
    n = result.output_tokens_used
    if result.ttft_ms is not None and result.e2e_ms is not None and n > 1:  # set together
        result.tpot_ms = (result.e2e_ms - result.ttft_ms) / (n - 1)


def _delta_texts(choice: dict[str, Any]) -> tuple[str, str]:
    """(output text, reasoning text) of one choice of a completions or chat chunk."""
    if "text" in choice:
        return choice.get("text") or "", ""
    delta = choice.get("delta") or {}
    output = delta.get("content") or ""
    if delta.get("tool_calls"):
        output += json.dumps(delta["tool_calls"])
    reasoning = delta.get("reasoning_content") or delta.get("reasoning") or ""
    return output, reasoning


@dataclass(slots=True)
class _ChunkReader:
    """Turns the SSE events of one response into stamps and counts on a `StreamResult`."""

    result: StreamResult
    token_counter: Callable[[str], int] | None
    keep_text: bool  # record each content chunk's text (content capture or `keep_text`)
    counted: int = 0  # tokens in the content chunks so far
    arrived_ts: MonoTs = NOT_STAMPED  # the kernel's receive stamp of the network read being parsed (0: none)

    def on_event(self, data: str, event: str, now_ts: MonoTs) -> None:
        res = self.result
        if data == DONE:
            res.saw_done = True
            return
        try:
            obj = orjson.loads(data)
        except ValueError:
            raise StreamFailure(ERROR_MALFORMED_CHUNK, f"chunk is not JSON: {data[:120]!r}") from None
        if event == "error" or not isinstance(obj, dict) or obj.get("error") or obj.get("object") == "error":
            raise StreamFailure(*_error_of(obj, ERROR_STREAM))
        res.events += 1
        if res.first_event_ts is None:
            res.first_event_ts = now_ts
        res.response_id = res.response_id or obj.get("id")  # every chunk repeats it: keep the first
        res.response_model = res.response_model or obj.get("model")
        self._on_choices(obj.get("choices") or (), obj.get("usage"), now_ts)

    def _on_choices(self, choices: Iterable[dict[str, Any]], usage: dict[str, Any] | None, now_ts: MonoTs) -> None:
        res = self.result
        output, reasoning = "", ""
        for choice in choices:
            out, rsn = _delta_texts(choice)
            output, reasoning = output + out, reasoning + rsn
            if choice.get("finish_reason"):
                res.finish_reasons.append(choice["finish_reason"])
        if output or reasoning:
            self._on_content(output, reasoning, usage, now_ts)
        if usage:  # the last one seen wins: cumulative (vLLM continuous usage) or final
            self._on_usage(usage)

    def _on_content(self, output: str, reasoning: str, usage: dict[str, Any] | None, now_ts: MonoTs) -> None:
        res = self.result
        if usage and usage.get("completion_tokens") is not None:  # the server counts: take its delta
            k = max(usage["completion_tokens"] - self.counted, 1)
        elif self.token_counter is not None:
            k = self.token_counter(reasoning + output)
        else:
            k = 1
        res.chunk_ts.append(now_ts)
        res.chunk_tokens.append(k)
        self.counted += k
        if res.first_chunk_ts is None:
            res.first_chunk_ts, res.first_chunk_arrived_ts = now_ts, self.arrived_ts
        if output and res.first_output_ts is None:
            res.first_output_ts = now_ts
        res.last_chunk_ts, res.last_chunk_arrived_ts = now_ts, self.arrived_ts
        if self.keep_text:
            res.chunk_text.append(reasoning + output)

    def _on_usage(self, usage: dict[str, Any]) -> None:
        res = self.result
        res.input_tokens = usage.get("prompt_tokens", res.input_tokens)
        res.output_tokens = usage.get("completion_tokens", res.output_tokens)
        details = usage.get("completion_tokens_details") or {}
        res.reasoning_tokens = details.get("reasoning_tokens", res.reasoning_tokens)
        cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
        res.cached_tokens = cached if cached is not None else res.cached_tokens


def _error_of(obj: object, default_type: str) -> tuple[str, str]:
    """(error.type, message) from an OpenAI (`{"error": {...}}`) or vLLM (`{"object": "error"}`) body."""
    err = obj.get("error", obj) if isinstance(obj, dict) else obj
    if isinstance(err, dict):
        return str(err.get("type") or err.get("code") or default_type), str(err.get("message", err))[:500]
    return default_type, str(err)[:500]


class TracedClient:
    """Async streaming client; one CLIENT span per request (docs/contracts.md#client-span)."""

    def __init__(
        self,
        base_url: str,
        tracer_provider: trace.TracerProvider | None = None,
        timeout_s: float = 300.0,
        meter_provider: metrics.MeterProvider | None = None,
        headers: dict[str, str] | None = None,
        token_counter: Callable[[str], int] | None = None,
        provider_name: str = "openai",
        max_connections: int = 4096,
        keep_text: bool = False,
        clock_ns: MonoClock = perf_counter_ts,
        ssl_context: ssl.SSLContext | None = None,  # https:// servers (None: the system's trust store)
        tail: TailRule | None = None,  # None: from PHASELENS_TAIL_SLO (sampling.TailRule.from_env)
    ):
        base = base_url.rstrip("/").removesuffix("/v1")
        parts = urlsplit(base)
        self.server_address = parts.hostname or ""
        self.server_port = parts.port or (443 if parts.scheme == "https" else 80)
        self.timeout_s = timeout_s
        self.token_counter = token_counter
        self.provider_name = provider_name
        self.keep_text = keep_text
        self._tail = TailRule.from_env() if tail is None else tail
        self._clock_ns = clock_ns
        self._anchor = ClockAnchor.capture(mono_clock=clock_ns)  # wall time of this client's own clock
        self._tracer = trace.get_tracer("phaselens.client", tracer_provider=tracer_provider)
        self._duration = metrics.get_meter("phaselens.client", meter_provider=meter_provider).create_histogram(
            N.METRIC_CLIENT_OPERATION_DURATION,
            unit="s",
            description="Request sent → response closed (client).",
            explicit_bucket_boundaries_advisory=list(N.BUCKETS_DURATION_S),
        )
        # one lean HTTP/1.1 transport (client_transport): httpx's default one costs ~100 µs of CPU
        # per streamed chunk, and it stamps each network read as the event loop delivers it
        self._urls = {endpoint: httpx.URL(base + path) for endpoint, path in ENDPOINT_PATHS.items()}
        self._http = httpx.AsyncClient(
            headers={"accept-encoding": "identity", **(headers or {})},
            trust_env=False,
            timeout=httpx.Timeout(timeout_s, connect=min(timeout_s, 10.0)),
            transport=StreamingTransport(max_connections, ssl_context=ssl_context, clock_ns=clock_ns),
        )

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await self._http.aclose()

    async def stream(self, endpoint: str, payload: dict[str, Any], intended_ts: MonoTs | None = None) -> StreamResult:
        """Send one streaming request; return its `StreamResult` (errors inside, not raised; a
        cancellation is recorded, then re-raised).

        `intended_ts` (perf_counter_ns) is when the schedule wanted it sent: it gives schedule lag."""
        if endpoint not in ENDPOINT_PATHS:
            raise ValueError(f"endpoint must be one of {sorted(ENDPOINT_PATHS)}, not {endpoint!r}")
        body = {
            **payload,
            "stream": True,
            "stream_options": {**(payload.get("stream_options") or {}), "include_usage": True},
        }
        result = StreamResult(endpoint=endpoint, model=str(payload.get("model", "")), intended_ts=intended_ts)
        capture = env_flag(N.ENV_CAPTURE_CONTENT)
        result.sent_ts = self._clock_ns()
        span = self._tracer.start_span(
            N.root_span_name(OPERATIONS[endpoint], result.model),
            kind=SpanKind.CLIENT,
            start_time=self._anchor.to_wall_ts(result.sent_ts),
            attributes=self._request_attributes(endpoint, body),
        )
        ctx = span.get_span_context()
        if ctx.is_valid:
            result.trace_id, result.span_id = f"{ctx.trace_id:032x}", f"{ctx.span_id:016x}"
        headers = {"content-type": "application/json"}
        head = head_sampled(span)
        propagate.inject(headers, context=trace.set_span_in_context(propagated(span)))
        _sampled_flag_only(headers)
        reader = _ChunkReader(result, self.token_counter, capture or self.keep_text)
        cancelled = None
        try:
            async with asyncio.timeout(self.timeout_s):
                await self._request(self._urls[endpoint], body, headers, reader)
        except (Exception, asyncio.CancelledError) as exc:  # noqa: BLE001 — every failure becomes the result's error
            result.error_type, result.error = _classify(exc)
            cancelled = exc if isinstance(exc, asyncio.CancelledError) else None
        result.done_ts = self._clock_ns()
        compute_metrics(result)
        self._end_span(span, result, capture, head)
        self._record_duration(result)
        if cancelled is not None:
            raise cancelled
        return result

    def _record_duration(self, result: StreamResult) -> None:
        attrs: dict[str, AttributeValue] = {
            N.GEN_AI_OPERATION_NAME: OPERATIONS[result.endpoint],
            N.GEN_AI_PROVIDER_NAME: self.provider_name,
            N.GEN_AI_REQUEST_MODEL: result.model,
            N.SERVER_ADDRESS: self.server_address,
            N.SERVER_PORT: self.server_port,
        }
        if result.error_type is not None:
            attrs[N.ERROR_TYPE] = result.error_type
        self._duration.record(result.elapsed_ms / 1e3, attrs)

    async def _request(
        self, url: httpx.URL, body: dict[str, Any], headers: dict[str, str], reader: _ChunkReader
    ) -> None:
        result = reader.result
        # an absolute URL object and pre-encoded JSON spare httpx ~80 µs of URL merging per request
        async with self._http.stream("POST", url, content=orjson.dumps(body), headers=headers) as response:
            result.status = response.status_code
            if response.status_code != 200:
                raw = await _read_bounded(response)
                try:
                    obj = json.loads(raw)
                except ValueError:
                    obj = raw.decode("utf-8", "replace")
                raise StreamFailure(*_error_of(obj, str(response.status_code)))
            parser = SSEParser()
            receipts = None
            result.written_ts = getattr(response.extensions.get(RECEIPTS), "written_ts", NOT_STAMPED)
            result.connect_ns = getattr(response.extensions.get(RECEIPTS), "connect_ns", 0)
            if response.headers.get("content-encoding", "identity") == "identity":
                receipts = response.extensions[RECEIPTS]
                pieces = receipts.stamped()  # stamped per network read, with the kernel's stamp
            else:  # a compressed body: decoded by httpx, stamped as it comes out of the decoder
                pieces = _clock_stamped(response.aiter_bytes(), self._clock_ns)
            body_bytes = 0
            async for now_ts, chunk in pieces:
                body_bytes += len(chunk)
                if receipts is not None:
                    reader.arrived_ts = receipts.arrived_ts
                events = parser.feed(chunk)
                for i, event in enumerate(events):
                    first = result.first_chunk_ts
                    reader.on_event(event.data, event.event, now_ts)
                    if first is None and result.first_chunk_ts is not None:
                        result.read_coalesced = i + 1 < len(events)
                        result.read_body_bytes = body_bytes if receipts is not None else 0
            parser.close()
        if not result.saw_done and not result.finish_reasons:
            raise StreamFailure(ERROR_TRUNCATED, "stream closed without [DONE] or a finish_reason")

    def _request_attributes(self, endpoint: str, body: dict[str, Any]) -> dict[str, AttributeValue]:
        attrs: dict[str, AttributeValue] = {
            N.GEN_AI_OPERATION_NAME: OPERATIONS[endpoint],
            N.GEN_AI_PROVIDER_NAME: self.provider_name,
            N.GEN_AI_REQUEST_MODEL: str(body.get("model", "")),
            N.GEN_AI_REQUEST_STREAM: True,
            N.SERVER_ADDRESS: self.server_address,
            N.SERVER_PORT: self.server_port,
        }
        for key, attr in _REQUEST_ATTRS:
            if isinstance(body.get(key), (int, float)) and not isinstance(body[key], bool):
                attrs[attr] = body[key]
        if env_flag(N.ENV_CAPTURE_CONTENT):
            attrs[N.GEN_AI_INPUT_MESSAGES] = json.dumps(body.get("messages", body.get("prompt")))
        return attrs

    def _end_span(self, span: trace.Span, result: StreamResult, capture: bool, head: bool) -> None:
        """The span's attributes (its compact record); its events only where its tree is kept
        (`sampling.TailRule.full`: head-sampled, failed, or over the tail threshold)."""
        result.sent_wall_ts = self._anchor.to_wall_ts(result.sent_ts)
        result.done_wall_ts = self._anchor.to_wall_ts(result.done_ts)
        full = self._tail.full(head, result.error_type is not None, result.ttft_ms, result.tpot_ms)
        span.set_attribute(N.PL_TRACE_FULL, full)
        kept = (
            ()
            if full == N.TRACE_FULL_NONE
            else (
                (N.EVENT_FIRST_CHUNK, result.first_chunk_ts),
                (N.EVENT_FIRST_OUTPUT, result.first_output_ts),
                (N.EVENT_LAST_CHUNK, result.last_chunk_ts),
            )
        )
        for name, stamp in kept:
            if stamp is not None:
                span.add_event(name, timestamp=self._anchor.to_wall_ts(stamp))
        span.set_attributes(_result_attributes(result))
        if capture:
            span.set_attribute(N.GEN_AI_OUTPUT_MESSAGES, json.dumps("".join(result.chunk_text)))
        if result.error_type is not None:
            span.set_attribute(N.ERROR_TYPE, result.error_type)
            span.set_status(Status(StatusCode.ERROR, result.error))
        span.end(end_time=result.done_wall_ts)


def _result_attributes(result: StreamResult) -> dict[str, AttributeValue]:
    """Span attributes of the response (None values are left out, as OTel requires)."""
    itl, per_token = sorted(result.itl_ms), sorted(result.itl_per_token_ms)
    attrs: dict[str, AttributeValue | None] = {
        N.GEN_AI_RESPONSE_ID: result.response_id,
        N.GEN_AI_RESPONSE_MODEL: result.response_model,
        N.GEN_AI_RESPONSE_FINISH_REASONS: tuple(result.finish_reasons) or None,
        N.GEN_AI_RESPONSE_TIME_TO_FIRST_CHUNK: None if result.ttft_ms is None else result.ttft_ms / 1e3,
        N.GEN_AI_USAGE_INPUT_TOKENS: result.input_tokens,
        N.GEN_AI_USAGE_OUTPUT_TOKENS: result.output_tokens,
        N.GEN_AI_USAGE_REASONING_OUTPUT_TOKENS: result.reasoning_tokens,
        N.GEN_AI_USAGE_CACHE_READ_INPUT_TOKENS: result.cached_tokens,
        N.PL_CLIENT_TTFT_MS: result.ttft_ms,
        N.PL_CLIENT_TTFO_MS: result.ttfo_ms,
        N.PL_CLIENT_READ_MS: result.read_ms,
        N.PL_CLIENT_SEND_MS: result.send_ms,
        N.PL_CLIENT_READ_COALESCED: result.read_coalesced if result.ttft_ms is not None else None,
        N.PL_CLIENT_READ_BODY_BYTES: result.read_body_bytes if result.read_ms is not None else None,
        N.PL_CLIENT_TPOT_MS: result.tpot_ms,
        N.PL_CLIENT_E2E_MS: result.e2e_ms,
        N.PL_CLIENT_END_READ_MS: result.end_read_ms,
        N.PL_CLIENT_ITL_P50_MS: quantile(itl, 0.5),
        N.PL_CLIENT_ITL_P99_MS: quantile(itl, 0.99),
        N.PL_CLIENT_ITL_MAX_MS: itl[-1] if itl else None,
        N.PL_CLIENT_ITL_TOKEN_P50_MS: quantile(per_token, 0.5),
        N.PL_CLIENT_ITL_TOKEN_P99_MS: quantile(per_token, 0.99),
        N.PL_CLIENT_CHUNKS: len(result.chunk_ts),
        N.PL_CLIENT_COUNTED_TOKENS: result.counted_tokens,
        N.PL_CLIENT_USAGE_MISMATCH: result.usage_mismatch,
        N.PL_CLIENT_INTENDED_DELAY_MS: result.schedule_lag_ms,
        N.PL_CLIENT_OUTCOME: N.OUTCOME_NO_OUTPUT if result.no_output else None,
        N.PL_CLIENT_SENT_WALL_NS: result.sent_wall_ts,
        N.PL_CLIENT_DONE_WALL_NS: result.done_wall_ts,
    }
    return {k: v for k, v in attrs.items() if v is not None}


async def _clock_stamped(chunks: AsyncIterator[bytes], clock_ns: MonoClock) -> AsyncIterator[tuple[MonoTs, bytes]]:
    async for chunk in chunks:
        yield clock_ns(), chunk


async def _read_bounded(response: httpx.Response) -> bytes:
    body = b""
    async for chunk in response.aiter_bytes():
        body += chunk
        if len(body) >= _MAX_ERROR_BODY:
            break
    return body[:_MAX_ERROR_BODY]


def _sampled_flag_only(headers: dict[str, str]) -> None:
    """Send W3C Trace Context level 1 flags: the sampled bit alone (`01` or `00`). The SDK also sets
    level 2's random-trace-id bit (`03`), which strict propagators refuse whole (Dynamo 1.6.1's
    Rust frontend then starts a trace of its own and no request joins its client span)."""
    value = headers.get("traceparent")
    if value is not None and len(value) == 55:
        headers["traceparent"] = f"{value[:53]}{int(value[53:], 16) & 1:02x}"


def _classify(exc: BaseException) -> tuple[str, str]:
    """(error.type, message) of an exception that ended a stream."""
    if isinstance(exc, StreamFailure):
        return exc.error_type, str(exc)
    if isinstance(exc, SSEError):
        return ERROR_MALFORMED_SSE, str(exc)
    if isinstance(exc, (TimeoutError, httpx.TimeoutException)):
        return ERROR_TIMEOUT, str(exc) or type(exc).__name__
    if isinstance(exc, asyncio.CancelledError):
        return ERROR_CANCELLED, "request cancelled"
    if isinstance(exc, (httpx.ConnectError, httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError)):
        return ERROR_CONNECTION, str(exc) or type(exc).__name__
    return type(exc).__qualname__, str(exc)
