"""The span-builder process (`ServerTelemetry(builder="process")`): `python -m phaselens.instrumentation.process.builder_child
REPORT_FD PARENT_PID`, started by `phaselens.instrumentation.process.process_sink`.

It reads frames (`phaselens.instrumentation.process.wire`) on stdin, decodes each into its record and builds
it at once with the same `SpanBuilder` as the thread sink (so nothing waits here: while it builds,
the pipe holds the rest), with its own providers from the OTEL_* environment
(`otel_setup.configure`). The records carry every id the serving process chose. Counters go back
as one JSON line on REPORT_FD every `REPORT_INTERVAL_S`, after each FLUSH (with `ack`) and at exit
(`final`).

`records_safe` (in every report, and alone in a line as soon as an export moves it) = how many records, in arrival order, are out of this process's hands: built,
and every span they queued exported (or counted lost here: `export_failed` once the exporter's own
retries are spent, `export_dropped`, `build_errors`, `decode_errors`; a replay would not do better).
After each record the builder notes each counting processor's `queued` position; the record is
safe once each processor's `settled` position (FIFO: spans leave the queue's front in order) has
passed it. The serving process keeps every frame until it is reported safe and replays the rest to
this process's replacement, so spans exported but not yet reported are exported again. To keep that
window small, exports happen at checkpoints (every `REPORT_INTERVAL_S`: force_flush, then the
report) and on a full batch (OTEL_BSP_MAX_EXPORT_BATCH_SIZE), not on the processor's own schedule
(OTEL_BSP_SCHEDULE_DELAY is set off here, `CHECKPOINT_ONLY_DELAY_MS`); each export wakes the
progress thread (`otel_setup.notify_settled`: no polling), and a kill between an export's success
and that progress line repeats that batch's records. A repeated request's SERVER span
has the same span id (decided at receipt); its other spans and the engine-step spans get fresh ids.

It ends on EOF (the serving process closed the pipe or died), on SIGTERM, or when it is orphaned:
in each case it shuts its providers down (exporting what it built) and exits 0.
"""

from __future__ import annotations

import gc
import json
import os
import signal
import sys
import threading
import time
from collections import deque
from types import FrameType
from typing import Any

from phaselens.instrumentation.hotpath.clock import ClockAnchor
from phaselens.instrumentation.pipeline.builder import SpanBuilder
from phaselens.instrumentation.pipeline.counters import Counters
from phaselens.instrumentation.pipeline.genai_metrics import GenAiServerMetrics
from phaselens.instrumentation.pipeline.otel_setup import configure, export_positions, notify_settled, span_backend
from phaselens.instrumentation.pipeline.sink import NICE
from phaselens.instrumentation.process import wire

# also the checkpoint interval: spans wait at most this long to be exported (the SDK's default
# schedule: 5 s). Each checkpoint costs ~0.5 ms of CPU (an export, a report): at 0.25 s that was
# ~20 us per request at 100 requests/s; at 1 s, ~5 (a full batch is exported at once regardless)
REPORT_INTERVAL_S = 1.0
CHECKPOINT_ONLY_DELAY_MS = 3_600_000  # the batch processor's schedule, off: the checkpoints export


class Terminated(BaseException):
    """SIGTERM, or the serving process is gone (a BaseException: the builder's own error counting
    must not swallow it)."""


def _terminate(signum: int, frame: FrameType | None) -> None:
    raise Terminated()


