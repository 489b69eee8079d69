"""Drains a signal's spool into ClickHouse: batches by item count (spans, log records, data points)
or age, retries with backoff, never drops."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from phaselens.collectors.clickhouse_sink import ClickHouseSink
from phaselens.collectors.metrics import CollectorMetrics
from phaselens.collectors.shard_sink import ShardedSink
from phaselens.collectors.signal_sink import SignalSink
from phaselens.collectors.signals import INVALID, TRACES, Signal
from phaselens.collectors.spool import Pending, Record, Spool

log = logging.getLogger(__name__)


class _Abandoned(Exception):
    pass


@dataclass(slots=True)
class SpoolWriter:
    spool: Spool
    sink: ClickHouseSink | ShardedSink | SignalSink
    metrics: CollectorMetrics
    batch_spans: int = 50_000  # items of the signal: spans, log records or data points
    flush_interval_s: float = 0.2
    max_backoff_s: float = 5.0
    signal: Signal = TRACES
    _stop: threading.Event = field(default_factory=threading.Event, init=False)
    _thread: threading.Thread | None = field(default=None, init=False)
    _waiting_since: float | None = field(default=None, init=False)
    _inserted: Pending | None = field(default=None, init=False)

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name=f"spool-writer-{self.signal.name}", daemon=True)
        self._thread.start()

    def request_stop(self) -> None:
        """Stop taking new data; `stop` waits for the drain."""
        self._stop.set()

    def stop(self, timeout_s: float = 30.0) -> bool:
        """Drains what is spooled (within timeout_s); whatever is left stays spooled for next start."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)
        self.sink.close()
        return self._thread is None or not self._thread.is_alive()

    def _run(self) -> None:
        """Drains until stopped. An unexpected error restarts draining from the pending batch
        (a deduplicated replay) instead of ending the thread with items stuck in the spool."""
        while True:
            try:
                self._drain()
                return
            except _Abandoned:
                log.warning("stopped with %s still spooled; they are written on the next start", self.signal.name)
                return
            except Exception:
                self.metrics.add(self.signal.counter("writer_errors"))
                log.exception("spool writer failed; resuming from the last pending batch")
                if self._stop.wait(1.0):
                    return

    def _drain(self) -> None:
        segment, offset = self._replay_pending()
        while True:
            sealed = segment < self.spool.active_segment()
            records = self.spool.read(segment, offset, self.batch_spans)
            if records:
                if not sealed and self._should_wait(records):
                    continue
                self._write(records)
                offset = records[-1].end
            elif sealed:
                self.spool.drop_segment(segment)
                segment = min((s for s in self.spool.segments() if s > segment), default=segment + 1)
                offset = 0
            elif self._stop.is_set():
                return
            else:
                self.spool.wait_for_data(self.flush_interval_s)

    def _replay_pending(self) -> tuple[int, int]:
        """After a restart: re-insert the batch that was in flight, with its token; then go on."""
        segments = self.spool.segments()
        pending = self.spool.pending()
        if pending is None or pending.segment not in segments:
            return segments[0], 0
        if pending != self._inserted:  # not when resuming after an error, once it is in
            records = self.spool.read(pending.segment, pending.start, 1 << 62, stop=pending.end)
            if records:
                self._insert(records, pending)
        return pending.segment, pending.end

    def _should_wait(self, records: list[Record]) -> bool:
        """Small batch: wait for more until the oldest has waited flush_interval_s (or stopping)."""
        if sum(r.span_count for r in records) >= self.batch_spans or self._stop.is_set():
            return False
        now = time.monotonic()
        if self._waiting_since is None:
            self._waiting_since = now
        remaining = self.flush_interval_s - (now - self._waiting_since)
        if remaining <= 0:
            return False
        self.spool.wait_for_data(remaining)
        return True

    def _write(self, records: list[Record]) -> None:
        pending = Pending(records[0].segment, records[0].start, records[-1].end)
        self.spool.mark_pending(pending)
        self._insert(records, pending)
        self._waiting_since = None

    def _insert(self, records: list[Record], pending: Pending) -> None:
        items = sum(record.span_count for record in records)
        unrenderable: dict[int, str] = {}  # record start → why

        def blocks() -> Iterator[Any]:  # Any: what this sink's `render` makes, as its `insert` takes it
            """Rendered as the insert streams: the server parses a block while the next renders."""
            for record in records:
                try:
                    yield self.sink.render(record.payload)
                except INVALID as exc:  # spooled by an older version that accepted it
                    unrenderable[record.start] = str(exc)

        backoff_s = 0.05
        while True:
            try:
                self.sink.insert(blocks(), self.spool.token(pending))
                break
            except Exception as exc:  # noqa: BLE001 — ClickHouse down or refusing: keep the batch, retry
                self.metrics.add(self.signal.counter("insert_retries"))
                log.warning("insert of %d %s failed (%s); retrying in %.2fs", items, self.signal.item, exc, backoff_s)
                if self._stop.is_set() or self._stop.wait(backoff_s):
                    raise _Abandoned from None  # stopping while ClickHouse fails: the batch stays spooled
                backoff_s = min(backoff_s * 2, self.max_backoff_s)
        quarantined = self._set_aside(records, unrenderable)
        self.metrics.add(f"{self.signal.item}_written", items - quarantined)
        self.spool.inserted(pending.end - pending.start)
        self._inserted = pending

    def _set_aside(self, records: list[Record], unrenderable: dict[int, str]) -> int:
        """Quarantines the records that could not be rendered; returns their item count."""
        quarantined = 0
        for record in records:
            if record.start in unrenderable:
                path = self.spool.quarantine(record, unrenderable[record.start])
                log.error(
                    "%d spooled %s cannot be rendered (%s); kept in %s",
                    record.span_count,
                    self.signal.item,
                    unrenderable[record.start],
                    path,
                )
                quarantined += record.span_count
        self.metrics.add(f"{self.signal.item}_quarantined", quarantined)
        return quarantined
