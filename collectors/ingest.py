"""What both receivers do with a decoded export: validate, count, spool durably, or refuse."""

from __future__ import annotations

import hmac
from dataclasses import dataclass, field

from collectors import render
from collectors.clickhouse_sink import encode_block
from collectors.metrics import CollectorMetrics
from collectors.render_cache import RenderCache
from collectors.spool import Spool, SpoolFull

RETRY_AFTER_S = 2


class Refused(Exception):
    """An export not accepted. `kind`: invalid | too_large | unsupported | unauthenticated | full."""

    def __init__(self, kind: str, message: str):
        super().__init__(message)
        self.kind = kind


@dataclass(slots=True)
class Ingest:
    spool: Spool
    metrics: CollectorMetrics
    max_body_bytes: int = 16 << 20
    auth_token: str | None = None
    rendered: RenderCache = field(default_factory=RenderCache)

    def check_auth(self, authorization: str | None) -> None:
        if self.auth_token is None:
            return
        expected = f"Bearer {self.auth_token}".encode()
        if not authorization or not hmac.compare_digest(authorization.encode(), expected):
            self.refuse("unauthenticated", "missing or wrong bearer token")

    def refuse(self, kind: str, message: str) -> None:
        self.metrics.add("requests_retryable" if kind == "full" else "requests_rejected")
        raise Refused(kind, message)

    def accept(self, payload: bytes) -> int:
        """Decodes and validates an ExportTraceServiceRequest; returns once its spans are durable."""
        rows: list[tuple] = []
        try:
            spans = render.add_rows(rows, payload)
        except render.InvalidSpans as exc:
            self.refuse("invalid", f"invalid ExportTraceServiceRequest: {exc}")
        if spans:
            block = encode_block(rows)
            try:
                self.spool.append(payload, spans,
                                  on_written=lambda seg, start: self.rendered.put((seg, start), block, spans))
            except SpoolFull as exc:
                self.refuse("full", str(exc))
        self.metrics.add("requests_received")
        self.metrics.add("spans_received", spans)
        return spans