class SpanProcess:
    def __init__(self, hello: tuple[Any, ...], report_fd: int) -> None:
        service_name, anchor_mono_ns, anchor_wall_ns, token_events = hello
        os.environ["OTEL_BSP_SCHEDULE_DELAY"] = str(CHECKPOINT_ONLY_DELAY_MS)  # this process's own environment
        self.providers = configure(service_name, set_global=False, encoded_spans=True)
        provider = self.providers.tracer_provider
        metrics = GenAiServerMetrics(
            self.providers.meter_provider,
            lambda: Counters.total([self.counters()]).drop_reasons(),
            self.providers.histogram_readers,
        )
        self.builder = SpanBuilder(
            span_backend(self.providers),
            metrics,
            ClockAnchor(anchor_mono_ns, anchor_wall_ns),
            provider,
            token_events,
        )
        self.report_out = os.fdopen(report_fd, "w", buffering=1)
        self.report_lock = threading.Lock()
        self.checkpoint_lock = threading.Lock()  # one checkpoint at a time; none once stopping
        self.stopping = False
        self.received = self.decode_errors = self.done = self.safe = 0
        self.positions = export_positions(provider)
        self.marks: deque[tuple[int, tuple[int, ...]]] = deque()  # (records done, each processor's `queued`)
        self.progress_lock = threading.Lock()
        self.settled = threading.Event()  # an export finished: `safe` may move
        notify_settled(provider, self.settled.set)

    def handle(self, kind: int, fields: tuple[Any, ...]) -> None:
        if kind == wire.KIND_FLUSH:
            self.checkpoint(ack=fields[0])
            return
        self.received += 1
        self.build(kind, fields)
        self.done += 1  # after its spans went to the processors
        with self.progress_lock:
            self.marks.append((self.done, tuple(p.queued for p in self.positions)))

    def build(self, kind: int, fields: tuple[Any, ...]) -> None:
        try:
            record = (
                wire.decode_request(fields)
                if kind == wire.KIND_REQUEST
                else wire.decode_step(fields)
                if kind == wire.KIND_STEP
                else None
            )
        except Exception:  # noqa: BLE001 — a malformed record is counted, the rest still get built
            record = None
        if record is None:
            self.decode_errors += 1
            return
        self.builder.build(record)

    def counters(self) -> dict[str, int]:
        return {
            **self.builder.counters(),
            "records_received": self.received,
            "decode_errors": self.decode_errors,
            "records_safe": self.safe,
        }

    def progress(self) -> bool:
        """Advance `safe` past the records whose spans have all settled; True if it moved."""
        with self.progress_lock:
            marks, safe = self.marks, self.safe
            while marks and all(p.settled >= q for p, q in zip(self.positions, marks[0][1], strict=False)):
                safe = max(safe, marks.popleft()[0])
            moved, self.safe = safe > self.safe, safe
            return moved

    def checkpoint(self, **extra: int) -> None:
        """Export everything queued, then report (see the module doc)."""
        with self.checkpoint_lock:
            if self.stopping:
                return
            self.providers.force_flush()
            self.progress()
            self.report(**extra)

    def report_progress(self) -> None:
        """After each export: `records_safe` alone, if it moved (records with no span to export move
        at the next checkpoint)."""
        while True:
            self.settled.wait()
            self.settled.clear()
            if self.progress():
                self.write({"records_safe": self.safe})

    def report(self, **extra: int) -> None:
        self.write({**self.counters(), "child_cpu_ns": time.process_time_ns(), **extra})

    def write(self, report: dict[str, int]) -> None:
        with self.report_lock:
            try:
                self.report_out.write(json.dumps(report) + "\n")
            except (BrokenPipeError, ValueError):  # nobody reads any more: nothing to tell
                pass

    def report_periodically(self, parent_pid: int) -> None:
        reported = None
        while True:
            time.sleep(REPORT_INTERVAL_S)
            if os.getppid() != parent_pid:  # orphaned (the serving process died): wind down
                os.kill(os.getpid(), signal.SIGTERM)
                return
            if (self.received, self.safe) != reported:  # idle: nothing to export or tell (~3 ms CPU/s saved)
                self.checkpoint()
                reported = (self.received, self.safe)

    def stop(self) -> None:
        """Export everything (the providers' shutdown), then report every record safe."""
        with self.checkpoint_lock, self.progress_lock:
            self.stopping = True
            self.providers.shutdown()
            self.safe = self.done
            self.marks.clear()
        self.report(final=True)


def main(argv: list[str]) -> int:
    report_fd, parent_pid = int(argv[0]), int(argv[1])
    os.nice(NICE)  # as the thread sink's thread: on a busy machine the serving loop gets the CPU first
    signal.signal(signal.SIGTERM, _terminate)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C goes to the server; it closes our pipe
    stream = open(0, "rb", buffering=1 << 20, closefd=False)  # noqa: SIM115 — stdin, read until the process ends
    first = wire.read_frame(stream)
    if first is None or first[0] != wire.KIND_HELLO:
        return 2
    process = SpanProcess(first[1], report_fd)
    # what startup made (modules, providers: ~all this process's objects) lives until exit: frozen, the
    # cyclic GC's collections no longer walk it (they were ~45 % of this process's CPU, perf)
    gc.collect()
    gc.freeze()
    threading.Thread(target=process.report_periodically, args=(parent_pid,), daemon=True).start()
    threading.Thread(target=process.report_progress, daemon=True).start()
    try:
        while (item := wire.read_frame(stream)) is not None:
            process.handle(*item)
    except Terminated:
        pass
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # winding down already
    process.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
