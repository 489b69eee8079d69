"""`ServerTelemetry`: the one object a serving process holds (docs/contracts.md#request-handle).

    telemetry = ServerTelemetry()                 # or ServerTelemetry.from_env("my-server")
    app = telemetry.asgi(app)                     # stamps received/responded, extracts traceparent
    req = telemetry.request(scope)                # observer.RequestObserver + describe/complete/fail
    engine = Engine(step_observer=telemetry.step_observer)
    telemetry.stats(); telemetry.shutdown()

The loop thread only stamps integers into the handle. At receipt (event-loop thread, outside the
engine) the request's trace id, SERVER span id and sampling are decided once (`ids.RootDecider`);
closing it freezes it into a plain record (`record.RequestRecord`); engine steps become records
with their links as ids. Records go to a sink (`sink`) that builds their spans and GenAI metrics
off the loop, in one of two places (`builder=`, default "thread"; for `from_env`
PHASELENS_SPAN_BUILDER, default "process"):

- "thread": `sink.ThreadSink`, a background thread in this process, emitting through the given
  tracer provider's span processors.
- "process": `shipper.ProcessSink` ships the records as bytes to a span-builder child process, so
  the ~1 ms of SDK work per request no longer holds this process's GIL; the child exports with its
  own providers, configured from the same OTEL_* environment (the providers given here only lend
  their sampler and id generator to the decision at receipt).
"""

from __future__ import annotations

import os
import time
from collections.abc import MutableMapping
from typing import Any

from opentelemetry import metrics, trace
from opentelemetry.metrics import MeterProvider
from opentelemetry.sdk.trace.id_generator import RandomIdGenerator
from opentelemetry.trace import TracerProvider

from phaselens.common.clocks import MonoClock, MonoTs, monotonic_ts
from phaselens.common.env import env_flag
from phaselens.instrumentation import names
from phaselens.instrumentation.hotpath.clock import ClockAnchor, process_anchor
from phaselens.instrumentation.hotpath.handle import Closer, ServerRequest
from phaselens.instrumentation.hotpath.ids import RootDecider
from phaselens.instrumentation.hotpath.observer import RequestHandle
from phaselens.instrumentation.hotpath.records import HttpFacts
from phaselens.instrumentation.hotpath.timeline import StepRecorder
from phaselens.instrumentation.pipeline.builder import SpanBuilder
from phaselens.instrumentation.pipeline.counters import Counters
from phaselens.instrumentation.pipeline.emitter import SpanEmitter
from phaselens.instrumentation.pipeline.genai_metrics import GenAiServerMetrics
from phaselens.instrumentation.pipeline.sampling import TailRule, check_sampler_env
from phaselens.instrumentation.pipeline.sink import Sink, ThreadSink, wait_until
from phaselens.instrumentation.process.process_sink import ProcessSink
from phaselens.instrumentation.server.inbound import InboundStamps
from phaselens.instrumentation.server.incoming import IncomingExtractor

SCOPE_KEY = "phaselens.request"  # where the middleware leaves the handle in the ASGI scope
DEFAULT_QUEUE_CAPACITY = 8192
BUILDER_THREAD, BUILDER_PROCESS = "thread", "process"


