"""`ServerTelemetry`: the one object a serving process holds (contract A).

    telemetry = ServerTelemetry()                 # or ServerTelemetry.from_env("my-server")
    app = telemetry.asgi(app)                     # stamps received/responded, extracts traceparent
    req = telemetry.request(scope)                # observer.RequestObserver + describe/complete/fail
    engine = Engine(step_observer=telemetry.step_observer)
    telemetry.stats(); telemetry.shutdown()

The loop thread only stamps integers into the handle; finished handles and engine steps become
spans and GenAI metrics off it, in one of two places (`builder=`, default "thread"; for `from_env`
PHASELENS_SPAN_BUILDER, default "process"):

- "thread": a background `SpanBuilder` thread in this process. The SERVER root span is
  started when the request is received (on the event-loop thread, outside the engine) so that its
  SpanContext is known for the child spans and the `llm.engine_step` links; the builder ends it.
- "process": the records are shipped as bytes to a span-builder child process (see
  `phaselens.instrumentation.shipper`), so the ~1 ms of SDK work per request no longer holds this
  process's GIL. At receipt only the sampling decision and the root ids are made here; the child
  starts the SERVER span with those ids and exports with its own providers, configured from the
  same OTEL_* environment (the providers given here only lend their sampler and id generator).
"""

from __future__ import annotations

import os
import time
from typing import Any, MutableMapping

from opentelemetry import metrics, propagate, trace
from opentelemetry.metrics import MeterProvider
from opentelemetry.trace import SpanKind, TracerProvider

from . import names
from .builder import BuildOptions, SpanBuilder
from .genai_metrics import GenAiServerMetrics
from .clock import ClockAnchor, ClockNs, process_anchor
from .handle import RequestHandle
from .otel_setup import export_counters
from .shipper import ProcessSpanBuilder, RootDecider, ShippedRequestHandle
from .timeline import BoundedHandOff, StepRecorder

SCOPE_KEY = "phaselens.request"  # where the middleware leaves the handle in the ASGI scope
DEFAULT_QUEUE_CAPACITY = 8192
DEFAULT_SERVICE_NAME = "phaselens-server"
BUILDER_THREAD, BUILDER_PROCESS = "thread", "process"


def env_flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")


