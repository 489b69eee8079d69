"""The span-builder process (`ServerTelemetry(builder="process")`): `python -m phaselens.instrumentation.process.builder_child
REPORT_FD PARENT_PID`, started by `phaselens.instrumentation.process.process_sink`.

It reads frames (`phaselens.instrumentation.process.wire`) on stdin, all the pipe holds at each
wake-up in one read, decodes each into its record and builds it at once with the same `SpanBuilder`
as the thread sink (so nothing waits here: while it builds, the pipe holds the rest), with its own
providers from the OTEL_* environment (`otel_setup.configure`). The records carry every id the serving process chose. Counters go back
as one JSON line on REPORT_FD at each checkpoint (within the hello's interval, the shipper's
`process_sink.wait_interval_s()`, of a read that brought records; none while idle), after each FLUSH (with `ack`) and at exit (`final`).

`records_safe` (in every report, and alone in a line as soon as an export moves it) = how many records, in arrival order, are out of this process's hands: built,
and every span they queued exported (or counted lost here: `export_failed` once the exporter's own
retries are spent, `export_dropped`, `build_errors`, `decode_errors`; a replay would not do better).
After each read, and every `MARK_RECORDS` records within it, the builder notes each counting
processor's `queued` position; the records done by then are safe once each processor's `settled`
position (FIFO: spans leave the queue's front in order) has passed it (one mark a read made a
whole read's exported records wait for its last spans' export, at the next checkpoint: a read holds
up to an interval of the shipper's records). The serving process keeps every frame until it is reported safe and replays the rest to
this process's replacement, so spans exported but not yet reported are exported again. To keep that
window small, exports happen at checkpoints (force_flush, then the report, after a read or at a
timed wake-up, see `serve`) and on a full batch (OTEL_BSP_MAX_EXPORT_BATCH_SIZE, exported by the thread
that filled it: `otel_setup.export_on_caller`), not on the processor's own schedule
(OTEL_BSP_SCHEDULE_DELAY is set off here, `CHECKPOINT_ONLY_DELAY_MS`); after each export the
progress line is written at once (`otel_setup.notify_settled`), and a kill between an export's
success and that line repeats that batch's records. So one thread reads, builds, exports and
reports: no other thread of this process wakes while it runs (the SDK readers' and the batch
processor's workers sleep), and none hands it the GIL back. A repeated request's SERVER span
has the same span id (decided at receipt); its other spans and the engine-step spans get fresh ids.

It ends on EOF (the serving process closed the pipe or died), on SIGTERM (between reads: a record
is never left half built), or when it is orphaned (its pidfd of the serving process turns readable;
without pidfds, seen at a wake-up at least every interval): in each case it shuts its
providers down (exporting what it built) and exits 0.
"""

from __future__ import annotations

import gc
import json
import math
import os
import select
import signal
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from phaselens.instrumentation.hotpath.clock import ClockAnchor
from phaselens.instrumentation.pipeline.builder import SpanBuilder
from phaselens.instrumentation.pipeline.counters import Counters
from phaselens.instrumentation.pipeline.genai_metrics import GenAiServerMetrics
from phaselens.instrumentation.pipeline.otel_setup import (
    configure,
    export_on_caller,
    export_positions,
    notify_settled,
    span_backend,
)
from phaselens.instrumentation.pipeline.sink import NICE
from phaselens.instrumentation.process import wire

# The checkpoint interval is the hello's, the shipper's own (`process_sink.wait_interval_s`): a read's
# spans wait at most that long to be exported. A checkpoint costs ~0.3-0.5 ms of CPU in cold caches
# (an export, a report), which at vLLM's ~10 requests a second was most of the child's fixed cost:
# 1 s → 2 s measured 169 → 145 us a request (benchmarks/builder_child_rate.py); a full batch is
# exported at once regardless.
# A read this early (share of the interval) before the checkpoint is due carries it: the shipper's
# reads come once an interval, so a due time just after one would cost a wake-up of its own
CHECKPOINT_EARLY = 0.25
CHECKPOINT_ONLY_DELAY_MS = 3_600_000  # the batch processor's schedule, off: the checkpoints export
MARK_RECORDS = 16  # a kill repeats at most ~this many records exported since the last mark
# the records' objects die by reference counting: at the default 700 allocations the cyclic GC's
# collections were ~30k instructions a request at vLLM's shape (~5 % of the child's), ~11k at these
GC_THRESHOLDS = (50_000, 20, 20)
READ_BYTES = 1 << 20  # one read takes what the pipe holds (its size: process_sink.PIPE_BYTES)


