"""The engine process (`phaselens serve --engine process`): the serving loop without the HTTP server.

    python -m phaselens.reference_server.process.engine_core FD     FD: its end of the socket pair

It reads the EngineConfig (a dict, the first frame), loads the model, answers READY (or FAILED and
exits 1), then turns the loop on its own main thread, with no other Python thread to share the
GIL with (vLLM V1's EngineCore, in this engine's shape):

    read what arrived (ADD → submit, ABORT → abort; block while idle)
    engine.iterate()           drain → schedule → run → postprocess, the observer stamps at the seams
    send one OUTPUTS frame     the turn's outputs and stamps, in the order they were made

The request observer here is a `StampLog`: it appends integers (the kind, monotonic ns) to a list,
nothing more; the API process replays them onto the request's handle (engine_client), where its
spans are built as in thread mode. Steps are logged the same way (`StepLog`) and linked there.
The process ends at STOP, or when the API process is gone (end of file on the socket: it never
outlives its server), exit status 0; SIGINT (a terminal's ^C to the process group) is left to
the API process, which stops it.
"""

from __future__ import annotations

import logging
import os
import selectors
import signal
import socket
import sys
from collections.abc import Sequence
from time import monotonic_ns
from typing import Any

from phaselens.common.clocks import MonoTs
from phaselens.instrumentation import FINISH_ERROR
from phaselens.reference_server.engine.config import EngineConfig
from phaselens.reference_server.engine.engine import Engine, QueueFullError
from phaselens.reference_server.engine.sequence import SeqOutput
from phaselens.reference_server.process import engine_wire as wire

log = logging.getLogger(__name__)
IDLE_POLL_S = 0.5
_RECV_BYTES = 1 << 20


class StampLog:
    """observer.RequestObserver of one request inside the engine process: `events` is the flat list
    engine_wire describes; `enqueued` is the API process's own stamp (the hand-over to the engine)."""

    __slots__ = ("dirty", "events", "req_id")

    def __init__(self, req_id: int, dirty: list[StampLog]) -> None:
        self.req_id = req_id
        self.events: list[int] = []
        self.dirty = dirty  # the logs with events not yet sent

    def _log(self, *event: int) -> None:
        if not self.events:
            self.dirty.append(self)
        self.events += event

    def take(self) -> list[int]:
        events, self.events = self.events, []
        return events

    def enqueued(self) -> None: ...

    def scheduled(self) -> None:
        self._log(wire.EV_SCHEDULED, monotonic_ns())

    def prefill_chunk(self, start_ts: MonoTs, end_ts: MonoTs, tokens: int, cached_tokens: int) -> None:
        self._log(wire.EV_CHUNK, start_ts, end_ts, tokens, cached_tokens)

    def first_token(self) -> None:
        self._log(wire.EV_FIRST_TOKEN)

    def token(self, n: int = 1) -> None:
        self._log(wire.EV_TOKEN, n)

    def preempted(self) -> None:
        self._log(wire.EV_PREEMPTED, monotonic_ns())

    def finished(self, reason: str) -> None:
        self._log(wire.EV_FINISHED, wire.REASON_INDEX[reason])


class StepLog:
    """observer.StepObserver inside the engine process: each step's stats and its members' ids."""

    __slots__ = ("steps",)

    def __init__(self) -> None:
        self.steps: list[tuple[tuple[int, ...], list[int]]] = []

    def step(self, stats: Any, requests: Sequence[Any]) -> None:
        self.steps.append((tuple(stats), [r.req_id for r in requests]))


