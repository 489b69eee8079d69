"""The span-builder process (`ServerTelemetry(builder="process")`): `python -m phaselens.instrumentation.span_process
REPORT_FD PARENT_PID`, started by `phaselens.instrumentation.shipper`.

It reads frames (`phaselens.instrumentation.wire`) on stdin, turns them back into closed request handles and
step records, and runs the same `SpanBuilder`, GenAI metrics and exporters as the in-process
builder, with its own providers from the OTEL_* environment (`otel_setup.configure`). Request
SERVER spans get the ids the serving process chose (`preset_ids`). Counters go back as one JSON
line on REPORT_FD every `REPORT_INTERVAL_S`, after each FLUSH (with `ack`) and at exit (`final`).

It ends on EOF (the serving process closed the pipe or died), on SIGTERM, or when it is orphaned:
in each case it builds what it holds, shuts its providers down (exporting) and exits 0.
"""

from __future__ import annotations

import json
import marshal
import os
import signal
import sys
import threading
import time

from opentelemetry.sdk.trace.sampling import _get_from_env_or_default
from opentelemetry.trace import SpanKind

from . import names, wire
from .builder import BuildOptions, SpanBuilder
from .clock import ClockAnchor
from .genai_metrics import GenAiServerMetrics
from .otel_setup import configure, export_counters
from .preset_ids import PresetIdGenerator, PresetSampler
from .timeline import BoundedHandOff

REPORT_INTERVAL_S = 0.5
HANDOFF_CAPACITY = 65536  # when full the reader waits: back-pressure reaches the serving process's drop counters
STOP_TIMEOUT_S = 30.0


class Terminated(Exception):
    """SIGTERM, or the serving process is gone."""


def _terminate(signum, frame) -> None:
    raise Terminated()


def read_frame(stream) -> tuple[int, tuple] | None:
    """(kind, fields), or None at EOF."""
    header = stream.read(wire.HEADER.size)
    if len(header) < wire.HEADER.size:
        return None
    length, kind = wire.HEADER.unpack(header)
    payload = stream.read(length)
    if len(payload) < length:
        return None
    return kind, marshal.loads(payload)


class SpanProcess:
    def __init__(self, hello: tuple, report_fd: int) -> None:
        service_name, anchor_mono_ns, anchor_wall_ns, token_events = hello
        self.ids = PresetIdGenerator()
        self.providers = configure(service_name, set_global=False, id_generator=self.ids,
                                   sampler=PresetSampler(_get_from_env_or_default(), self.ids))
        self.tracer = self.providers.tracer_provider.get_tracer(names.SERVER_SCOPE)
        self.anchor = ClockAnchor(anchor_mono_ns, anchor_wall_ns)
        self.requests, self.steps = BoundedHandOff(HANDOFF_CAPACITY), BoundedHandOff(HANDOFF_CAPACITY)
        metrics = GenAiServerMetrics(self.providers.meter_provider, self._drop_counts)
        # engine_grace 0: the serving process already held each request until the engine was done
        self.builder = SpanBuilder(self.tracer, metrics, self.anchor, time.monotonic_ns, self.requests,
                                   self.steps, BuildOptions(token_events=token_events, engine_grace_ns=0), 0.01)
        self.report_out = os.fdopen(report_fd, "w", buffering=1)
        self.report_lock = threading.Lock()
        self.received = self.decode_errors = 0

    def start_root(self, trace_id: int, span_id: int, context, method: str, received_ns: int):
        """The SERVER span, as ServerTelemetry.open_request starts it in the thread mode."""
        return self.ids.start_span_with_ids(
            self.tracer, trace_id, span_id, name=method or "request", context=context, kind=SpanKind.SERVER,
            start_time=self.anchor.to_wall_ns(received_ns))

    def handle(self, kind: int, fields: tuple) -> None:
        if kind == wire.KIND_FLUSH:
            self.builder.flush(STOP_TIMEOUT_S)
            self.providers.tracer_provider.force_flush()
            self.report(ack=fields[0])
            return
        self.received += 1
        try:
            if kind == wire.KIND_REQUEST:
                self._offer(self.requests, wire.decode_request(fields, self.start_root))
            elif kind == wire.KIND_STEP:
                self._offer(self.steps, wire.decode_step(fields))
            else:
                self.decode_errors += 1
        except Exception:  # a malformed record is counted, the rest still get built
            self.decode_errors += 1

    @staticmethod
    def _offer(handoff: BoundedHandOff, record) -> None:
        while len(handoff) >= handoff.capacity:
            time.sleep(0.005)
        handoff.offer(record)

    def _drop_counts(self) -> dict[str, int]:
        exported = export_counters(self.providers.tracer_provider)
        return {"decode_error": self.decode_errors, "build_error": self.builder.counters()["build_errors"],
                "export_queue_full": exported["export_dropped"], "export_failed": exported["export_failed"]}

    def report(self, **extra) -> None:
        counters = {**self.builder.counters(), **export_counters(self.providers.tracer_provider),
                    "records_received": self.received, "decode_errors": self.decode_errors,
                    "child_cpu_ns": time.process_time_ns(), **extra}
        with self.report_lock:
            try:
                self.report_out.write(json.dumps(counters) + "\n")
            except (BrokenPipeError, ValueError):  # nobody reads any more: nothing to tell
                pass

    def report_periodically(self, parent_pid: int) -> None:
        while True:
            time.sleep(REPORT_INTERVAL_S)
            if os.getppid() != parent_pid:  # orphaned (the serving process died): wind down
                os.kill(os.getpid(), signal.SIGTERM)
                return
            self.report()

    def stop(self) -> None:
        self.builder.stop(STOP_TIMEOUT_S)
        self.providers.shutdown()
        self.report(final=True)


NICE = 10  # as the in-process builder thread: on a busy machine the serving loop gets the CPU first


def main(argv: list[str]) -> int:
    report_fd, parent_pid = int(argv[0]), int(argv[1])
    os.nice(NICE)
    signal.signal(signal.SIGTERM, _terminate)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C goes to the server; it closes our pipe
    stream = open(0, "rb", buffering=1 << 20, closefd=False)
    first = read_frame(stream)
    if first is None or first[0] != wire.KIND_HELLO:
        return 2
    process = SpanProcess(first[1], report_fd)
    process.builder.start()
    threading.Thread(target=process.report_periodically, args=(parent_pid,), daemon=True).start()
    try:
        while (item := read_frame(stream)) is not None:
            process.handle(*item)
    except Terminated:
        pass
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # winding down already
    process.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