Path = tuple[Callable[[Any], Any], Callable[[Any], None]]  # a record frame's decoder, then its builder


def _not_a_record(fields: Any) -> None:
    raise ValueError("a frame of another kind where a record was expected")


_NOT_A_RECORD: Path = (_not_a_record, _not_a_record)  # counted in decode_errors


class FrameReader:
    """Whole frames from a file descriptor, as many as each read brings; a frame cut at the read's
    end waits for the next one."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.tail = b""

    def read(self) -> list[tuple[int, Any]] | None:
        """The frames of one read (blocking until there is one), a run of step frames as one item
        (`wire.split_runs`); [] if none is whole yet; None at EOF."""
        data = os.read(self.fd, READ_BYTES)
        if not data:
            return None
        if self.tail:
            data = self.tail + data
        frames, used = wire.split_runs(data)
        self.tail = data[used:]
        return frames

    def read_first(self) -> tuple[int, Any] | None:
        """The first frame alone (the hello); None at EOF. What follows it stays in the pipe, so
        startup's collection and freeze see startup's objects, not a first read's frames (up to
        `READ_BYTES` of a replay's records)."""
        header = self._exactly(wire.HEADER.size)
        payload = self._exactly(wire.HEADER.unpack(header)[0]) if header is not None else None
        return wire.split_frames(header + payload)[0][0] if header is not None and payload is not None else None

    def _exactly(self, size: int) -> bytes | None:
        data = b""
        while len(data) < size:
            more = os.read(self.fd, size - len(data))
            if not more:
                return None
            data += more
        return data


class SpanProcess:
    def __init__(self, hello: tuple[Any, ...], report_fd: int) -> None:
        service_name, anchor_mono_ts, anchor_wall_ts, token_events, self.interval_s = hello
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
            ClockAnchor(anchor_mono_ts, anchor_wall_ts),
            provider,
            token_events,
        )
        self.request_path: Path = (wire.decode_request, self.builder.build_request)
        self.report_out = os.fdopen(report_fd, "w", buffering=1)
        self.report_lock = threading.Lock()
        self.received = self.decode_errors = self.done = self.safe = 0
        self.reported = 0  # `received` at the last report
        self.marked = 0  # `done` at the last mark
        self.checkpointing = False  # its report follows its exports: no records_safe line of their own
        self.positions = export_positions(provider)
        self.marks: deque[tuple[int, tuple[int, ...]]] = deque()  # (records done, each processor's `queued`)
        self.progress_lock = threading.Lock()  # a processor's worker exports at shutdown
        export_on_caller(provider)
        notify_settled(provider, self.report_settled)

    def handle(self, frames: list[tuple[int, Any]]) -> None:
        """A read's frames, in order (`wire.split_runs`'s items); a FLUSH exports and reports what
        came before it. A request is decoded and built here, by its frame's kind (one call level a
        frame); a run of step frames (~16 a request in vLLM, ~2 at B = 64) comes decoded, and is
        built in one call (one offer)."""
        request_path = self.request_path
        for kind, fields in frames:
            if kind == wire.KIND_STEP:
                steps, undecoded = fields
                self.received += len(steps) + undecoded
                self.decode_errors += undecoded
                self.done += undecoded
                if steps:
                    self.build_steps(steps)
                continue
            if kind == wire.KIND_FLUSH:
                self.mark()
                self.checkpoint(ack=fields[0])
                continue
            self.received += 1
            decode, build = request_path if kind == wire.KIND_REQUEST else _NOT_A_RECORD
            try:
                record = decode(fields)
            except Exception:  # noqa: BLE001 — a malformed record is counted, the rest still get built
                self.decode_errors += 1
            else:
                build(record)
            self.count_done(1)
        self.mark()

    def build_steps(self, steps: list[Any]) -> None:
        self.builder.build_steps(steps)
        self.count_done(len(steps))

    def count_done(self, records: int) -> None:
        """`records` more done (after their spans went to the processors); a mark every MARK_RECORDS."""
        self.done += records
        if self.done - self.marked >= MARK_RECORDS:
            self.mark()

    def mark(self) -> None:
        """The records done so far are safe once each processor has settled what it holds now."""
        if self.done != self.marked:
            with self.progress_lock:
                self.marks.append((self.done, tuple(p.queued for p in self.positions)))
            self.marked = self.done

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
        self.checkpointing = True
        try:
            self.providers.force_flush()
        finally:
            self.checkpointing = False
        self.progress()
        self.report(**extra)

    def report_settled(self) -> None:
        """After each export: `records_safe` alone, if it moved (records with no span to export move
        at the next checkpoint), unless a checkpoint's report is about to say it (one line a
        checkpoint, not one more per export in it: ~70 us of CPU a line in this process)."""
        if not self.checkpointing and self.progress():
            self.write({"records_safe": self.safe})

    def unreported(self) -> bool:
        """Records received since the last report (the last checkpoint's, or a FLUSH's)."""
        return self.received != self.reported

    def report(self, **extra: int) -> None:
        self.reported = self.received
        self.write({**self.counters(), "child_cpu_ns": time.process_time_ns(), **extra})

    def write(self, report: dict[str, int]) -> None:
        with self.report_lock:
            try:
                self.report_out.write(json.dumps(report) + "\n")
            except (BrokenPipeError, ValueError):  # nobody reads any more: nothing to tell
                pass

    def stop(self) -> None:
        """Export everything (the providers' shutdown), then report every record safe."""
        self.providers.shutdown()
        with self.progress_lock:
            self.safe = self.done
            self.marks.clear()
        self.report(final=True)


