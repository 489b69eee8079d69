"""Losses, summed in one place: never drop a span silently, count it.

A sink's `counters()` reports every count of its records' way (hand-off, shipping, building,
exporting). Here the loss counts are named once, with the reason the `phaselens.telemetry.dropped`
metric gives them, and summed into `spans_dropped` (a lost request record loses its whole span tree,
so this counts records and spans alike: "something that should have been exported was not").
"""

from __future__ import annotations

# counter → reason on the phaselens.telemetry.dropped metric
LOSSES = {
    "requests_dropped": "request_handoff_full",  # the sink's bounded hand-off was full (or stopped)
    "steps_dropped": "step_handoff_full",
    "encode_errors": "encode_error",  # a record the process pipe could not carry
    "channel_dropped": "channel_dropped",  # past the retention bound before a span-builder process got it
    "channel_lost": "channel_lost",  # past the bound, and its span-builder process died before exporting it
    "decode_errors": "decode_error",
    "build_errors": "build_error",
    "export_dropped": "export_queue_full",
    "export_failed": "export_failed",
}


def drop_reasons(counters: dict[str, int]) -> dict[str, int]:
    """Loss counts by metric reason (zeros included: a counter series starts at 0)."""
    return {reason: counters.get(name, 0) for name, reason in LOSSES.items()}


def with_losses(counters: dict[str, int]) -> dict[str, int]:
    """`counters` plus `spans_dropped` = Σ of the LOSSES counters."""
    return {**counters, "spans_dropped": sum(counters.get(name, 0) for name in LOSSES)}
