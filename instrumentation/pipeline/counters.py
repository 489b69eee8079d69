"""Every count of a record's way, declared once: never drop a span silently, count it.

`Counters` is the one list of keys. Each part of the pipeline counts its own fields (the sink's
hand-off, the builder, the exporter, the process shipper and its child) and `Counters.total` sums
the parts; `ServerTelemetry.stats()` returns the total. A count that is not a field here is a
`KeyError`, so a new counter cannot exist without its line below.

The loss counts carry the reason the `phaselens.telemetry.dropped` metric gives them (`LOSSES`) and
are summed into `spans_dropped` (a lost request record loses its whole span tree, so this counts
records and spans alike: "something that should have been exported was not").
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, fields


@dataclass(slots=True)
class Counters:
    # the sink's bounded hand-off (loop → builder)
    requests_offered: int = 0
    requests_dropped: int = 0  # the hand-off was full (or stopped)
    steps_offered: int = 0
    steps_dropped: int = 0
    queue_full: int = 0  # requests_dropped + steps_dropped
    queued: int = 0  # records waiting in the hand-off now
    requests_pending: int = 0  # closed, waiting for the engine to let go of them
    # the span builder
    requests_built: int = 0  # with their full tree
    requests_unsampled: int = 0  # their compact record alone (pipeline/sampling.py)
    requests_tail: int = 0  # of requests_built: kept by the tail rule, not the head sampler
    steps_built: int = 0
    steps_unsampled: int = 0
    spans_built: int = 0
    build_errors: int = 0
    # the span processors' exporters (pipeline/otel_setup.py)
    export_exported: int = 0
    export_failed: int = 0
    export_dropped: int = 0  # the export queue was full
    export_suppressed: int = 0
    # the process builder: the shipper in the serving process …
    records_shipped: int = 0
    bytes_shipped: int = 0  # replays included
    records_replayed: int = 0  # re-sent to a replacement child: what a dead one had not reported done
    channel_dropped: int = 0  # past the retention bound before any child got it
    channel_lost: int = 0  # past the bound, and its child died before reporting it
    encode_errors: int = 0  # a record the pipe could not carry
    shipper_cpu_ns: int = 0
    child_alive: int = 0
    child_restarts: int = 0
    spawn_errors: int = 0  # a replacement that could not start (e.g. EMFILE): retried after the backoff
    # … and its child, as of its last report, summed over the children that died
    records_received: int = 0
    records_safe: int = 0  # built and exported
    decode_errors: int = 0
    child_cpu_ns: int = 0
    # Σ of the LOSSES fields
    spans_dropped: int = 0

    @classmethod
    def total(cls, parts: Iterable[Mapping[str, int] | Counters]) -> Counters:
        """Field-wise sum of `parts` (Counters, or mappings whose keys must be fields), with
        `spans_dropped` = Σ LOSSES."""
        total = cls()
        for part in parts:
            items = asdict(part).items() if isinstance(part, Counters) else part.items()
            for key, value in items:
                if key not in KEYS:
                    raise KeyError(f"unknown counter {key!r}: declare it in Counters")
                setattr(total, key, getattr(total, key) + value)
        total.spans_dropped = sum(getattr(total, name) for name in LOSSES)
        return total

    def as_dict(self) -> dict[str, int]:
        return asdict(self)

    def drop_reasons(self) -> dict[str, int]:
        """Loss counts by metric reason (zeros included: a counter series starts at 0)."""
        return {reason: getattr(self, name) for name, reason in LOSSES.items()}


KEYS = frozenset(f.name for f in fields(Counters))

# counter → reason on the phaselens.telemetry.dropped metric
LOSSES = {
    "requests_dropped": "request_handoff_full",
    "steps_dropped": "step_handoff_full",
    "encode_errors": "encode_error",
    "channel_dropped": "channel_dropped",
    "channel_lost": "channel_lost",
    "decode_errors": "decode_error",
    "build_errors": "build_error",
    "export_dropped": "export_queue_full",
    "export_failed": "export_failed",
}
