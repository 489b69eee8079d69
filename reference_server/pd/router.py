"""The disaggregated-serving router (`phaselens serve --role router --prefill URL… --decode URL…`).

The client talks OpenAI to the router; per request the router picks the least-loaded prefill and
decode instances (fewest requests in flight from this router, then fewest picks), and:

    1. POST the body to the prefill instance, not streamed, with what the protocol adds
       (reference_server.pd_protocol; phaselens's own: kv_transfer_params = {decode_kv: the decode
       instance's KV port, transfer_id}: it runs the prompt, sends the KV and the first token to
       the decode instance, answers once acknowledged; vLLM's: max_tokens 1, do_remote_decode);
    2. POST the body to the decode instance with what the protocol takes from the prefill's answer
       (the transfer id; vLLM's kv_transfer_params), as the client asked (streamed or not), and
       relay its answer.

Both halves carry the hop's `traceparent` and one X-Request-ID. A prefill answer that is the whole
answer (phaselens: not "transferred", the first token ended the request) is relayed as it is. A failure on either side gives the client an OpenAI-shaped error: before the stream
(HTTP 502 naming the instance, or the instance's own error status), or as an SSE `error` event
when the decode instance dies mid-stream; the stream then ends without `[DONE]`. An instance that
failed is passed over for DOWN_S seconds (unless every instance of its kind did).

Telemetry (reference_server.pd.router_spans): the router stamps monotonic integers per request and
emits its SERVER span and two CLIENT spans (pd.prefill_call, pd.decode_call) off the event loop;
their contexts travel to the instances as `traceparent`, so the request's trace crosses all three.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from phaselens.common.clocks import NOT_STAMPED, MonoTs, monotonic_ts
from phaselens.common.exposure import authorized
from phaselens.instrumentation import names
from phaselens.reference_server.pd.pd_protocol import PROTOCOL_PHASELENS, PdProtocol, protocol
from phaselens.reference_server.pd.router_spans import RouterRecord, RouterSpans
from phaselens.reference_server.serving.api import NO_FASTAPI_TELEMETRY, EventStreamResponse, error_response
from phaselens.reference_server.serving.protocol import ApiError, bad
from phaselens.reference_server.serving.sse import DONE_EVENT, encode_event

DEFAULT_TIMEOUT_S = 300.0
DOWN_S = 10.0  # how long an instance that failed is passed over
COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"


@dataclass(slots=True)
class Instance:
    url: str
    inflight: int = 0
    picks: int = 0
    kv_address: str = ""  # decode instances: learnt from their /health
    down_until_ts: MonoTs = NOT_STAMPED  # after a failure it is passed over until then (monotonic ns)

    def mark_down(self) -> None:
        self.down_until_ts = MonoTs(monotonic_ts() + int(DOWN_S * 1e9))

    @property
    def up(self) -> bool:
        return self.down_until_ts <= monotonic_ts()


@dataclass(slots=True)
class Pool:
    instances: list[Instance] = field(default_factory=list)

    def pick(self) -> Instance:
        """Least loaded: fewest in flight, then fewest picks so far (round robin among equals), among
        the instances that have not failed in the last DOWN_S seconds (all of them when none has not)."""
        chosen = min([i for i in self.instances if i.up] or self.instances, key=lambda i: (i.inflight, i.picks))
        chosen.picks += 1
        return chosen


def _upstream_error(instance: Instance, role: str, exc: Exception) -> ApiError:
    """The client's error for a failed instance, which is passed over for a while."""
    instance.mark_down()
    return ApiError(
        502, f"the {role} instance {instance.url} failed: {exc}", type_="server_error", code=f"{role}_failed"
    )


def _has_content(buf: bytes) -> bool:
    """Whether the SSE events complete in `buf` carry text (a role-only chunk does not count)."""
    for event in buf.split(b"\n\n")[:-1]:
        if not event.startswith(b"data: ") or event == DONE_EVENT.strip():
            continue
        try:
            choice = (json.loads(event[6:]).get("choices") or [{}])[0]
        except ValueError:
            continue
        delta = choice.get("delta") or {}
        if choice.get("text") or delta.get("content") or delta.get("reasoning_content"):
            return True
    return False


