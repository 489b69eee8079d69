"""Out-of-process span building, the serving side (`ServerTelemetry(builder="process")`).

Building spans costs ~1 ms of Python per request (SDK spans, step links, metrics, OTLP encoding);
in-process that runs under the serving loop's GIL. Here the serving process keeps only what the
loop stamped and ships it as bytes (`instrumentation.wire`) to a child process
(`instrumentation.span_process`) that runs the same builder and exporters:

- `RootDecider`, on the event-loop thread at receipt: extracts nothing itself (the middleware does),
  takes the sampling decision once with the provider's sampler (parent-based, cheap) and makes the
  trace id (no valid parent) and root span id; the handle holds them in a non-recording span, so
  the app's own spans still nest under the SERVER span the child will create with those ids.
- `ProcessSpanBuilder`, a thread with the SpanBuilder's interface: drains the same hand-offs,
  holds requests the engine is not done with, encodes records (a few µs each) and writes them to
  the child's stdin in one `os.write` per drain (the write itself runs without the GIL).

Never hurts the loop: the hand-offs are bounded (full → dropped, counted); a dead child or a broken
pipe → every later record is dropped and counted in `channel_dropped`, and records shipped that a
dead child never reported receiving in `channel_lost`; nothing raises into the loop.
Steps whose batch holds no sampled request are not shipped (counted `steps_unsampled` here);
unsampled requests are shipped, without a span, because the GenAI metrics count every request.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from opentelemetry.context import Context
from opentelemetry.sdk.trace.id_generator import RandomIdGenerator
from opentelemetry.sdk.trace.sampling import _get_from_env_or_default
from opentelemetry.trace import NonRecordingSpan, SpanContext, SpanKind, TraceFlags, get_current_span

from . import wire
from .builder import BuildOptions, PendingRequests
from .clock import ClockAnchor, ClockNs
from .handle import RequestHandle
from .timeline import BoundedHandOff

PIPE_BYTES = 1 << 20  # F_SETPIPE_SZ: room for ~1000 requests while the child is busy
# one drain and write per interval: each wake-up costs this process GIL time (measured: 20 ms → 0.25 s
# cut the shipper's CPU per request ~4x); flush() and stop() wake it at once
SHIP_INTERVAL_S = 0.25
_F_SETPIPE_SZ = 1031
_PACKAGE_ROOT = str(Path(__file__).resolve().parent.parent)


class ShippedRequestHandle(RequestHandle):
    """A RequestHandle whose root span is built in the child; `link_key` names it in step frames."""

    __slots__ = ("link_key",)

    def __init__(self, span: NonRecordingSpan, *args: Any, **kwargs: Any) -> None:
        RequestHandle.__init__(self, span, *args, **kwargs)
        self.link_key = wire.link_key(span.get_span_context()) if self.sampled else b""


class RootDecider:
    """Sampling decision and root ids for a request, without starting a span."""

    def __init__(self, tracer_provider: Any) -> None:
        # the provider's own sampler and ids when it is an SDK provider, else OTEL_TRACES_SAMPLER's
        self._sampler = getattr(tracer_provider, "sampler", None) or _get_from_env_or_default()
        self._ids = getattr(tracer_provider, "id_generator", None) or RandomIdGenerator()

    def root(self, parent: Context, name: str) -> NonRecordingSpan:
        parent_context = get_current_span(parent).get_span_context()
        trace_id = parent_context.trace_id if parent_context.is_valid else self._ids.generate_trace_id()
        result = self._sampler.should_sample(parent, trace_id, name, SpanKind.SERVER)
        flags = TraceFlags(TraceFlags.SAMPLED if result.decision.is_sampled() else TraceFlags.DEFAULT)
        return NonRecordingSpan(SpanContext(trace_id, self._ids.generate_span_id(), False, flags,
                                            result.trace_state))


class ProcessSpanBuilder:
    """Drains `requests` and `steps` into the span-builder process (same interface as SpanBuilder)."""

    def __init__(self, service_name: str, anchor: ClockAnchor, clock_ns: ClockNs, requests: BoundedHandOff,
                 steps: BoundedHandOff, options: BuildOptions, poll_interval_s: float) -> None:
        self._requests, self._steps = requests, steps
        self._pending = PendingRequests(clock_ns, options.engine_grace_ns)
        self._interval_s = max(poll_interval_s, SHIP_INTERVAL_S)
        self._wake = threading.Event()
        self._hello = wire.frame(wire.KIND_HELLO, (service_name, anchor.mono_ns, anchor.wall_ns,
                                                   options.token_events))
        self._counts = {"records_shipped": 0, "bytes_shipped": 0, "channel_dropped": 0, "encode_errors": 0,
                        "steps_unsampled": 0, "shipper_cpu_ns": 0}
        self._done = 0  # records taken off the hand-offs and shipped, dropped or skipped
        self._flush_asked: list[int] = []  # flush sequence numbers for the shipper to send
        self._child: dict[str, Any] = {}  # the child's last report
        self._sequence = self._acked = 0  # flushes asked / acknowledged by the child
        self._child_changed = threading.Condition()
        self._stop = threading.Event()
        self._proc = self._spawn()
        self._dead = False
        self._shipper = threading.Thread(target=self._run, name="phaselens-span-shipper", daemon=True)
        self._reader = threading.Thread(target=self._read_reports, name="phaselens-span-reports", daemon=True)

    def _spawn(self) -> subprocess.Popen:
        report_read, report_write = os.pipe()
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, (_PACKAGE_ROOT, os.environ.get("PYTHONPATH"))))}
        proc = subprocess.Popen([sys.executable, "-m", "instrumentation.span_process", str(report_write),
                                 str(os.getpid())], stdin=subprocess.PIPE, pass_fds=(report_write,), env=env)
        os.close(report_write)
        self._reports = os.fdopen(report_read, "rb")
        try:
            import fcntl  # POSIX only

            fcntl.fcntl(proc.stdin.fileno(), _F_SETPIPE_SZ, PIPE_BYTES)
        except (ImportError, OSError):  # not Linux, or over /proc/sys/fs/pipe-max-size: the default size
            pass
        return proc

    @property
    def pid(self) -> int:
        return self._proc.pid

    def start(self) -> None:
        self._reader.start()
        self._shipper.start()

    # --- shipper thread ----------------------------------------------------------------------------
    def _run(self) -> None:
        self._send([self._hello], 0)
        while not self._stop.is_set():
            self._drain(force=False)
            self._counts["shipper_cpu_ns"] = time.thread_time_ns()  # what shipping costs this process
            self._wake.wait(self._interval_s)
            self._wake.clear()
        self._drain(force=True)
        try:
            self._proc.stdin.close()  # EOF: the child builds what it holds, exports and exits
        except OSError:
            pass

    def _drain(self, force: bool) -> None:
        """Ship what is ready, and any flush asked for."""
        frames: list[bytes] = []
        steps = requests = 0
        while (step := self._steps.take()) is not None:
            steps += 1
            payload = self._encoded(wire.encode_step, step)
            if payload is None:
                self._counts["steps_unsampled"] += 1
            else:
                frames.append(payload)
        while (handle := self._requests.take()) is not None:
            requests += 1
            self._pending.add(handle)
        ready = self._pending.take_ready(force)
        frames.extend(payload for handle in ready if (payload := self._encoded(wire.encode_request, handle)))
        records = len(frames)
        while self._flush_asked:
            frames.append(wire.frame(wire.KIND_FLUSH, (self._flush_asked.pop(0),)))
        if frames:
            self._send(frames, records)
        self._done += steps + len(ready)

    def _encoded(self, encode, record) -> bytes | None:
        try:
            return encode(record)
        except Exception:  # e.g. a prompt marshal cannot carry: lose this record, counted
            self._counts["encode_errors"] += 1
            return None

    def _send(self, frames: list[bytes], records: int) -> None:
        if self._dead or self._proc.poll() is not None:
            self._dead = True
            self._counts["channel_dropped"] += records
            return
        payload = b"".join(frames)
        data = memoryview(payload)
        try:
            while data:
                data = data[os.write(self._proc.stdin.fileno(), data):]
        except (OSError, ValueError):  # the child is gone (EPIPE) or the pipe was closed
            self._dead = True
            self._counts["channel_dropped"] += records
            return
        self._counts["records_shipped"] += records
        self._counts["bytes_shipped"] += len(payload)

    # --- reports from the child ----------------------------------------------------------------------
    def _read_reports(self) -> None:
        for line in self._reports:
            try:
                report = json.loads(line)
            except ValueError:
                continue
            with self._child_changed:
                self._child = report
                self._acked = max(self._acked, report.get("ack", 0))
                self._child_changed.notify_all()
        with self._child_changed:
            self._dead = True
            self._child_changed.notify_all()

    def counters(self) -> dict[str, int]:
        child = dict(self._child)
        child.pop("ack", None)
        child.pop("final", None)
        alive = not self._dead and self._proc.poll() is None
        counters = {**child, **self._counts, "child_alive": int(alive)}
        # a child that died without its final report: what it never said it received may be lost
        # (a pipe write just before the reader died succeeds, and the bytes go nowhere)
        unconfirmed = self._counts["records_shipped"] - child.get("records_received", 0)
        counters["channel_lost"] = 0 if alive or child.get("final") else max(0, unconfirmed)
        counters["steps_unsampled"] = child.get("steps_unsampled", 0) + self._counts["steps_unsampled"]
        counters["requests_pending"] = child.get("requests_pending", 0) + len(self._pending)
        counters.setdefault("spans_built", 0)
        counters.setdefault("build_errors", 0)
        return counters

    # --- flush and stop --------------------------------------------------------------------------------
    def flush(self, timeout_s: float) -> bool:
        """Wait until every record handed off so far is shipped, then until the child has built and
        exported it (its FLUSH acknowledgement). False on timeout or when the child is gone (what
        could not be shipped is counted in `channel_dropped` by then)."""
        deadline = time.monotonic() + timeout_s
        # counted from what the hand-offs accepted: a record just taken but not yet shipped still counts
        while self._done < sum(h.offered - h.dropped for h in (self._requests, self._steps)):
            if time.monotonic() >= deadline:
                return False
            self._wake.set()
            time.sleep(0.002)
        with self._child_changed:
            self._sequence += 1
            sequence = self._sequence
            self._flush_asked.append(sequence)
            self._wake.set()
            return self._child_changed.wait_for(
                lambda: self._dead or self._acked >= sequence,
                max(0.0, deadline - time.monotonic())) and not self._dead

    def stop(self, timeout_s: float) -> None:
        """Ship everything left (pending requests without waiting for the engine), close the pipe and
        wait for the child to export and exit; kill it when it does not within `timeout_s`."""
        self._stop.set()
        self._wake.set()
        self._shipper.join(timeout_s)
        try:
            self._proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()
        self._reader.join(timeout_s)
        self._reports.close()
