"""Self-telemetry counters of the collector, rendered in the Prometheus text exposition format."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field, fields

_PREFIX = "phaselens_collector_"
_HELP = {
    "requests_received": "export requests accepted (acknowledged)",
    "spans_received": "spans accepted and durably spooled",
    "spans_written": "spans inserted into ClickHouse",
    "requests_rejected": "export requests refused (bad input, auth, spool full)",
    "requests_retryable": "export requests answered with a retryable code (spool full)",
    "requests_deduplicated": "retried exports whose bytes the previous run had spooled (its acknowledgement died in a crash): acknowledged, not stored twice",
    "insert_retries": "failed ClickHouse inserts that were retried",
    "spans_dropped": "spans lost: must stay 0",
    "spans_quarantined": "spooled spans this version cannot render (accepted by an older one), set aside in the spool's quarantine/",
    "writer_errors": "unexpected spool writer errors (it resumes from the last pending batch)",
    "tls_handshakes_failed": "OTLP/HTTP connections refused in the TLS handshake (plaintext, untrusted or missing client certificate)",
}


def _signal_help(signal: str, prefix: str, item: str) -> dict[str, str]:
    """The same counters as the spans', for the logs and metrics exports."""
    return {
        f"{prefix}requests_received": f"OTLP {signal} export requests accepted (acknowledged)",
        f"{item}_received": f"{item.replace('_', ' ')} accepted and durably spooled",
        f"{item}_written": f"{item.replace('_', ' ')} inserted into ClickHouse",
        f"{prefix}requests_rejected": f"OTLP {signal} export requests refused (bad input, auth)",
        f"{prefix}requests_retryable": f"OTLP {signal} export requests answered with a retryable code (spool full)",
        f"{prefix}requests_deduplicated": f"retried {signal} exports the previous run had spooled: not stored twice",
        f"{prefix}insert_retries": f"failed ClickHouse inserts of {signal} that were retried",
        f"{item}_quarantined": f"spooled {item.replace('_', ' ')} this version cannot render, in quarantine/",
        f"{prefix}writer_errors": f"unexpected {signal} spool writer errors (it resumes from the last pending batch)",
    }


_HELP |= _signal_help("logs", "logs_", "log_records") | _signal_help("metrics", "metrics_", "metric_points")


@dataclass(slots=True)
class CollectorMetrics:
    requests_received: int = 0
    spans_received: int = 0
    spans_written: int = 0
    requests_rejected: int = 0
    requests_retryable: int = 0
    requests_deduplicated: int = 0
    insert_retries: int = 0
    spans_dropped: int = 0
    spans_quarantined: int = 0
    writer_errors: int = 0
    tls_handshakes_failed: int = 0
    logs_requests_received: int = 0
    log_records_received: int = 0
    log_records_written: int = 0
    logs_requests_rejected: int = 0
    logs_requests_retryable: int = 0
    logs_requests_deduplicated: int = 0
    logs_insert_retries: int = 0
    log_records_quarantined: int = 0
    logs_writer_errors: int = 0
    metrics_requests_received: int = 0
    metric_points_received: int = 0
    metric_points_written: int = 0
    metrics_requests_rejected: int = 0
    metrics_requests_retryable: int = 0
    metrics_requests_deduplicated: int = 0
    metrics_insert_retries: int = 0
    metric_points_quarantined: int = 0
    metrics_writer_errors: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add(self, name: str, amount: int = 1) -> None:
        with self._lock:
            setattr(self, name, getattr(self, name) + amount)

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return {f.name: getattr(self, f.name) for f in fields(self) if not f.name.startswith("_")}

    def prometheus(self, spool_bytes: int) -> str:
        lines = []
        for name, value in self.snapshot().items():
            metric = f"{_PREFIX}{name}_total"
            lines += [f"# HELP {metric} {_HELP[name]}", f"# TYPE {metric} counter", f"{metric} {value}"]
        gauge = f"{_PREFIX}spool_bytes"
        lines += [
            f"# HELP {gauge} bytes spooled and not yet in ClickHouse",
            f"# TYPE {gauge} gauge",
            f"{gauge} {spool_bytes}",
        ]
        return "\n".join(lines) + "\n"