def _parent_watch(poller: select.poll, parent_pid: int) -> int | None:
    """A pidfd of the serving process, registered in `poller` (readable once it has exited), so no
    timer has to look for its death; None where pidfds are missing (not Linux 5.3+)."""
    try:
        pidfd = os.pidfd_open(parent_pid)
    except (AttributeError, OSError):
        return None
    poller.register(pidfd, select.POLLIN)
    return pidfd


def _poll_ms(due: float | None, pidfd: int | None, interval_s: float) -> int | None:
    """How long a poll may sleep: until a checkpoint is due; with nothing waiting, until an fd is
    ready (a pidfd tells the parent's death) or, without a pidfd, `interval_s` (to look)."""
    if due is None:
        return None if pidfd is not None else math.ceil(interval_s * 1000)
    return math.ceil(max(0.0, due - time.monotonic()) * 1000)


def serve(process: SpanProcess, reader: FrameReader, parent_pid: int) -> None:
    """Reads and builds until EOF, SIGTERM or the serving process's death. The records of a read
    are exported within the hello's interval of it: by the checkpoint after the first read that comes
    `CHECKPOINT_EARLY` of the interval before that (the shipper writes once an interval: the reads'
    wake-ups carry the checkpoints), or by a timed wake-up when no read does. Idle, nothing wakes it."""
    terminated: list[int] = []
    wake_read, wake_write = os.pipe()  # a signal's byte wakes the poll below
    os.set_blocking(wake_write, False)
    signal.set_wakeup_fd(wake_write)
    signal.signal(signal.SIGTERM, lambda signum, frame: terminated.append(signum))
    poller = select.poll()
    poller.register(reader.fd, select.POLLIN)
    poller.register(wake_read, select.POLLIN)
    pidfd = _parent_watch(poller, parent_pid)
    if os.getppid() != parent_pid:  # died before the watch began
        return
    due: float | None = None  # when the records read since the last checkpoint must be exported
    interval_s = process.interval_s
    early_s = interval_s * CHECKPOINT_EARLY
    while not terminated:
        ready = {fd for fd, _ in poller.poll(_poll_ms(due, pidfd, interval_s))}
        if pidfd in ready or (pidfd is None and os.getppid() != parent_pid):  # orphaned: wind down
            return
        if reader.fd in ready:
            frames = reader.read()
            if frames is None:
                return
            process.handle(frames)
            if not process.unreported():  # a FLUSH among them checkpointed
                due = None
            elif due is None:
                due = time.monotonic() + interval_s
        if due is not None and time.monotonic() >= due - early_s:
            process.checkpoint()
            due = None


def main(argv: list[str]) -> int:
    report_fd, parent_pid = int(argv[0]), int(argv[1])
    os.nice(NICE)  # as the thread sink's thread: on a busy machine the serving loop gets the CPU first
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C goes to the server; it closes our pipe
    reader = FrameReader(0)
    hello = reader.read_first()  # SIGTERM before the hello: the default, nothing built yet
    if hello is None or hello[0] != wire.KIND_HELLO:
        return 2
    process = SpanProcess(hello[1], report_fd)
    # what startup made (modules, providers: ~all this process's objects) lives until exit: frozen, the
    # cyclic GC's collections no longer walk it (they were ~45 % of this process's CPU, perf)
    gc.collect()
    gc.freeze()
    gc.set_threshold(*GC_THRESHOLDS)
    serve(process, reader, parent_pid)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # winding down already
    process.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
