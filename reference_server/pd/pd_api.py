"""The OpenAI routes of a prefill or a decode instance (`phaselens serve --role prefill|decode`).

Both serve whole requests as any instance does; a request that carries `kv_transfer_params`
(sent by the router, reference_server.pd.router) is one half of a disaggregated request:

- prefill: `{"decode_kv": "HOST:PORT", "transfer_id": ID}` — run the prompt here, send its KV and
  the first token to that decode instance's KV port; answer (not streamed) once the decode instance
  acknowledged, `finish_reason` "transferred" (or "stop"/"length" when the first token ended it:
  then nothing was sent). A failed transfer answers 502 `kv_transfer_failed`, its KV freed here.
- decode: `{"transfer_id": ID}` — continue the request whose KV arrived under that id, in this
  instance's batch; the response (streamed or not) starts with the first token's text. 404
  `kv_not_found` when no such KV is staged (never sent, expired, or already claimed).
"""

from __future__ import annotations

import json
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from phaselens.common.clocks import monotonic_ts
from phaselens.instrumentation import RequestHandle
from phaselens.reference_server.engine.disagg import KvHandoff, ReceivedKv
from phaselens.reference_server.engine.engine import Engine
from phaselens.reference_server.engine.kv_transfer import Transfer
from phaselens.reference_server.engine.sequence import SeqOutput
from phaselens.reference_server.pd.pd_spans import PdSpans
from phaselens.reference_server.serving.api import Job, OutputStream, Routes
from phaselens.reference_server.serving.protocol import ApiError, bad

ROLE_PREFILL, ROLE_DECODE, ROLE_ROUTER = "prefill", "decode", "router"


def parse_address(value: str, param: str) -> tuple[str, int]:
    host, _, port = value.rpartition(":")
    if not host or not port.isdigit():
        raise bad(f"{param} must be HOST:PORT, got {value!r}", param)
    return host.strip("[]"), int(port)


class PrefillRoutes(Routes):
    engine: Engine  # P/D instances run the thread engine

    def __init__(self, engine: Engine, settings: Any, telemetry: Any, spans: PdSpans) -> None:
        super().__init__(engine, settings, telemetry)
        self.spans = spans
        self._handoffs: dict[int, KvHandoff] = {}

    def _start(self, job: Job, handle: RequestHandle, stream: OutputStream) -> int:
        kv = job.parsed.kv_transfer
        if kv is None:
            return super()._start(job, handle, stream)
        if job.parsed.stream:
            raise bad("a prefill half (kv_transfer_params) is answered whole: stream must be false", "stream")
        address = parse_address(kv.get("decode_kv", ""), "kv_transfer_params.decode_kv")
        transfer_id = kv.get("transfer_id") or ""
        if not transfer_id:
            raise bad("kv_transfer_params.transfer_id is required", "kv_transfer_params")
        handoff = KvHandoff(address, transfer_id, traceparent=self.spans.kv_send_traceparent(handle))
        seq_id = self.engine.submit(job.prompt_ids, job.params, observer=handle, sink=stream.sink, handoff=handoff)
        self._handoffs[seq_id] = handoff
        return seq_id

    async def _respond(
        self, request: Request, job: Job, stream: OutputStream, handle: RequestHandle, seq_id: int
    ) -> Response:
        try:
            return await super()._respond(request, job, stream, handle, seq_id)
        finally:  # the answer is built, not yet sent: where the router's hop starts (pd_spans)
            handoff = self._handoffs.pop(seq_id, None)
            if handoff is not None and handoff.send_start_ts:
                self.spans.kv_sent(handle, handoff, monotonic_ts())

    def _engine_failure(self, out: SeqOutput, handle: RequestHandle) -> ApiError:
        if not out.error:
            return super()._engine_failure(out, handle)
        error = ApiError(502, out.error, type_="server_error", code="kv_transfer_failed")
        handle.fail(error_type=error.code, status_code=error.status)
        return error


class DecodeRoutes(Routes):
    engine: Engine

    def __init__(self, engine: Engine, settings: Any, telemetry: Any, kv_address: tuple[str, int]) -> None:
        super().__init__(engine, settings, telemetry)
        self.kv_address = kv_address

    def _start(self, job: Job, handle: RequestHandle, stream: OutputStream) -> int:
        kv = job.parsed.kv_transfer
        if kv is None:
            return super()._start(job, handle, stream)
        transfer_id = kv.get("transfer_id") or ""
        try:
            return self.engine.claim(transfer_id, job.params, observer=handle, sink=stream.sink)
        except KeyError:
            raise ApiError(
                404, f"no KV staged here for transfer {transfer_id!r}", param="kv_transfer_params", code="kv_not_found"
            ) from None

    async def health(self) -> Response:
        """The instance's load, plus where its KV port listens (the router asks it once)."""
        response = await super().health()
        body = json.loads(bytes(response.body))
        host, port = self.kv_address
        body.update(role=ROLE_DECODE, kv_address=f"{host}:{port}", kv_staged=self.engine.num_staged)
        return JSONResponse(body)


def kv_handler(engine: Engine, spans: PdSpans):
    """The decode instance's KvReceiver handler: stage the KV, then record the receive span."""

    def handle(transfer: Transfer) -> None:
        received = ReceivedKv(transfer, monotonic_ts())
        try:
            engine.receive_kv(received)
        finally:
            spans.kv_received(received, monotonic_ts())

    return handle
