"""What both receivers do with a decoded export: validate, count, spool durably, or refuse."""

from __future__ import annotations

from dataclasses import dataclass
from typing import NoReturn

from phaselens.collectors import render
from phaselens.collectors.metrics import CollectorMetrics
from phaselens.collectors.spool import Spool, SpoolFull
from phaselens.common.exposure import authorized

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

    def check_auth(self, authorization: str | None) -> None:
        if not authorized(authorization, self.auth_token):
            self.refuse("unauthenticated", "missing or wrong bearer token")

    def refuse(self, kind: str, message: str) -> NoReturn:
        self.metrics.add("requests_retryable" if kind == "full" else "requests_rejected")
        raise Refused(kind, message)

    def accept(self, payload: bytes) -> int:
        """Validates an ExportTraceServiceRequest; returns once its spans are durable. The rows
        rendered here are not kept: the writer renders from the spool, which costs ~2 µs a span."""
        try:
            spans = render.count_spans(payload)
        except render.InvalidSpans as exc:
            self.refuse("invalid", f"invalid ExportTraceServiceRequest: {exc}")
        if spans:
            try:
                if not self.spool.append(payload, spans):  # spooled before a crash: a client's retry
                    self.metrics.add("requests_deduplicated")
                    return 0
            except SpoolFull as exc:
                self.refuse("full", str(exc))
        self.metrics.add("requests_received")
        self.metrics.add("spans_received", spans)
        return spans
