"""What both receivers do with a decoded export of one signal: validate, count, spool durably, or refuse."""

from __future__ import annotations

from dataclasses import dataclass
from typing import NoReturn

from phaselens.collectors.metrics import CollectorMetrics
from phaselens.collectors.signals import INVALID, TRACES, Signal
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
    signal: Signal = TRACES

    def check_auth(self, authorization: str | None) -> None:
        if not authorized(authorization, self.auth_token):
            self.refuse("unauthenticated", "missing or wrong bearer token")

    def refuse(self, kind: str, message: str) -> NoReturn:
        self.metrics.add(self.signal.counter("requests_retryable" if kind == "full" else "requests_rejected"))
        raise Refused(kind, message)

    def accept(self, payload: bytes) -> int:
        """Validates an export request of this signal; returns its item count (spans, log records,
        data points) once they are durable. The rows rendered here are not kept: the writer renders
        from the spool (~2 µs a span)."""
        signal = self.signal
        try:
            items = signal.count(payload)
        except INVALID as exc:
            self.refuse("invalid", f"invalid {signal.request_type.__name__}: {exc}")
        if items:
            try:
                if not self.spool.append(payload, items):  # spooled before a crash: a client's retry
                    self.metrics.add(signal.counter("requests_deduplicated"))
                    return 0
            except SpoolFull as exc:
                self.refuse("full", str(exc))
        self.metrics.add(signal.counter("requests_received"))
        self.metrics.add(f"{signal.item}_received", items)
        return items