class ServerTelemetry:
    """Server-side phaselens: request handles, step observer, span builder, GenAI metrics.

    Keyword options: `clock_ns` the monotonic clock the loop stamps with (the engine's own
    `prefill_chunk`/`step` times must come from the same clock; default time.monotonic_ns) and
    `anchor` its wall-clock anchor; `queue_capacity` records waiting for the builder, per kind,
    before drops; `capture_content` / `token_events` override the OTEL_INSTRUMENTATION_GENAI_
    CAPTURE_MESSAGE_CONTENT / PHASELENS_TOKEN_EVENTS switches; `poll_interval_s` the builder's
    idle poll; `engine_grace_s` how long a closed request waits for the engine's `finished`;
    `owns_providers` makes `shutdown()` shut the providers down instead of flushing them;
    `builder` "thread" or "process" (module docstring) and `service_name` the span-builder
    process's service name when OTEL_SERVICE_NAME does not set one.
    """

    def __init__(
        self,
        tracer_provider: TracerProvider | None = None,
        meter_provider: MeterProvider | None = None,
        *,
        clock_ns: MonoClock = monotonic_ts,
        anchor: ClockAnchor | None = None,
        queue_capacity: int = DEFAULT_QUEUE_CAPACITY,
        capture_content: bool | None = None,
        token_events: bool | None = None,
        poll_interval_s: float = 0.02,
        engine_grace_s: float = 5.0,
        owns_providers: bool = False,
        builder: str = BUILDER_THREAD,
        service_name: str = names.SERVER_SERVICE_NAME,
    ) -> None:
        if builder not in (BUILDER_THREAD, BUILDER_PROCESS):
            raise ValueError(f"builder={builder!r}: expected {BUILDER_THREAD!r} or {BUILDER_PROCESS!r}")
        self.tracer_provider = tracer_provider or trace.get_tracer_provider()
        self.meter_provider = meter_provider or metrics.get_meter_provider()
        self.clock_ns = clock_ns
        self.anchor = anchor or (process_anchor() if clock_ns is monotonic_ts else ClockAnchor.capture(clock_ns))
        self.capture_content = env_flag(names.ENV_CAPTURE_CONTENT) if capture_content is None else capture_content
        token_events = env_flag(names.ENV_TOKEN_EVENTS) if token_events is None else token_events
        self.builder = builder
        check_sampler_env()  # a bad sampler or tail threshold stops the server now, not its span builder later
        self._tail = TailRule.from_env()
        make_sink = self._process_sink if builder == BUILDER_PROCESS else self._thread_sink
        self._roots, self._sink = make_sink(service_name, token_events, queue_capacity, poll_interval_s)
        self._closer = Closer(self._sink.submit_request, clock_ns, int(engine_grace_s * 1e9))
        self.step_observer = StepRecorder(self._sink.submit_step)
        self._incoming = IncomingExtractor()
        self.inbound = InboundStamps(clock_ns)  # filled by an `inbound.InboundProtocol` when the server has one
        self._owns_providers = owns_providers
        self._shut_down = False
        self._sink.start()

    def _thread_sink(
        self, service_name: str, token_events: bool, capacity: int, poll_interval_s: float
    ) -> tuple[RootDecider, Sink]:
        """Spans built here and emitted through this provider's processors, with its sampler and ids
        (none of them when it is not an SDK provider: every request is then unsampled)."""
        emitter = SpanEmitter.of_provider(self.tracer_provider)
        roots = RootDecider(emitter.sampler, emitter.ids) if emitter else RootDecider(None, RandomIdGenerator())
        genai_metrics = GenAiServerMetrics(self.meter_provider, lambda: self.stats().drop_reasons())
        builder = SpanBuilder(emitter, genai_metrics, self.anchor, self.tracer_provider, token_events, self._tail)
        return roots, ThreadSink(builder, capacity, poll_interval_s, self._expire)

    def _process_sink(
        self, service_name: str, token_events: bool, capacity: int, poll_interval_s: float
    ) -> tuple[RootDecider, Sink]:
        """Spans built by the span-builder process; the decision at receipt uses this provider's
        sampler and ids, or OTEL_TRACES_SAMPLER's when it has none (the child reads the same)."""
        roots = RootDecider.of_provider(self.tracer_provider)
        return roots, ProcessSink(service_name, self.anchor, token_events, capacity, poll_interval_s, self._expire)

    @classmethod
    def from_env(cls, service_name: str, *, set_global: bool = True, **kwargs: Any) -> ServerTelemetry:
        """Providers from the standard OTEL_* variables (otel_setup.configure), owned by this object;
        the span builder from PHASELENS_SPAN_BUILDER (thread | process; default process: spans built
        off this process's GIL, by the child's fast backend unless PHASELENS_SPAN_BACKEND=sdk, see
        benchmarks/instrumentation_overhead.py) unless `builder=` is given. `set_global` False (a host
        that owns the global providers, as vLLM): the providers are this object's alone, so with the
        process builder they export nothing here (the child exports; no exporter thread wakes here)."""
        from phaselens.instrumentation.pipeline.otel_setup import configure

        builder = kwargs.setdefault(
            "builder", os.environ.get(names.ENV_SPAN_BUILDER, "").strip().lower() or BUILDER_PROCESS
        )
        providers = configure(service_name, set_global=set_global, exporters=set_global or builder != BUILDER_PROCESS)
        return cls(
            providers.tracer_provider,
            providers.meter_provider,
            owns_providers=True,
            service_name=service_name,
            **kwargs,
        )

    # --- per request -----------------------------------------------------------------------------
    def asgi(self, app: Any) -> Any:
        """Wrap an ASGI app with the ingress middleware (see phaselens.instrumentation.server.asgi)."""
        from phaselens.instrumentation.server.asgi import IngressMiddleware

        return IngressMiddleware(app, self)

    def request(self, scope: MutableMapping[str, Any]) -> RequestHandle:
        """The handle the middleware made for this scope; without middleware one is made and
        stamped `received` now, and `complete()`/`fail()` close it."""
        handle = scope.get(SCOPE_KEY)
        if handle is None:
            handle = self.open_request(scope, managed=False)
        return handle

    def open_request(
        self, scope: MutableMapping[str, Any], *, managed: bool, received_ts: MonoTs | None = None
    ) -> ServerRequest:
        """Stamp `received`, decide the request's ids and sampling (child of an incoming
        traceparent) and leave the handle in the scope."""
        received_ts = self.clock_ns() if received_ts is None else received_ts
        headers, incoming = self._incoming.extract(scope)
        method = scope.get("method", "")
        root, parent = self._roots.decide(incoming, method or "request")
        server = scope.get("server") or (None, None)
        x_request_id = headers.get(names.X_REQUEST_ID_HEADER, "")[: names.X_REQUEST_ID_MAX_CHARS] or None
        http = HttpFacts(method, scope.get("path", ""), server[0], server[1], x_request_id=x_request_id)
        handle = ServerRequest(
            root,
            parent,
            incoming,
            self._closer,
            http,
            capture_content=self.capture_content,
            clock_ns=self.clock_ns,
            received_ts=received_ts,
            managed=managed,
        )
        handle.arrived_ts, handle.read_ts = self.inbound.take(scope.get("client"))
        scope[SCOPE_KEY] = handle
        return handle

    def _expire(self) -> None:
        """At each wake-up of the sink's thread: requests the engine has let go of go on."""
        self._closer.expire()

    # --- process ---------------------------------------------------------------------------------
    @property
    def span_builder_pid(self) -> int | None:
        """The span-builder process's pid (builder="process"), else None."""
        return getattr(self._sink, "pid", None)

    def stats(self) -> Counters:
        """Counters, all from the sink (`sink.Sink.counters`) plus `requests_pending` (closed, waiting
        for the engine) and `spans_dropped` (every loss, `counters.LOSSES`). `requests_dropped` /
        `steps_dropped`: records lost at the hand-off (queue full, or after shutdown); `spans_built`:
        spans emitted by the builder; `export_*`: see otel_setup. Process builder only:
        `records_shipped`, `bytes_shipped` (replays included), `records_replayed` (re-sent to a
        replacement child: what a dead one had not reported built and exported), `channel_dropped`
        (past the retention bound before any child got it), `channel_lost` (past the bound, and its
        child died before reporting it), `encode_errors`, `shipper_cpu_ns`, `child_alive`,
        `child_restarts` (a dead child is replaced at the shipper's next wake-up, then at most once per
        backoff), `spawn_errors` (a replacement that could not be started, e.g. EMFILE: what it would
        get stays kept and the start is tried again after the backoff), `child_cpu_ns`, `records_received`, `records_safe` (built and exported, as the
        children reported), `decode_errors`, and the children's counters as of their last reports
        (at every checkpoint and at each flush), summed over the children that died."""
        return Counters.total([self._sink.counters(), {"requests_pending": len(self._closer)}])

    def flush(self, timeout_s: float = 10.0) -> bool:
        """Wait until every closed request and every step so far is built into spans (for the
        process builder: also exported); a request still waiting for the engine is waited for."""
        deadline = time.monotonic() + timeout_s
        if not wait_until(lambda: not len(self._closer), timeout_s, self._closer.expire):
            return False
        return self._sink.flush(max(0.0, deadline - time.monotonic()))

    def shutdown(self, timeout_s: float = 10.0) -> None:
        """Hand on every closed request (without waiting for the engine), stop the sink, then flush
        (or shut down, when owned) the providers. Records arriving later are counted as dropped."""
        if self._shut_down:
            return
        self._shut_down = True
        self._closer.expire(force=True)
        self._sink.stop(timeout_s)
        for provider in (self.tracer_provider, self.meter_provider):
            action = getattr(provider, "shutdown" if self._owns_providers else "force_flush", None)
            if action is not None:
                action()