def _whole_as_stream(data: dict[str, Any], chat: bool) -> list[bytes]:
    """A complete (not streamed) answer as the events of a stream: its text, its finish, [DONE]."""
    choice = data["choices"][0]
    head: dict[str, Any] = {k: data[k] for k in ("id", "created", "model") if k in data}
    obj = "chat.completion.chunk" if chat else "text_completion"
    if chat:
        text = {"delta": {"role": "assistant", "content": choice.get("message", {}).get("content", "")}}
    else:
        text = {"text": choice.get("text", "")}
    first = {**head, "object": obj, "choices": [{"index": 0, **text, "finish_reason": None}]}
    last = {**head, "object": obj, "choices": [{"index": 0, "finish_reason": choice.get("finish_reason")}]}
    if not chat:
        last["choices"][0]["text"] = ""
    return [encode_event(first), encode_event(last), DONE_EVENT]


class Router:
    def __init__(
        self,
        prefill: list[str],
        decode: list[str],
        spans: RouterSpans,
        auth_token: str | None = None,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        max_body_bytes: int = 1 << 20,
        pd_protocol: str = PROTOCOL_PHASELENS,
    ) -> None:
        if not prefill or not decode:
            raise ValueError("a router needs at least one --prefill and one --decode instance")
        self.prefill = Pool([Instance(u.rstrip("/")) for u in prefill])
        self.decode = Pool([Instance(u.rstrip("/")) for u in decode])
        self.spans = spans
        self.protocol: PdProtocol = protocol(pd_protocol)
        self.auth_token = auth_token
        self.max_body_bytes = max_body_bytes
        self.client = httpx.AsyncClient(timeout=httpx.Timeout(timeout_s, connect=10.0))

    def app(self) -> FastAPI:
        app = FastAPI(title="phaselens router", docs_url=None, redoc_url=None, openapi_url=None, **NO_FASTAPI_TELEMETRY)
        app.add_api_route(COMPLETIONS, self.completions, methods=["POST"])
        app.add_api_route(CHAT, self.chat, methods=["POST"])
        app.add_api_route("/health", self.health, methods=["GET"])
        app.add_api_route("/v1/models", self.models, methods=["GET"])
        return app

    async def health(self) -> Response:
        def rows(pool: Pool) -> list[dict[str, Any]]:
            return [{"url": i.url, "inflight": i.inflight, "picks": i.picks, "up": i.up} for i in pool.instances]

        return JSONResponse({"status": "ok", "prefill": rows(self.prefill), "decode": rows(self.decode)})

    async def models(self, request: Request) -> Response:
        instance = self.decode.instances[0]
        try:
            upstream = await self.client.get(f"{instance.url}/v1/models", headers=self._forward_headers(request, ""))
        except httpx.HTTPError as exc:
            return error_response(_upstream_error(instance, "decode", exc))
        return Response(upstream.content, upstream.status_code, media_type="application/json")

    async def completions(self, request: Request) -> Response:
        return await self._serve(request, COMPLETIONS)

    async def chat(self, request: Request) -> Response:
        return await self._serve(request, CHAT)

    async def _serve(self, request: Request, path: str) -> Response:
        rec = RouterRecord(received_ts=monotonic_ts(), chat=path == CHAT)
        self.spans.open(rec, dict(request.headers))
        try:
            if not authorized(request.headers.get("authorization"), self.auth_token):
                raise ApiError(
                    401, "missing or wrong bearer token", type_="authentication_error", code="invalid_api_key"
                )
            body = await self._read_json(request)
            rec.model, rec.stream = str(body.get("model", "")), bool(body.get("stream"))
            rec.request_id = request.headers.get(names.X_REQUEST_ID_HEADER) or uuid.uuid4().hex
            prefill_answer = await self._prefill(request, path, body, rec)
        except ApiError as error:
            rec.fail(error.code or error.type, error.status)
            self.spans.close(rec)
            return error_response(error)
        if self.protocol.whole(prefill_answer):  # the prefill instance finished the request itself
            return self._whole(prefill_answer, rec)
        return await self._decode(request, path, body, rec, prefill_answer)

    async def _read_json(self, request: Request) -> dict[str, Any]:
        """The body as a JSON object, read only up to `max_body_bytes` (413 beyond)."""
        too_big = ApiError(413, f"request body larger than {self.max_body_bytes} bytes", code="request_too_large")
        declared = request.headers.get("content-length") or "0"
        if declared.isdigit() and int(declared) > self.max_body_bytes:
            raise too_big
        raw = bytearray()
        async for part in request.stream():
            raw += part
            if len(raw) > self.max_body_bytes:
                raise too_big
        try:
            body = json.loads(raw)
        except ValueError as exc:
            raise bad(f"the body is not valid JSON: {exc}") from None
        if not isinstance(body, dict):
            raise bad("the request body must be a JSON object")
        return body

    def _forward_headers(self, request: Request, traceparent: str, request_id: str = "") -> dict[str, str]:
        """The headers an instance gets: the client's authorization, the hop's trace context, and one
        X-Request-ID for both halves (the client's, else the router's; vLLM's connectors pair the
        halves by request id)."""
        headers = {"content-type": "application/json"}
        if request_id:
            headers[names.X_REQUEST_ID_HEADER] = request_id
        if request.headers.get("authorization"):
            headers["authorization"] = request.headers["authorization"]
        if traceparent:
            headers["traceparent"] = traceparent
        return headers

    async def _kv_address(self, instance: Instance) -> str:
        if not instance.kv_address:
            try:
                health = (await self.client.get(f"{instance.url}/health")).json()
            except (httpx.HTTPError, ValueError) as exc:
                raise _upstream_error(instance, "decode", exc) from None
            if not health.get("kv_address"):
                raise _upstream_error(instance, "decode", ValueError("it has no KV port (is it --role decode?)"))
            instance.kv_address = health["kv_address"]
        return instance.kv_address

    async def _prefill(self, request: Request, path: str, body: dict[str, Any], rec: RouterRecord) -> dict[str, Any]:
        """Step 1; returns the prefill instance's answer."""
        prefill, decode = self.prefill.pick(), self.decode.pick()
        rec.prefill_url, rec.decode_url, rec.transfer_id = prefill.url, decode.url, uuid.uuid4().hex
        kv_address = await self._kv_address(decode) if self.protocol.needs_kv_address else ""
        half = self.protocol.prefill_half(body, rec.transfer_id, kv_address)
        headers = self._forward_headers(request, self.spans.prefill_traceparent(rec), rec.request_id)
        prefill.inflight += 1
        rec.prefill_start_ts = monotonic_ts()
        try:
            answer = await self.client.post(f"{prefill.url}{path}", json=half, headers=headers)
        except httpx.HTTPError as exc:
            raise _upstream_error(prefill, "prefill", exc) from None
        finally:
            rec.prefill_end_ts = monotonic_ts()
            prefill.inflight -= 1
        data = _json_or_error(answer, prefill, "prefill")
        if answer.status_code != 200:
            error = ApiError(answer.status_code, **_error_fields(data))
            if error.code == "kv_transfer_failed":  # the decode instance's KV port failed
                decode.mark_down()
            raise error
        return data

    def _whole(self, data: dict[str, Any], rec: RouterRecord) -> Response:
        rec.first_chunk_ts = rec.relayed_ts = rec.done_ts = monotonic_ts()
        self.spans.close(rec)
        if not rec.stream:
            return JSONResponse(data)
        return EventStreamResponse(_iterate(_whole_as_stream(data, rec.chat)), media_type="text/event-stream")

    async def _decode(
        self, request: Request, path: str, body: dict[str, Any], rec: RouterRecord, prefill_answer: dict[str, Any]
    ) -> Response:
        decode = next(i for i in self.decode.instances if i.url == rec.decode_url)
        half = self.protocol.decode_half(body, rec.transfer_id, prefill_answer)
        headers = self._forward_headers(request, self.spans.decode_traceparent(rec), rec.request_id)
        decode.inflight += 1
        rec.decode_start_ts = monotonic_ts()
        try:
            upstream = await self.client.send(
                self.client.build_request("POST", f"{decode.url}{path}", json=half, headers=headers), stream=True
            )
        except httpx.HTTPError as exc:
            decode.inflight -= 1
            return self._failed(rec, _upstream_error(decode, "decode", exc))
        if upstream.status_code != 200 or not rec.stream:
            try:
                raw = await upstream.aread()
            except httpx.HTTPError as exc:
                return self._failed(rec, _upstream_error(decode, "decode", exc))
            finally:
                decode.inflight -= 1
                await upstream.aclose()
            rec.first_chunk_ts = rec.relayed_ts = rec.done_ts = monotonic_ts()
            if upstream.status_code != 200:
                rec.fail(_error_fields(_loads(raw)).get("code") or "decode_failed", upstream.status_code)
            self.spans.close(rec)
            return Response(raw, upstream.status_code, media_type="application/json")
        return EventStreamResponse(
            self._relay(upstream, decode, rec), media_type="text/event-stream", headers={"Cache-Control": "no-cache"}
        )

    async def _relay(self, upstream: httpx.Response, decode: Instance, rec: RouterRecord) -> AsyncIterator[bytes]:
        """Pass the decode instance's events on; stamp its first content chunk's arrival and relay."""
        seen, ended = b"", False
        try:
            async for raw in upstream.aiter_raw():
                if not rec.first_chunk_ts:
                    seen += raw
                    if _has_content(seen):
                        rec.first_chunk_ts = monotonic_ts()
                        seen = b""
                if rec.first_chunk_ts and not rec.relayed_ts:
                    rec.relayed_ts = monotonic_ts()
                yield raw
            ended = True
        except httpx.HTTPError as exc:
            error = _upstream_error(decode, "decode", exc)
            rec.fail(error.code or "decode_failed", error.status)
            ended = True
            yield encode_event(error.body())
        finally:
            rec.done_ts = monotonic_ts()
            decode.inflight -= 1
            await upstream.aclose()
            if not ended:
                rec.fail("client_disconnected", 499)
            self.spans.close(rec)

    def _failed(self, rec: RouterRecord, error: ApiError) -> Response:
        rec.done_ts = monotonic_ts()
        rec.fail(error.code or "decode_failed", error.status)
        self.spans.close(rec)
        return error_response(error)


def _loads(raw: bytes) -> Any:
    try:
        return json.loads(raw)
    except ValueError:
        return None


def _json_or_error(answer: httpx.Response, instance: Instance, role: str) -> dict[str, Any]:
    data = _loads(answer.content)
    if not isinstance(data, dict) or (answer.status_code == 200 and not data.get("choices")):
        raise _upstream_error(instance, role, ValueError(f"unexpected answer (HTTP {answer.status_code})"))
    return data


def _error_fields(data: Any) -> dict[str, Any]:
    """An instance's OpenAI error as ApiError keyword arguments (status aside)."""
    error = data.get("error") if isinstance(data, dict) else None
    if not isinstance(error, dict):
        return {"message": "the instance answered with an error", "type_": "server_error"}
    return {
        "message": str(error.get("message", "")),
        "param": error.get("param"),
        "type_": str(error.get("type", "server_error")),
        "code": None if error.get("code") is None else str(error["code"]),  # vLLM's is the HTTP status, an int
    }


async def _iterate(events: list[bytes]) -> AsyncIterator[bytes]:
    for event in events:
        yield event
