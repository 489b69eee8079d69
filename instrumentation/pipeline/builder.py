"""The span builder: records in, spans and GenAI metrics out. The only one, in either sink.

`SpanBuilder.build(record)` runs on the thread of whichever sink feeds it (`sink.ThreadSink` in the
serving process, the span-builder process behind `shipper.ProcessSink`): phases from the frozen
timeline, the GenAI histograms (every request, sampled or not), and its spans, described once
(`spans.SpanData`): the full tree where `sampling.TailRule` keeps it (the head sampler's decision,
or the tail rule's), else the request's compact record alone; both handed to a backend: SDK ReadableSpans for the
provider's processors (`emitter.SpanEmitter`), or OTLP bytes for phaselens's own export
(`otlp_fast.FastEmitter`, where phaselens owns the provider). A failure while
building is counted, never raised. `counters()` also reads the export counts of the provider the
spans go to, so a sink's counters are the whole story of its records.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from opentelemetry.trace import TraceFlags

from phaselens.instrumentation import names
from phaselens.instrumentation.hotpath.clock import ClockAnchor
from phaselens.instrumentation.hotpath.records import Record, RequestRecord
from phaselens.instrumentation.pipeline.genai_metrics import GenAiServerMetrics
from phaselens.instrumentation.pipeline.otel_setup import export_counters
from phaselens.instrumentation.pipeline.phases import Phases, compute_phases
from phaselens.instrumentation.pipeline.sampling import TailRule
from phaselens.instrumentation.pipeline.spans import (
    NS_PER_MS,
    PackedStep,
    SpanBackend,
    error_type,
    output_tokens,
    tpot_ns,
)

_logger = logging.getLogger(__name__)
SAMPLED = int(TraceFlags.SAMPLED)

COUNTERS = ("requests_built", "requests_unsampled", "requests_tail", "steps_built", "steps_unsampled", "build_errors")


class SpanBuilder:
    """Builds records one at a time on the caller's thread; not thread-safe (one sink thread calls it)."""

    def __init__(
        self,
        emitter: SpanBackend | None,
        metrics: GenAiServerMetrics,
        anchor: ClockAnchor,
        tracer_provider: Any,
        token_events: bool,
        tail: TailRule | None = None,
    ) -> None:
        self._emitter = emitter  # None: nothing to emit to, every record is unsampled
        self._tail = TailRule.from_env() if tail is None else tail
        self._metrics = metrics
        self._anchor = anchor
        self._tracer_provider = tracer_provider
        self._token_events = token_events
        self._counts = dict.fromkeys(COUNTERS, 0)

    def build(self, record: Record | PackedStep) -> None:
        if isinstance(record, RequestRecord):
            self.build_request(record)
        else:
            self.build_steps((record,))

    def build_request(self, record: RequestRecord) -> None:
        """`build` for a request (the span-builder process knows the kind from the frame: no check)."""
        try:
            phases = compute_phases(record)
            self._metrics.record(record, phases)
            emitter = self._emitter
            if emitter is None:
                self._counts["requests_unsampled"] += 1
                return
            full = self._full(record, phases)
            if not record.sampled:  # exported all the same: as the compact record, or kept by the tail rule
                record = record._replace(root=record.root._replace(trace_flags=record.root.trace_flags | SAMPLED))
            if full == names.TRACE_FULL_NONE:
                emitter.emit_compact(self._anchor, record, phases)
                self._counts["requests_unsampled"] += 1
                return
            emitter.emit_request(self._anchor, record, phases, self._token_events, full)
            self._counts["requests_built"] += 1
            self._counts["requests_tail"] += full != names.TRACE_FULL_HEAD
        except Exception:  # noqa: BLE001 — telemetry must never take the server down; counted, the first logged
            self._failed()

    def _full(self, record: RequestRecord, phases: Phases) -> str:
        """Why the request keeps its full tree (`sampling.TailRule.full`), from the server's own TTFT and TPOT."""
        if record.sampled:  # the head's decision comes first (TailRule.full): no value of the request is read
            return names.TRACE_FULL_HEAD
        ttft_ms = phases.ttft_ns / NS_PER_MS if phases.first_token_ts else None
        tpot = tpot_ns(phases, output_tokens(record, phases))
        tpot_ms = None if tpot is None else tpot / NS_PER_MS
        return self._tail.full(record.sampled, error_type(record) is not None, ttft_ms, tpot_ms)

    def build_steps(self, steps: Sequence[PackedStep]) -> None:
        """`build` for steps, from the thread sink or a run of step frames in the span-builder
        process's pipe. A failure builds them again one at a time: each lost one counted once, as
        alone (nothing was offered before it: the run's spans are offered together)."""
        emitter = self._emitter
        if emitter is None:
            self._counts["steps_unsampled"] += len(steps)
            return
        try:
            built = emitter.emit_steps(self._anchor, steps)
        except Exception:  # noqa: BLE001 — as in build_request
            if len(steps) == 1:
                self._failed()
                return
            for step in steps:
                self.build_steps((step,))
            return
        self._counts["steps_built"] += built
        self._counts["steps_unsampled"] += len(steps) - built

    def _failed(self) -> None:
        self._counts["build_errors"] += 1
        if self._counts["build_errors"] == 1:
            _logger.exception("phaselens: building spans failed (counted in build_errors)")

    def counters(self) -> dict[str, int]:
        emitted = self._emitter.emitted if self._emitter is not None else 0
        return {**self._counts, "spans_built": emitted, **export_counters(self._tracer_provider)}
