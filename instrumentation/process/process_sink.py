"""Out-of-process span building, the serving side: `ProcessSink` (`ServerTelemetry(builder="process")`).

Building spans costs ~1 ms of Python per request (spans, step links, metrics, OTLP encoding);
in-process that runs under the serving loop's GIL. This sink keeps the records and ships them as
bytes (`wire`) to a child process (`python -m phaselens.instrumentation.process.builder_child`) that runs the
same `SpanBuilder` and exporters: a thread wakes every `wait_interval_s()`, drains the
hand-offs, packs the drain's records into frames in C (`wire.pack`, `PACK_RECORDS` a call) and writes
them to the child's stdin in one `os.write` per drain (the write runs without the GIL; a backlog is
written a slice at a time, the GIL left to the serving loop between slices).

Never hurts the loop: the hand-offs are bounded (full → dropped, counted), and everything below
runs on the shipper thread. A killed child loses nothing this process still holds: every frame is
kept (`retention`, bounded by bytes) until the child reports it built and exported
(`records_safe`: every span they made exported, see span_process). A child that dies is restarted at
the shipper's next wake-up, then at most once per backoff (0.5 s, doubling to 30 s; at stop, at
once if it held frames); meanwhile frames are kept, and the replacement gets the hello, then every
frame its predecessor had not reported safe (`records_replayed`), then what arrived meanwhile.
At-least-once: spans the dead child exported after its last report are exported again (a request's
SERVER span with the same id, its other spans with fresh ones). Counted losses: frames
evicted past the bound before any child got them (`channel_dropped`), and evicted ones whose child
died before reporting them safe (`channel_lost`). Nothing raises into the loop.
Steps whose batch holds no sampled request are not shipped (counted `steps_unsampled` here);
unsampled requests are shipped, without a span, because the GenAI metrics count every request.
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import IO

from phaselens.common.threads import name_os_thread
from phaselens.instrumentation.hotpath.clock import ClockAnchor
from phaselens.instrumentation.hotpath.records import Record
from phaselens.instrumentation.pipeline.sink import HandOffs, wait_until
from phaselens.instrumentation.pipeline.span_processor import SDK_SCHEDULE_DELAY_MS, schedule_delay_ms
from phaselens.instrumentation.process import retention, wire

PIPE_BYTES = 1 << 20  # F_SETPIPE_SZ: room for ~200 requests' frames while the child is busy
# one drain and write per interval: a wake-up costs ~100 µs of this process's CPU whatever it ships
# (the timed wait's sleep and wake in the kernel ~40 µs, the Python, the empty drain's checks; the
# eighth and twelfth passes in docs/span-backends.md); 20 ms → 0.25 s cut the shipper's CPU per
# request ~4x, 0.25 → 1 s by another ~30 % (and the child's bursts cost less); 1 → 2 s cut the child's
# CPU a request at vLLM's ~10 requests a second 146 → 121 us (its reads and their cold caches,
# benchmarks/builder_child_rate.py --ship-every; 2.5 s cut nothing in vLLM, docs/history.md); flush()
# and stop() wake it at once. A shorter OTEL_BSP_SCHEDULE_DELAY shortens it (`wait_interval_s`)
SHIP_INTERVAL_S = 2.0
MIN_INTERVAL_S = 0.01  # a schedule delay of a few ms must not make the shipper spin
# records packed per wire.pack call: a drain holds the GIL (C, no release) for ~1 ms a slice at most
# (~3 µs a record, cold); a backlog's slices are written one by one, the GIL given up between them
PACK_RECORDS = 256
_F_SETPIPE_SZ = 1031
RESTART_BACKOFF_S = 0.5  # the wait before a second restart; doubles per restart, up to the max
RESTART_BACKOFF_MAX_S = 30.0
_NOT_SUMMED = ("ack", "final")  # report fields that are not cumulative counts


def wait_interval_s() -> float:
    """The longest wait each of the shipper and the child's checkpoint adds before a span's export.

        wait_s = clamp(OTEL_BSP_SCHEDULE_DELAY_ms / 2 / 1000, MIN_INTERVAL_S, SHIP_INTERVAL_S)

    so a span is exported within the schedule delay the user asked of the SDK (read as the batch
    processors read it, `span_processor.schedule_delay_ms`; a non-positive one reads as the SDK's
    default 5 s), or within 2 × SHIP_INTERVAL_S if that is sooner: a longer delay does not lengthen
    the interval, lest the hand-offs fill between two drains."""
    delay_ms = schedule_delay_ms()
    if delay_ms <= 0:
        delay_ms = SDK_SCHEDULE_DELAY_MS
    return min(max(delay_ms / 2000, MIN_INTERVAL_S), SHIP_INTERVAL_S)


@dataclass(slots=True)
class _Child:
    """One span-builder process: its stdin (proc.stdin), its report pipe, what it last reported."""

    proc: subprocess.Popen[bytes]
    stdin: IO[bytes]
    reports: IO[bytes]
    reader: threading.Thread = field(init=False)  # reads `reports`, set once the child exists
    report: dict[str, int] = field(default_factory=dict)
    acked: int = 0  # the last FLUSH it acknowledged
    safe: int = 0  # its first `safe` records are built and exported (reported `records_safe`)
    released: int = 0  # its first `released` records left the retention: reported safe, or evicted
    dead: bool = False
    retired: bool = False  # its report is in ProcessSink._retired (counters() must not add it again)

    def alive(self) -> bool:
        return not self.dead and self.proc.poll() is None

    def lost(self) -> int:
        """Records evicted from the retention that it never reported safe: if it died, they are gone
        (the rest it had not reported are replayed to its replacement)."""
        return max(0, self.released - self.safe)


class ProcessSink:
    """sink.Sink that ships records to the span-builder process; `tick()` runs at every wake-up."""

    def __init__(
        self,
        service_name: str,
        anchor: ClockAnchor,
        token_events: bool,
        capacity: int,
        poll_interval_s: float,
        tick: Callable[[], None],
    ) -> None:
        self._handoffs = HandOffs(capacity)
        self.submit_request, self.submit_step = self._handoffs.requests.offer, self._handoffs.steps.offer
        self._tick = tick
        wait_s = wait_interval_s()
        self._interval_s = max(poll_interval_s, wait_s)
        # held while no wake-up is pending; `_nudge` releases it, the shipper's timed acquire takes it
        # back: one C call a wake-up (an Event's wait and clear were ~60 µs of Python and locks, cold)
        self._wake = threading.Lock()
        self._wake.acquire()
        self._hello = wire.hello(service_name, anchor.mono_ts, anchor.wall_ts, token_events, wait_s)
        self._counts = {
            "records_shipped": 0,
            "bytes_shipped": 0,
            "records_replayed": 0,
            "channel_dropped": 0,
            "encode_errors": 0,
            "steps_unsampled": 0,
            "shipper_cpu_ns": 0,
            "child_restarts": 0,
            "spawn_errors": 0,
        }
        self._retained = retention.Retained(retention.RETAIN_BYTES)  # the shipper thread's alone
        self._done = 0  # records taken off the hand-offs and shipped, dropped or skipped
        self._flush_asked: list[int] = []  # flush sequence numbers for the shipper to send
        self._sequence = 0  # flushes asked
        self._child_changed = threading.Condition()  # guards _child, _retired and each child's report
        self._retired: dict[str, int] = {}  # the reports of children that died, summed, and their losses
        self._restart_at = 0.0  # monotonic time before which a dead child is not replaced
        self._stop = threading.Event()
        self._child = self._spawn()
        self._shipper = threading.Thread(target=self._run, name="phaselens-span-shipper", daemon=True)

    def _spawn(self) -> _Child:
        report_read, report_write = os.pipe()
        try:
            proc = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "phaselens.instrumentation.process.builder_child",
                    str(report_write),
                    str(os.getpid()),
                ],
                stdin=subprocess.PIPE,
                pass_fds=(report_write,),
            )
        except OSError:
            os.close(report_read)
            raise
        finally:
            os.close(report_write)
        stdin = proc.stdin
        assert stdin is not None  # stdin=PIPE
        try:
            import fcntl  # POSIX only

            fcntl.fcntl(stdin.fileno(), _F_SETPIPE_SZ, PIPE_BYTES)
        except (ImportError, OSError):  # not Linux, or over /proc/sys/fs/pipe-max-size: the default size
            pass
        child = _Child(proc, stdin, os.fdopen(report_read, "rb"))
        child.reader = threading.Thread(
            target=self._read_reports, args=(child,), name="phaselens-span-reports", daemon=True
        )
        return child

    @property
    def pid(self) -> int:
        return self._child.proc.pid

    def start(self) -> None:
        self._child.reader.start()
        self._shipper.start()

    # --- shipper thread ----------------------------------------------------------------------------
    def _run(self) -> None:
        name_os_thread("span-shipper")
        self._write(self._child, [self._hello])
        while not self._stop.is_set():
            self._tick()
            self._drain()
            self._counts["shipper_cpu_ns"] = time.thread_time_ns()  # what shipping costs this process
            self._wake.acquire(timeout=self._interval_s)
        self._drain(final=True)
        try:
            self._child.stdin.close()  # EOF: the child builds what it holds, exports and exits
        except OSError:
            pass

    def _drain(self, final: bool = False) -> None:
        """Keep what is waiting, and ship what is kept and not yet shipped, with any flush asked for;
        a dead child is replaced even with nothing to ship (a flush may be waiting for it).
        `final`: at stop, a dead child holding kept frames is replaced whatever the backoff."""
        self._release(self._child)
        records = self._handoffs.take()
        taken = len(records)
        while records:
            self._pack(records[:PACK_RECORDS])
            del records[:PACK_RECORDS]  # freed here, a slice at a time (the freeing is GIL time too)
            if records:  # a backlog: this slice written, then the GIL left to a waiting serving loop
                if self._due(final):
                    self._send([], final)
                time.sleep(0)  # as ThreadSink: measured, a waiting loop's longest wait ~7x shorter
        flushes = []
        while self._flush_asked:
            flushes.append(wire.frame(wire.KIND_FLUSH, (self._flush_asked.pop(0),)))
        if flushes or self._due(final):
            self._send(flushes, final)
        self._done += taken

    def _pack(self, records: list[Record]) -> None:
        """Frame `records` and keep the frames (no memory for them: lost, counted, never raised)."""
        try:
            packed = wire.pack(records)
        except Exception:  # noqa: BLE001 — no memory for the frames: lost, counted, never raised
            self._counts["encode_errors"] += len(records)
        else:
            self._keep(packed)

    def _nudge(self) -> None:
        """Wake the shipper now (at most one wake-up stays pending)."""
        try:
            self._wake.release()
        except RuntimeError:  # already released: a wake-up is pending
            pass

    def _due(self, final: bool) -> bool:
        """Kept frames not yet written; or a dead child to replace (at stop: only if it held frames)."""
        kept = self._retained
        if kept.sent < kept.frames:
            return True
        return not self._child.alive() and (bool(kept.frames) or not final)

    def _keep(self, packed: wire.Packed) -> None:
        """Keep the packed frames; count the steps not shipped (no sampled member) and the records
        the pipe cannot carry (e.g. a prompt marshal cannot encode: lost, counted)."""
        self._counts["steps_unsampled"] += packed.unsampled
        self._counts["encode_errors"] += packed.errors
        evicted = self._retained.add(packed.data, packed.ends)
        self._child.released += evicted.sent  # still with the child; lost only if it dies unreported
        self._counts["channel_dropped"] += evicted.unsent

    def _release(self, child: _Child) -> None:
        """Forget the frames `child` reported safe since the last call."""
        child.released += self._retained.release(child.safe - child.released)

    def _send(self, flushes: list[bytes], final: bool) -> None:
        """The kept frames not yet written, then `flushes`, to the live child (none: they wait, and
        a flush waits for the replacement)."""
        child = self._live_child(final)
        if child is None:
            return
        kept = self._retained
        parts = kept.unsent()
        self._write(child, [*parts, *flushes])
        # written, or gone with a child that died mid-write: either way its replacement gets them again
        self._counts["records_shipped"] += kept.frames - kept.sent
        self._counts["bytes_shipped"] += sum(map(len, parts))
        kept.sent = kept.frames

    def _write(self, child: _Child, parts: list[bytes | memoryview]) -> bool:
        # one part (a drain's frames, nothing else): written as it is, no join
        data = memoryview(parts[0] if len(parts) == 1 else b"".join(parts))
        try:
            while data:
                data = data[os.write(child.stdin.fileno(), data) :]
        except (OSError, ValueError):  # the child is gone (EPIPE) or the pipe was closed
            child.dead = True
            return False
        return True

    # --- a child that died -----------------------------------------------------------------------------
    def _live_child(self, final: bool) -> _Child | None:
        """The child; a new one if it died (unless within the restart backoff and not `final`)."""
        child = self._child
        if child.alive():
            return child
        child.dead = True
        if not final and time.monotonic() < self._restart_at:
            return None
        attempts = self._counts["child_restarts"] + self._counts["spawn_errors"]
        # the doublings capped: past ~1,000 restarts (8 h of a crash loop at 30 s) 2**n overflows a float
        backoff_s = RESTART_BACKOFF_S * 2 ** min(attempts, 30)
        self._restart_at = time.monotonic() + min(backoff_s, RESTART_BACKOFF_MAX_S)
        try:
            fresh = self._spawn()
        except OSError:  # no process to be had now (EMFILE, ENOMEM): frames stay kept, tried after the backoff
            self._counts["spawn_errors"] += 1
            return None
        self._retire(child)
        self._counts["child_restarts"] += 1
        fresh.reader.start()
        with self._child_changed:
            self._child = fresh
            self._child_changed.notify_all()  # a flush waiting on the dead one asks this one
        return fresh if self._write(fresh, [self._hello]) else None

    def _retire(self, child: _Child) -> None:
        """Reaps a dead child and keeps what it reported, and what it lost, in the running totals;
        the frames it had not reported safe are now for its replacement."""
        if child.proc.poll() is None:  # a broken pipe, the process not yet gone
            child.proc.kill()
        child.proc.wait()
        child.reader.join(1.0)  # its last report is on the pipe until EOF
        self._release(child)
        self._counts["records_replayed"] += self._retained.sent
        self._retained.sent = 0
        with self._child_changed:
            for key, value in child.report.items():
                if key not in _NOT_SUMMED:
                    self._retired[key] = self._retired.get(key, 0) + value
            self._retired["channel_lost"] = self._retired.get("channel_lost", 0) + child.lost()
            child.retired = True  # still self._child until its replacement has started

    # --- reports from the child ----------------------------------------------------------------------
    def _read_reports(self, child: _Child) -> None:
        name_os_thread("span-reports")
        with child.reports:
            for line in child.reports:
                try:
                    report = json.loads(line)
                except ValueError:
                    continue
                with self._child_changed:
                    if report.keys() != {"records_safe"}:  # else a progress line: that alone
                        child.report = report
                    child.acked = max(child.acked, report.get("ack", 0))
                    child.safe = child.report["records_safe"] = max(child.safe, report.get("records_safe", 0))
                    self._child_changed.notify_all()
        with self._child_changed:
            child.dead = True
            self._child_changed.notify_all()

    def counters(self) -> dict[str, int]:
        with self._child_changed:
            child, retired = self._child, dict(self._retired)
            current = {} if child.retired else child.report
            report = {k: v for k, v in current.items() if k not in _NOT_SUMMED}
        alive = child.alive()
        counters = {
            "spans_built": 0,
            "build_errors": 0,
            "export_exported": 0,
            "export_failed": 0,
            "export_dropped": 0,
            **self._handoffs.counters(),
        }
        for counts in (report, retired, self._counts):  # steps_unsampled is counted on both sides
            for key, value in counts.items():
                counters[key] = counters.get(key, 0) + value
        counters["child_alive"] = int(alive)
        counters["channel_lost"] = retired.get("channel_lost", 0) + (0 if alive or child.retired else child.lost())
        return counters

    # --- flush and stop --------------------------------------------------------------------------------
    def _acked_or_replaced(self, child: _Child, sequence: int) -> bool:
        return child.acked >= sequence or self._child is not child

    def flush(self, timeout_s: float) -> bool:
        """Wait until every record handed off so far is shipped, then until the child has built and
        exported it (its FLUSH acknowledgement). A child that dies meanwhile: its replacement (with
        the replays) is asked; False on timeout, e.g. a dead child within its restart backoff."""
        deadline = time.monotonic() + timeout_s
        # counted from what the hand-offs accepted: a record just taken but not yet shipped still counts
        if not wait_until(lambda: self._done >= self._handoffs.accepted(), timeout_s, self._nudge):
            return False
        with self._child_changed:
            while (left_s := deadline - time.monotonic()) > 0:
                child = self._child
                self._sequence += 1
                sequence = self._sequence
                self._flush_asked.append(sequence)
                self._nudge()
                self._child_changed.wait_for(functools.partial(self._acked_or_replaced, child, sequence), left_s)
                if child.acked >= sequence:
                    return True
            return False

    def stop(self, timeout_s: float) -> None:
        """Ship everything left, close the pipe and wait for the child to export and exit; kill it
        when it does not within `timeout_s`. Later submits are counted as dropped."""
        self._stop.set()
        self._nudge()
        self._shipper.join(timeout_s)
        child = self._child
        try:
            child.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            child.proc.kill()
            child.proc.wait()
        child.reader.join(timeout_s)
        self._handoffs.close()
        if not self._shipper.is_alive():
            self._abandon(child)

    def _abandon(self, child: _Child) -> None:
        """At stop: what the last child did not report safe is lost with it (a child that exits on
        EOF reports everything), and what no child got is dropped."""
        self._release(child)
        with self._child_changed:
            child.released += self._retained.sent
            self._counts["channel_dropped"] += self._retained.frames - self._retained.sent
            self._retained = retention.Retained(retention.RETAIN_BYTES)
