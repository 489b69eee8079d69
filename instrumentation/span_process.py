"""The span-builder process (`ServerTelemetry(builder="process")`): `python -m phaselens.instrumentation.span_process
REPORT_FD PARENT_PID`, started by `phaselens.instrumentation.shipper`.

It reads frames (`phaselens.instrumentation.wire`) on stdin, decodes each into its record and builds
it at once with the same `SpanBuilder` as the thread sink (so nothing waits here: while it builds,
the pipe holds the rest), with its own providers from the OTEL_* environment
(`otel_setup.configure`). The records carry every id the serving process chose. Counters go back
as one JSON line on REPORT_FD every `REPORT_INTERVAL_S`, after each FLUSH (with `ack`) and at exit
(`final`).

Each report is a checkpoint: `records_safe` = the records (counted in arrival order) that are out of
this process's hands. Taken as: n = records built so far; then the tracer provider's force_flush
(the counting batch processor exports everything queued, waiting for an export in flight), which
covers every span of those n records; then the report. "Out of its hands" = exported, or counted
lost here (`export_failed` once the exporter's own retries are spent, `export_dropped`,
`build_errors`, `decode_errors`): a replay would not do better. The serving process keeps every
frame until it is reported safe, and replays the rest to this process's replacement, so what this
process exported after its last checkpoint is exported twice; a checkpoint every 0.25 s, while the
batch processor's own schedule is 5 s, keeps that to spans exported in a full batch (512) or during
the checkpoint itself.

It ends on EOF (the serving process closed the pipe or died), on SIGTERM, or when it is orphaned:
in each case it shuts its providers down (exporting what it built) and exits 0.
"""

from __future__ import annotations

import json
import marshal
import os
import signal
import sys
import threading
import time

from . import wire
from .builder import SpanBuilder
from .clock import ClockAnchor
from .counters import drop_reasons
from .emitter import SpanEmitter
from .genai_metrics import GenAiServerMetrics
from .otel_setup import configure
from .sink import NICE

REPORT_INTERVAL_S = 0.25  # also the checkpoint interval: how much a killed child can make the replay repeat


class Terminated(BaseException):
    """SIGTERM, or the serving process is gone (a BaseException: the builder's own error counting
    must not swallow it)."""


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
        self.providers = configure(service_name, set_global=False)
        provider = self.providers.tracer_provider
        metrics = GenAiServerMetrics(self.providers.meter_provider, lambda: drop_reasons(self.counters()))
        self.builder = SpanBuilder(SpanEmitter.of_provider(provider), metrics,
                                   ClockAnchor(anchor_mono_ns, anchor_wall_ns), provider, token_events)
        self.report_out = os.fdopen(report_fd, "w", buffering=1)
        self.report_lock = threading.Lock()
        self.checkpoint_lock = threading.Lock()  # one checkpoint at a time; none once stopping
        self.stopping = False
        self.received = self.decode_errors = self.done = self.safe = 0

    def handle(self, kind: int, fields: tuple) -> None:
        if kind == wire.KIND_FLUSH:
            self.checkpoint(ack=fields[0])
            return
        self.received += 1
        self.build(kind, fields)
        self.done += 1  # after its spans went to the processors

    def build(self, kind: int, fields: tuple) -> None:
        try:
            record = (wire.decode_request(fields) if kind == wire.KIND_REQUEST
                      else wire.decode_step(fields) if kind == wire.KIND_STEP else None)
        except Exception:  # a malformed record is counted, the rest still get built
            record = None
        if record is None:
            self.decode_errors += 1
            return
        self.builder.build(record)

    def counters(self) -> dict[str, int]:
        return {**self.builder.counters(), "records_received": self.received, "decode_errors": self.decode_errors,
                "records_safe": self.safe}

    def checkpoint(self, **extra) -> None:
        """Export what the records done so far made, then report them safe (see the module doc)."""
        with self.checkpoint_lock:
            if self.stopping:
                return
            done = self.done
            self.providers.tracer_provider.force_flush()
            self.safe = max(self.safe, done)
            self.report(**extra)

    def report(self, **extra) -> None:
        counters = {**self.counters(), "child_cpu_ns": time.process_time_ns(), **extra}
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
            self.checkpoint()

    def stop(self) -> None:
        """Export everything (the providers' shutdown), then report every record safe."""
        with self.checkpoint_lock:
            self.stopping = True
            self.providers.shutdown()
            self.safe = self.done
        self.report(final=True)


def main(argv: list[str]) -> int:
    report_fd, parent_pid = int(argv[0]), int(argv[1])
    os.nice(NICE)  # as the thread sink's thread: on a busy machine the serving loop gets the CPU first
    signal.signal(signal.SIGTERM, _terminate)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C goes to the server; it closes our pipe
    stream = open(0, "rb", buffering=1 << 20, closefd=False)
    first = read_frame(stream)
    if first is None or first[0] != wire.KIND_HELLO:
        return 2
    process = SpanProcess(first[1], report_fd)
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
