"""GenAI semconv server histograms (seconds, buckets: docs/span-model.md#metrics), recorded by the builder for every
request, sampled or not (sampling thins traces, never metrics): the SDK's instruments, or where phaselens
owns the MeterProvider, its own aggregation (`histograms.OwnedHistograms`, the same points)."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

from opentelemetry.metrics import CallbackOptions, Meter, MeterProvider, Observation

from phaselens.instrumentation import names
from phaselens.instrumentation.hotpath.records import RequestRecord
from phaselens.instrumentation.pipeline.histograms import HistogramReader, OwnedHistograms, RequestValues
from phaselens.instrumentation.pipeline.phases import Phases
from phaselens.instrumentation.pipeline.spans import NS_PER_S, error_type, output_tokens, tpot_ns

HISTOGRAMS = (  # name, unit, description, bucket bounds
    (names.METRIC_SERVER_TTFT, "s", "Time to generate the first token (server).", names.BUCKETS_TTFT_S),
    (names.METRIC_SERVER_TPOT, "s", "Time per output token after the first (server).", names.BUCKETS_TPOT_S),
    (
        names.METRIC_SERVER_REQUEST_DURATION,
        "s",
        "Request received → response closed (server).",
        names.BUCKETS_DURATION_S,
    ),
)


class SdkHistograms:
    """The three histograms as the SDK's instruments (a provider phaselens does not own)."""

    __slots__ = ("histograms",)

    def __init__(self, meter: Meter) -> None:
        self.histograms = [
            meter.create_histogram(name, unit=unit, description=text, explicit_bucket_boundaries_advisory=list(bounds))
            for name, unit, text, bounds in HISTOGRAMS
        ]

    def record(self, values: RequestValues, attributes: dict[str, Any], duration_attributes: dict[str, Any]) -> None:
        ttft, tpot, duration = self.histograms
        if values[0] is not None:
            ttft.record(values[0], attributes)
        if values[1] is not None:
            tpot.record(values[1], attributes)
        duration.record(values[2], duration_attributes)


class GenAiServerMetrics:
    """gen_ai.server.time_to_first_token, .time_per_output_token, .request.duration, and the
    `phaselens.telemetry.dropped` counter fed from `drop_counts()`. `owned`: the readers of a
    provider phaselens made (`otel_setup.Providers.histogram_readers`), which then aggregate the
    histograms; None: the SDK's instruments."""

    __slots__ = ("_drop_counts", "_histograms", "_recorded")

    def __init__(
        self,
        meter_provider: MeterProvider,
        drop_counts: Callable[[], dict[str, int]],
        owned: Sequence[HistogramReader] | None = None,
    ) -> None:
        meter = meter_provider.get_meter(names.SERVER_SCOPE)
        self._histograms: SdkHistograms | OwnedHistograms = (
            OwnedHistograms(owned, HISTOGRAMS) if owned is not None else SdkHistograms(meter)
        )
        self._recorded = owned is None or len(owned) > 0  # owned, no reader (metrics off): nothing to record into
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
        """TTFT and TPOT (when there was a first token, and for TPOT a second), and the duration
        (with `error.type` when the request failed); nothing where no reader would export them."""
        if not self._recorded:
            return
        attributes = metric_attributes(record)
        failure = error_type(record)
        ttft = tpot = None
        if phases.first_token_ts:
            ttft = phases.ttft_ns / NS_PER_S
            tpot_of_request = tpot_ns(phases, output_tokens(record, phases))
            tpot = tpot_of_request / NS_PER_S if tpot_of_request is not None else None
        duration_attributes = {**attributes, names.ERROR_TYPE: failure} if failure else attributes
        self._histograms.record((ttft, tpot, phases.e2e_ns / NS_PER_S), attributes, duration_attributes)


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
