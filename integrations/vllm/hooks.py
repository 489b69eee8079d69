"""The wrappers around vLLM's `OutputProcessor` and `RequestOutputCollector` (API-server process)
and the one tracker they feed. Each wrapper calls vLLM's own method unchanged (except `do_tracing`,
below) and only adds integer stamps (and drops a claimed request's trace headers, below); a failure
in phaselens's part is logged once and never reaches vLLM.

    process_outputs(outputs, timestamp, iteration_stats)  before: which requests are in the batch;
                                                           after: first-token / token stamps
                                                           (`_outputs.BatchHook` on `tracker.batch`,
                                                           C: Python only for a request's first sight)
    do_tracing(output, req_state, iteration_stats)         the request finished: EngineCore stamps,
                                                           description, usage → the span builder.
                                                           vLLM's own `llm_request` span is NOT made:
                                                           the phaselens SERVER span replaces it and
                                                           carries the same gen_ai.latency.* keys
    update_scheduler_stats(scheduler_stats)                once per EngineCore output batch: one step
                                                           (`_outputs.BatchHook`, C; its KV records
                                                           and the sweep in Python when due)
    add_request(request, ...)                              in the HTTP request's task: the delivery
                                                           middleware's handle (`delivery.py`) becomes
                                                           the request's, and the request goes on to
                                                           the EngineCore without its trace headers
                                                           (the handle holds the context; vLLM would
                                                           send them back with every output)
    RequestOutputCollector.get / get_nowait                the request's task took output: output
                                                           that renders text stamps `output_ready`
                                                           (`_outputs.c`: `get` returns vLLM's coroutine
                                                           wrapped in a C awaitable, no coroutine of
                                                           ours per output)
"""

from __future__ import annotations

import atexit
import functools
import logging
import os
import sys
from collections.abc import Callable
from typing import Any

from phaselens.instrumentation import names

from ._outputs import OUTPUTS_HOOK, STATS_HOOK, BatchHook, CollectorHook
from .http_request import HTTP_REQUEST, MIDDLEWARE_PATH
from .tracker import VllmTracker

_logger = logging.getLogger("vllm.phaselens")  # vLLM's handlers print it in its log format
MARK = "__phaselens_wrapped__"
TRACES_PROTOCOL = "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"
_warned: set[str] = set()  # what was logged already: one line each per process


def served_model_name(argv: list[str]) -> str:
    """The first `--served-model-name`, else `--model`, else `vllm serve MODEL`'s positional model
    (the name vLLM answers to; the output processor does not know it)."""
    for flag in ("--served-model-name", "--model"):
        for i, arg in enumerate(argv[:-1]):
            if arg == flag:
                return argv[i + 1]
            if arg.startswith(flag + "="):
                return arg.split("=", 1)[1]
    if "serve" in argv:
        rest = argv[argv.index("serve") + 1 :]
        if rest and not rest[0].startswith("-"):
            return rest[0]
    return "vllm"


@functools.cache
def tracker() -> VllmTracker:
    """This process's tracker and its ServerTelemetry, made on first use: only the API server
    processes outputs, so the EngineCore and workers never start a span builder."""
    from phaselens.instrumentation import ServerTelemetry

    # vLLM put --otlp-traces-endpoint into OTEL_EXPORTER_OTLP_TRACES_ENDPOINT and exports to it
    # over gRPC unless this variable says otherwise; phaselens's own default is http/protobuf.
    if os.environ.setdefault(TRACES_PROTOCOL, "grpc") == "grpc":
        _logger.info(
            "phaselens: spans leave over OTLP/gRPC (grpcio), which costs the span-builder child more CPU a "
            "request than OTLP/HTTP: set %s=http/protobuf and --otlp-traces-endpoint http://HOST:4318/v1/traces "
            "(docs/vllm.md#cost)",
            TRACES_PROTOCOL,
        )
    # vLLM's providers are the process's global ones: ours stay private, and export nothing here
    telemetry = ServerTelemetry.from_env(
        os.environ.get("OTEL_SERVICE_NAME") or names.VLLM_SERVICE_NAME, set_global=False
    )
    atexit.register(telemetry.shutdown)
    if MIDDLEWARE_PATH not in " ".join(sys.argv):
        _logger.warning(
            "phaselens: the first chunk's delivery is not observed (first_chunk_ms unobserved, in the residual): "
            "start vLLM with --middleware %s",
            MIDDLEWARE_PATH,
        )
    return VllmTracker(telemetry, served_model_name(sys.argv))


def _warn_once(key: str, message: str) -> None:
    if key not in _warned:
        _warned.add(key)
        _logger.warning(message)