class EngineCore:
    """The loop of the module docstring, over `sock` (blocking writes, non-blocking reads)."""

    def __init__(self, engine: Engine, sock: socket.socket, observe_steps: bool) -> None:
        self.engine = engine
        self.sock = sock
        self.reader = wire.FrameReader()
        self.dirty: list[StampLog] = []
        self.entries: list[tuple[int, list[int], tuple[Any, ...] | None]] = []
        self.seq_ids: dict[int, int] = {}  # req_id → the engine's seq id
        self.steps = StepLog() if observe_steps else None
        if self.steps is not None:
            engine.step_observer = self.steps
        self.selector = selectors.DefaultSelector()
        self.selector.register(sock, selectors.EVENT_READ)

    def run(self) -> None:
        engine = self.engine
        while self.receive(block=not (engine.scheduler.has_work() or engine.num_waiting)):
            engine.iterate()
            self.send()

    def receive(self, block: bool) -> bool:
        """Handle what arrived; False at STOP or end of file."""
        if block and not self.selector.select(IDLE_POLL_S):
            return True
        while True:
            try:
                data = self.sock.recv(_RECV_BYTES, socket.MSG_DONTWAIT)
            except BlockingIOError:
                return True
            except OSError:
                return False
            if not data:
                return False
            for message in self.reader.feed(data):
                if not self.handle(message):
                    return False

    def handle(self, message: tuple[Any, ...]) -> bool:
        kind = message[0]
        if kind == wire.ADD:
            self.add(message[1], message[2], wire.decode_params(message[3]))
        elif kind == wire.ABORT:
            seq_id = self.seq_ids.get(message[1])
            if seq_id is not None:
                self.engine.abort(seq_id)
        return kind != wire.STOP

    def add(self, req_id: int, prompt_ids: list[int], params: Any) -> None:
        stamps = StampLog(req_id, self.dirty)

        def sink(out: SeqOutput) -> None:
            self.entries.append((req_id, stamps.take(), wire.encode_output(out)))
            if out.finish_reason is not None:
                self.seq_ids.pop(req_id, None)

        try:
            self.seq_ids[req_id] = self.engine.submit(prompt_ids, params, observer=stamps, sink=sink)
        except (QueueFullError, ValueError) as exc:  # the API process checks first: a race, rare
            stamps.finished(FINISH_ERROR)
            sink(SeqOutput(finish_reason=FINISH_ERROR, error=str(exc)))

    def send(self) -> None:
        """One OUTPUTS frame with what this turn made: the entries, then each log's remaining stamps."""
        entries, dirty = self.entries, self.dirty
        for stamps in dirty:
            if stamps.events:
                entries.append((stamps.req_id, stamps.take(), None))
        steps = self.steps.steps if self.steps is not None else []
        if not entries and not steps:
            return
        engine = self.engine
        health = (engine.num_running, engine.num_waiting, engine.scheduler.blocks.num_used)
        self.sock.sendall(wire.frame((wire.OUTPUTS, entries, steps, health)))
        self.entries, self.dirty[:] = [], []
        if self.steps is not None:
            self.steps.steps = []


def main(argv: list[str]) -> int:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.basicConfig(level=logging.WARNING, format="engine process: %(levelname)s %(message)s")
    sock = socket.socket(fileno=int(argv[1]))
    reader = wire.FrameReader()
    messages: list[tuple[Any, ...]] = []
    while not messages:
        data = sock.recv(_RECV_BYTES)
        if not data:
            return 0
        messages = reader.feed(data)
    _, settings, observe_steps = messages[0]  # (CONFIG, EngineConfig fields, observe_steps)
    try:
        engine = Engine(EngineConfig(**settings))
    except (ValueError, OSError) as exc:  # a bad model path or flag: the API process prints it and exits
        sock.sendall(wire.frame((wire.FAILED, f"{exc}")))
        return 1
    blocks = engine.scheduler.blocks.num_blocks
    sock.sendall(wire.frame((wire.READY, engine.max_model_len, engine.vocab_size, blocks, os.getpid())))
    try:
        EngineCore(engine, sock, bool(observe_steps)).run()
    except (BrokenPipeError, ConnectionResetError):  # the API process is gone
        pass
    sock.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