def _headers(scope: MutableMapping[str, Any]) -> dict[str, str]:
    """ASGI headers as a carrier for the propagator (lower-case names; repeated ones joined)."""
    carrier: dict[str, str] = {}
    for raw_name, raw_value in scope.get("headers") or ():
        name, value = raw_name.decode("latin-1").lower(), raw_value.decode("latin-1")
        carrier[name] = f"{carrier[name]},{value}" if name in carrier else value
    return carrier


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

    def __init__(self, tracer_provider: TracerProvider | None = None,
                 meter_provider: MeterProvider | None = None, *,
                 clock_ns: ClockNs = time.monotonic_ns, anchor: ClockAnchor | None = None,
                 queue_capacity: int = DEFAULT_QUEUE_CAPACITY, capture_content: bool | None = None,
                 token_events: bool | None = None, poll_interval_s: float = 0.02,
                 engine_grace_s: float = 5.0, owns_providers: bool = False, builder: str = BUILDER_THREAD,
                 service_name: str = DEFAULT_SERVICE_NAME) -> None:
        if builder not in (BUILDER_THREAD, BUILDER_PROCESS):
            raise ValueError(f"builder={builder!r}: expected {BUILDER_THREAD!r} or {BUILDER_PROCESS!r}")
        self.tracer_provider = tracer_provider or trace.get_tracer_provider()
        self.meter_provider = meter_provider or metrics.get_meter_provider()
        self.clock_ns = clock_ns
        self.anchor = anchor or (process_anchor() if clock_ns is time.monotonic_ns
                                 else ClockAnchor.capture(clock_ns))
        self.capture_content = env_flag(names.ENV_CAPTURE_CONTENT) if capture_content is None else capture_content
        self._tracer = self.tracer_provider.get_tracer(names.SERVER_SCOPE)
        self._requests = BoundedHandOff(queue_capacity)
        self._steps = BoundedHandOff(queue_capacity)
        self.step_observer = StepRecorder(self._steps)
        options = BuildOptions(
            token_events=env_flag(names.ENV_TOKEN_EVENTS) if token_events is None else token_events,
            engine_grace_ns=int(engine_grace_s * 1e9))
        self.builder = builder
        self._roots = RootDecider(self.tracer_provider) if builder == BUILDER_PROCESS else None
        if self._roots is not None:
            self._builder = ProcessSpanBuilder(service_name, self.anchor, self.clock_ns, self._requests,
                                               self._steps, options, poll_interval_s)
        else:
            genai_metrics = GenAiServerMetrics(self.meter_provider, self._drop_counts)
            self._builder = SpanBuilder(self._tracer, genai_metrics, self.anchor, self.clock_ns,
                                        self._requests, self._steps, options, poll_interval_s)
        self._owns_providers = owns_providers
        self._shut_down = False
        self._builder.start()

    @classmethod
    def from_env(cls, service_name: str, **kwargs: Any) -> "ServerTelemetry":
        """Providers from the standard OTEL_* variables (otel_setup.configure), owned by this object;
        the span builder from PHASELENS_SPAN_BUILDER (thread | process; default process: ~1 ms of SDK
        work per request off this process's GIL, see benchmarks/instrumentation_overhead.py) unless
        `builder=` is given."""
        from .otel_setup import configure

        kwargs.setdefault("builder", os.environ.get(names.ENV_SPAN_BUILDER, "").strip().lower() or BUILDER_PROCESS)
        providers = configure(service_name)
        return cls(providers.tracer_provider, providers.meter_provider, owns_providers=True,
                   service_name=service_name, **kwargs)

    # --- per request -----------------------------------------------------------------------------
    def asgi(self, app: Any) -> Any:
        """Wrap an ASGI app with the ingress middleware (see phaselens.instrumentation.asgi)."""
        from .asgi import IngressMiddleware

        return IngressMiddleware(app, self)

    def request(self, scope: MutableMapping[str, Any]) -> RequestHandle:
        """The handle the middleware made for this scope; without middleware one is made and
        stamped `received` now, and `complete()`/`fail()` close it."""
        handle = scope.get(SCOPE_KEY)
        if handle is None:
            handle = self.open_request(scope, managed=False)
        return handle

    def open_request(self, scope: MutableMapping[str, Any], *, managed: bool,
                     received_ns: int | None = None) -> RequestHandle:
        """Stamp `received`, start the SERVER root span (child of an incoming traceparent) and leave
        the handle in the scope. The sampling decision is taken here, once, for the whole request."""
        received_ns = self.clock_ns() if received_ns is None else received_ns
        parent = propagate.extract(_headers(scope))
        method = scope.get("method", "")
        if self._roots is not None:
            span, make_handle = self._roots.root(parent, method or "request"), ShippedRequestHandle
        else:
            span = self._tracer.start_span(method or "request", context=parent, kind=SpanKind.SERVER,
                                           start_time=self.anchor.to_wall_ns(received_ns))
            make_handle = RequestHandle
        handle = make_handle(span, self._requests.offer, capture_content=self.capture_content, parent=parent,
                             clock_ns=self.clock_ns, received_ns=received_ns, managed=managed)
        http = handle.http
        http.method, http.path = method, scope.get("path", "")
        server = scope.get("server")
        if server:
            http.server_address, http.server_port = server[0], server[1]
        scope[SCOPE_KEY] = handle
        return handle

    # --- process ---------------------------------------------------------------------------------
    @property
    def span_builder_pid(self) -> int | None:
        """The span-builder process's pid (builder="process"), else None."""
        return getattr(self._builder, "pid", None)

    def stats(self) -> dict[str, int]:
        """Counters. `requests_dropped`/`steps_dropped`: records lost at the hand-off (queue full);
        `spans_dropped`: spans lost anywhere (step records dropped, build errors, export queue full,
        failed exports, records lost on the way to a span-builder process); `spans_built`: spans ended
        by the builder; `export_*`: see otel_setup. Process builder only: `records_shipped`,
        `bytes_shipped`, `channel_dropped` (child dead or pipe broken), `channel_lost` (shipped, never
        received by a child that died), `encode_errors`, `shipper_cpu_ns`,
        `child_alive`, `child_restarts` (a dead child is replaced at the next shipment, then at most
        once per backoff), `child_cpu_ns`, and the children's counters as of their last reports
        (every 0.5 s and at each flush), summed over the children that died."""
        counters = {
            "requests_offered": self._requests.offered,
            "requests_dropped": self._requests.dropped,
            "steps_offered": self._steps.offered,
            "steps_dropped": self._steps.dropped,
            "queue_full": self._requests.dropped + self._steps.dropped,  # hand-off refusals
            "queued": len(self._requests) + len(self._steps),
            **export_counters(self.tracer_provider),
            **self._builder.counters(),  # the span-builder process's export counters win
        }
        # Losses of any kind (a dropped request record loses its whole span tree): never silent.
        counters["spans_dropped"] = (counters["requests_dropped"] + counters["steps_dropped"]
                                     + counters["build_errors"] + counters.get("decode_errors", 0)
                                     + counters["export_dropped"] + counters["export_failed"]
                                     + counters.get("channel_dropped", 0) + counters.get("channel_lost", 0)
                                     + counters.get("encode_errors", 0))
        return counters

    def _drop_counts(self) -> dict[str, int]:
        """Losses by reason, for the phaselens.telemetry.dropped counter."""
        exported = export_counters(self.tracer_provider)
        return {"request_handoff_full": self._requests.dropped, "step_handoff_full": self._steps.dropped,
                "build_error": self._builder.counters()["build_errors"],
                "export_queue_full": exported["export_dropped"], "export_failed": exported["export_failed"]}

    def flush(self, timeout_s: float = 10.0) -> bool:
        """Wait until every handed-off record is built into spans (not exported)."""
        return self._builder.flush(timeout_s)

    def shutdown(self, timeout_s: float = 10.0) -> None:
        """Flush the span builder, stop it, then flush (or shut down, when owned) the providers."""
        if self._shut_down:
            return
        self._shut_down = True
        self._builder.stop(timeout_s)
        self._requests.close()  # records arriving from now on are counted as dropped
        self._steps.close()
        for provider in (self.tracer_provider, self.meter_provider):
            action = getattr(provider, "shutdown" if self._owns_providers else "force_flush", None)
            if action is not None:
                action()