def _failed(what: str, exc: BaseException | None = None) -> None:
    """Phaselens's part of hook `what` raised `exc` (None: called in its `except`): logged once, vLLM
    goes on."""
    if what not in _warned:
        _warned.add(what)
        _logger.error("phaselens: the %s hook failed; vLLM keeps serving (logged once)", what, exc_info=exc or True)


def _guard(what: str, fn: Callable, *args: Any) -> Any:
    """Run phaselens's part; on an exception log it once per hook and go on serving. (The hooks run
    per output or step are C, `_outputs.c`, and hand their exceptions to `_failed` themselves.)"""
    try:
        return fn(*args)
    except Exception:  # noqa: BLE001 — logged once by _failed; vLLM serves on
        _failed(what)
        return None


def _untraced() -> None:
    # vLLM drops traceparent and never calls do_tracing without tracing on
    _warn_once(
        "untraced", "phaselens: no spans from this vLLM: start it with --otlp-traces-endpoint URL to turn tracing on"
    )


def _process_outputs(original: Callable) -> Callable:
    """vLLM's `process_outputs`, the batch noted before it and its tokens stamped after it by the
    tracker's batch (C: `_outputs.BatchHook`, no frame of ours per output batch)."""
    return BatchHook(OUTPUTS_HOOK, original, globals(), _untraced, functools.partial(_failed, "process_outputs"))


def _do_tracing(original: Callable) -> Callable:
    @functools.wraps(original)
    def do_tracing(self, engine_core_output, req_state, iteration_stats):
        _guard("do_tracing", tracker().finished, req_state, engine_core_output.finish_reason)

    return do_tracing


def _update_scheduler_stats(original: Callable) -> Callable:
    """vLLM's `update_scheduler_stats`, then the batch's engine step recorded (C: `_outputs.BatchHook`),
    and the tracker's `step_work` when the step leaves it some."""
    return BatchHook(STATS_HOOK, original, globals(), _untraced, functools.partial(_failed, "update_scheduler_stats"))


def http_done(handle: Any) -> None:
    """The delivery middleware's request ended: see VllmTracker.http_done (never raises)."""
    _guard("http_done", tracker().http_done, handle)


def _add_request(original: Callable) -> Callable:
    @functools.wraps(original)
    def add_request(self, request, *args, **kwargs):
        result = original(self, request, *args, **kwargs)
        handle = HTTP_REQUEST.get()
        claimed = handle is not None and self.tracing_enabled
        if claimed and _guard("add_request", tracker().claim, request.request_id, handle, self.request_states):
            # the handle has the trace context: without this the EngineCore echoes the headers in
            # every output of the request (msgpack both ways, a dict decoded per output here)
            request.trace_headers = None
        return result

    return add_request


def _collector_get(original: Callable) -> Callable:
    """vLLM's `get`, its coroutine awaited through `Taking` in an HTTP request the middleware opened:
    the output it returns is `output_taken` (the context is the request's task's, before and after
    the await alike). A C method descriptor (`_outputs.CollectorHook`): no frame of ours per call."""
    return CollectorHook(original, HTTP_REQUEST, functools.partial(_failed, "output_ready"), True)


def _collector_get_nowait(original: Callable) -> Callable:
    """vLLM's `get_nowait`; output it returns in an HTTP request the middleware opened is
    `output_taken` (vLLM tries it before each `await get()`: mostly nothing there, passed at once)."""
    return CollectorHook(original, HTTP_REQUEST, functools.partial(_failed, "output_ready"), False)


WRAPPERS = {
    "process_outputs": _process_outputs,
    "do_tracing": _do_tracing,
    "update_scheduler_stats": _update_scheduler_stats,
    "add_request": _add_request,
}
COLLECTOR_WRAPPERS = {"get": _collector_get, "get_nowait": _collector_get_nowait}
_installed: list[type] = []  # the classes wrapped in this process


def installed() -> bool:
    """Whether this process's OutputProcessor is wrapped (the plugin loaded and vLLM is supported)."""
    return bool(_installed)


def install(output_processor_cls: type, collector_cls: type) -> None:
    """Wrap the methods once (a second call, e.g. a second plugin load, changes nothing)."""
    for cls, wrappers in ((output_processor_cls, WRAPPERS), (collector_cls, COLLECTOR_WRAPPERS)):
        if getattr(cls, MARK, False):
            continue
        for name, wrap in wrappers.items():
            setattr(cls, name, wrap(getattr(cls, name)))
        setattr(cls, MARK, True)
        _installed.append(cls)
