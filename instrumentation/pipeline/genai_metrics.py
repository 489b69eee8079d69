"""GenAI semconv server histograms (seconds, buckets: docs/span-model.md#metrics), recorded by the builder for every
request, sampled or not (sampling thins traces, never metrics)."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from opentelemetry.metrics import CallbackOptions, MeterProvider, Observation

from phaselens.instrumentation import names
from phaselens.instrumentation.hotpath.records import RequestRecord
from phaselens.instrumentation.pipeline.phases import Phases
from phaselens.instrumentation.pipeline.spans import NS_PER_S, error_type, output_tokens, tpot_ns


class GenAiServerMetrics:
    """gen_ai.server.time_to_first_token, .time_per_output_token, .request.duration, and the
    `phaselens.telemetry.dropped` counter fed from `drop_counts()`."""

    __slots__ = ("_drop_counts", "_duration", "_tpot", "_ttft")

    def __init__(self, meter_provider: MeterProvider, drop_counts: Callable[[], dict[str, int]]) -> None:
        meter = meter_provider.get_meter(names.SERVER_SCOPE)
        self._ttft = meter.create_histogram(
            names.METRIC_SERVER_TTFT,
            unit="s",
            description="Time to generate the first token (server).",
            explicit_bucket_boundaries_advisory=list(names.BUCKETS_TTFT_S),
        )
        self._tpot = meter.create_histogram(
            names.METRIC_SERVER_TPOT,
            unit="s",
            description="Time per output token after the first (server).",
            explicit_bucket_boundaries_advisory=list(names.BUCKETS_TPOT_S),
        )
        self._duration = meter.create_histogram(
            names.METRIC_SERVER_REQUEST_DURATION,
            unit="s",
            description="Request received → response closed (server).",
            explicit_bucket_boundaries_advisory=list(names.BUCKETS_DURATION_S),
        )
        self._drop_counts = drop_counts
        meter.create_observable_counter(
            names.METRIC_TELEMETRY_DROPPED,
            callbacks=[self._observe_drops],
            unit="{item}",
            description="Telemetry records or spans phaselens lost.",
        )

    def _observe_drops(self, options: CallbackOptions) -> Iterable[Observation]:
        return [
            Observation(count, {names.PL_TELEMETRY_DROP_REASON: reason})
            for reason, count in self._drop_counts().items()
        ]

    def record(self, record: RequestRecord, phases: Phases) -> None:
        attributes = metric_attributes(record)
        failure = error_type(record)
        if phases.first_token_ts:
            self._ttft.record(phases.ttft_ns / NS_PER_S, attributes)
            tpot = tpot_ns(phases, output_tokens(record, phases))
            if tpot is not None:
                self._tpot.record(tpot / NS_PER_S, attributes)
        if failure:
            attributes = {**attributes, names.ERROR_TYPE: failure}
        self._duration.record(phases.e2e_ns / NS_PER_S, attributes)


def metric_attributes(record: RequestRecord) -> dict[str, Any]:
    attributes: dict[str, Any] = {names.GEN_AI_PROVIDER_NAME: names.PROVIDER_PHASELENS}
    if record.info is not None:
        attributes[names.GEN_AI_OPERATION_NAME] = record.info.operation
        attributes[names.GEN_AI_REQUEST_MODEL] = record.info.model
        attributes[names.GEN_AI_RESPONSE_MODEL] = record.info.model
    if record.http.server_address is not None:
        attributes[names.SERVER_ADDRESS] = record.http.server_address
        attributes[names.SERVER_PORT] = record.http.server_port
    return attributes
