"""The API process's side of the engine process (`phaselens serve --engine process`).

`EngineClient` is what the routes call (api.ServingEngine), as vLLM V1's AsyncLLM is for its
EngineCore: it spawns `python -m phaselens.reference_server.process.engine_core` with one end of a Unix
socket pair, sends the config and waits for READY (the model loads there; this process loads only
the tokenizer), then, attached to the event loop, sends ADD/ABORT frames and reads OUTPUTS frames
on the loop itself (`add_reader`): no engine thread competes with the loop for this process's GIL.

Stamps (docs/engine-process.md): `enqueued` is stamped here as the request is handed over; the
engine's `scheduled`/`preempted` and prefill chunks keep the engine's CLOCK_MONOTONIC ns (one clock
for every process of the host); `first_token`, `token` and `finished` are stamped here as the loop
reads them, so the `first_token` term ends where the first token reached this process's response
stream, the engine → API hop included, as in thread mode where the engine thread hands it over.
Every term stays a duration on one clock, and the budget identity stays exact.

The engine process's death (end of file on the socket) fails every request in flight with an
`error` output naming its exit status, `health()` turns "unhealthy" and new requests get
EngineDeadError (503); the dead child is reaped. `stop()` asks it to exit, waits, kills it past
the timeout: no orphan.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import socket
import subprocess
import sys
from dataclasses import asdict, dataclass
from typing import Any

from phaselens.common.clocks import MonoTs
from phaselens.instrumentation import FINISH_ABORT, FINISH_ERROR, NULL_STEP, RequestObserver, StepObserver, StepStats
from phaselens.instrumentation.hotpath import RequestTimeline
from phaselens.reference_server.engine.config import EngineConfig
from phaselens.reference_server.engine.engine import EngineDeadError, QueueFullError, check_length
from phaselens.reference_server.engine.model_loader import load_tokenizer
from phaselens.reference_server.engine.sequence import SamplingParams, SeqOutput, Sink
from phaselens.reference_server.process import engine_wire as wire

log = logging.getLogger(__name__)
DEFAULT_START_TIMEOUT_S = 300.0
_RECV_BYTES = 1 << 20
_REAP_POLL_S = 0.05
_EXIT_WAIT_S = 0.5


@dataclass(slots=True)
class _Live:
    """A request in the engine process, as this side knows it."""

    observer: RequestObserver
    timeline: RequestTimeline | None  # the observer, when it takes the engine's own stamps
    sink: Sink
    waiting: bool = True  # in the engine's waiting queue (from the hand-over to `scheduled`)


class EngineClient:
    """api.ServingEngine over an engine process. Construction spawns it and waits for READY
    (ValueError: the config or the model is bad, with the engine process's message)."""

    def __init__(
        self, config: EngineConfig, observe_steps: bool = False, start_timeout_s: float = DEFAULT_START_TIMEOUT_S
    ) -> None:
        config.validate()
        self.config = config
        self.step_observer: StepObserver = NULL_STEP  # steps arrive only with observe_steps
        self._live: dict[int, _Live] = {}
        self._ids = itertools.count(1)
        self._waiting = 0
        self._health = (0, 0, 0)  # running, waiting, kv_blocks_used, as of the last OUTPUTS frame
        self._reader = wire.FrameReader()
        self._pending = bytearray()  # frames the socket did not take yet
        self._loop: asyncio.AbstractEventLoop | None = None
        self.error = ""  # why the engine process is gone, once it is
        self.tokenizer, self.add_special_tokens, self.model_name = load_tokenizer(config.model)
        self._sock, self._proc = self._spawn(observe_steps)
        ready = self._wait_ready(start_timeout_s)
        _, self.max_model_len, self.vocab_size, self.kv_blocks_total, self.pid = ready

    def _spawn(self, observe_steps: bool) -> tuple[socket.socket, subprocess.Popen[bytes]]:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            module = "phaselens.reference_server.process.engine_core"
            command = [sys.executable, "-m", module, str(theirs.fileno())]
            proc = subprocess.Popen(command, pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL)
        finally:
            theirs.close()
        ours.sendall(wire.frame((wire.CONFIG, asdict(self.config), observe_steps)))
        return ours, proc

    def _wait_ready(self, timeout_s: float) -> tuple[Any, ...]:
        """The READY message; otherwise the process is killed and reaped, and ValueError raised."""
        self._sock.settimeout(timeout_s)
        try:
            return self._read_ready(timeout_s)
        except ValueError:
            self._sock.close()
            self._proc.kill()
            self._proc.wait()
            raise

    def _read_ready(self, timeout_s: float) -> tuple[Any, ...]:
        while True:
            try:
                data = self._sock.recv(_RECV_BYTES)
            except TimeoutError:
                raise ValueError(f"the engine process was not ready within {timeout_s:.0f} s") from None
            if not data:
                try:
                    status: int | None = self._proc.wait(10)
                except subprocess.TimeoutExpired:
                    status = None
                raise ValueError(f"the engine process exited before it was ready ({self._describe(status)})")
            for message in self._reader.feed(data):
                if message[0] == wire.FAILED:
                    raise ValueError(message[1])
                return message

    # --- the routes' interface (api.ServingEngine) ------------------------------------------------
    @property
    def alive(self) -> bool:
        return not self.error

    @property
    def num_waiting(self) -> int:
        return self._waiting

    def health(self) -> dict[str, object]:
        running, waiting, used = self._health
        body: dict[str, object] = {
            "status": "ok" if self.alive else "unhealthy",
            "running": running if self.alive else 0,
            "waiting": waiting if self.alive else 0,
            "kv_blocks_used": used if self.alive else 0,
            "kv_blocks_total": self.kv_blocks_total,
            "engine_pid": self.pid,
        }
        if self.error:
            body["error"] = self.error
        return body

    def attach(self) -> None:
        """From now on on this event loop: outputs are read here, frames written without blocking."""
        self._loop = asyncio.get_running_loop()
        self._sock.setblocking(False)
        self._loop.add_reader(self._sock.fileno(), self._readable)

    def submit(self, prompt_ids: list[int], params: SamplingParams, observer: RequestObserver, sink: Sink) -> int:
        """Hand a request to the engine process; its outputs go to `sink` on the event loop.
        Raises EngineDeadError, QueueFullError or ValueError (too long), as the thread engine does."""
        if self.error:
            raise EngineDeadError(f"the engine process is gone ({self.error})")
        check_length(len(prompt_ids), params.max_tokens, self.max_model_len)
        if self._waiting >= self.config.max_waiting:
            raise QueueFullError(f"waiting queue full ({self.config.max_waiting})")
        req_id = next(self._ids)
        timeline = observer if isinstance(observer, RequestTimeline) else None
        self._live[req_id] = _Live(observer, timeline, sink)
        self._waiting += 1
        observer.enqueued()
        self._write(wire.frame((wire.ADD, req_id, list(prompt_ids), wire.encode_params(params))))
        return req_id

    def abort(self, seq_id: int) -> None:
        if seq_id in self._live and not self.error:
            self._write(wire.frame((wire.ABORT, seq_id)))

    def stop(self, timeout_s: float = 10.0) -> None:
        """Ask the engine process to exit; kill it past `timeout_s`. Requests still in flight finish
        as aborted (as the thread engine's stop)."""
        if self._loop is not None and not self._loop.is_closed():
            self._loop.remove_reader(self._sock.fileno())
            self._loop.remove_writer(self._sock.fileno())
        try:
            self._sock.setblocking(True)
            self._sock.sendall(bytes(self._pending) + wire.frame((wire.STOP,)))
        except OSError:
            pass
        try:
            self._proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            log.error("the engine process did not stop within %.1f s: killed", timeout_s)
            self._proc.kill()
            self._proc.wait()
        self._sock.close()
        self._fail_all(FINISH_ABORT, "")
        self.error = self.error or "stopped"

    # --- the event loop's side -------------------------------------------------------------------
    def _write(self, data: bytes) -> None:
        if self._loop is None:
            self._sock.sendall(data)
            return
        if self._pending:
            self._pending += data
            return
        try:
            sent = self._sock.send(data)
        except BlockingIOError:
            sent = 0
        except OSError:
            self._lost()
            return
        if sent < len(data):
            self._pending += data[sent:]
            self._loop.add_writer(self._sock.fileno(), self._writable)

    def _writable(self) -> None:
        try:
            sent = self._sock.send(self._pending)
        except BlockingIOError:
            return
        except OSError:
            self._lost()
            return
        del self._pending[:sent]
        if not self._pending and self._loop is not None:
            self._loop.remove_writer(self._sock.fileno())

    def _readable(self) -> None:
        try:
            data = self._sock.recv(_RECV_BYTES)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if not data:
            self._lost()
            return
        for message in self._reader.feed(data):
            if message[0] == wire.OUTPUTS:
                self._outputs(message[1], message[2], message[3])

    def _outputs(self, entries: list[Any], steps: list[Any], health: tuple[int, int, int]) -> None:
        self._health = health
        live = self._live
        for stats, req_ids in steps:  # before the entries: a request finished this turn is still here
            self.step_observer.step(StepStats(*stats), [live[i].observer for i in req_ids if i in live])
        for req_id, events, out in entries:
            request = live.get(req_id)
            if request is None:
                continue
            if events:
                self._replay(request, events)
            if out is not None:
                output = wire.decode_output(out)
                if output.finish_reason is not None:
                    del live[req_id]
                    self._waiting -= request.waiting
                request.sink(output)

    def _replay(self, request: _Live, events: list[int]) -> None:
        """The engine's stamps onto the request's observer (module docstring: whose clock each keeps).
        `events` mixes kinds, counts and stamps: a stamp gets its type (`MonoTs`) where it is read."""
        observer, timeline, i = request.observer, request.timeline, 0
        while i < len(events):
            kind = events[i]
            if kind == wire.EV_SCHEDULED or kind == wire.EV_PREEMPTED:
                scheduled = kind == wire.EV_SCHEDULED
                if timeline is None:
                    (observer.scheduled if scheduled else observer.preempted)()
                else:
                    (timeline.scheduled_at if scheduled else timeline.preempted_at)(MonoTs(events[i + 1]))
                self._waiting += (not scheduled) - request.waiting
                request.waiting = not scheduled
            elif kind == wire.EV_CHUNK:
                observer.prefill_chunk(MonoTs(events[i + 1]), MonoTs(events[i + 2]), events[i + 3], events[i + 4])
            elif kind == wire.EV_FIRST_TOKEN:
                observer.first_token()
            elif kind == wire.EV_TOKEN:
                observer.token(events[i + 1])
            elif kind == wire.EV_FINISHED:
                observer.finished(wire.REASONS[events[i + 1]])
            i += 1 + wire.EVENT_ARGS[kind]

    def _lost(self) -> None:
        """End of file: the engine process is gone. Fail what was in flight, then reap it."""
        if self.error:
            return
        try:  # its socket closed as it exited: its status follows within moments (the loop waits once)
            status: int | None = self._proc.wait(_EXIT_WAIT_S)
        except subprocess.TimeoutExpired:  # closed its socket yet lives: of no use, and not to be orphaned
            status = None
            self._proc.kill()
        self.error = f"the engine process exited ({self._describe(status)})"
        log.error("%s: %d requests in flight failed", self.error, len(self._live))
        if self._loop is not None:
            self._loop.remove_reader(self._sock.fileno())
            self._loop.remove_writer(self._sock.fileno())
        self._fail_all(FINISH_ERROR, self.error)
        self._reap()

    def _reap(self) -> None:
        """Wait for a killed child without blocking the loop."""
        if self._proc.poll() is None and self._loop is not None and not self._loop.is_closed():
            self._loop.call_later(_REAP_POLL_S, self._reap)

    @staticmethod
    def _describe(status: int | None) -> str:
        if status is None:
            return "its socket closed"
        return f"killed by signal {-status}" if status < 0 else f"exit status {status}"

    def _fail_all(self, reason: str, error: str) -> None:
        live, self._live, self._waiting = self._live, {}, 0
        for request in live.values():
            request.observer.finished(reason)
            request.sink(SeqOutput(finish_reason=reason, error=error))
