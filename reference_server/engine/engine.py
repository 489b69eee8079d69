"""The serving loop: one thread running `step()` while there is work, and a step reads

    batch = scheduler.schedule()           → stamp queue waits: preempted, scheduled
    token_ids = runner.run(batch)          → stamp prefill chunks (the step's start → forward end)
    scheduler.postprocess(batch, token_ids) → stamp first_token / token, finish, hand out the text
                                            → step observer

The scheduler owns the queues and the KV blocks and decides what each token does to its sequence;
the runner owns the model; the engine owns the threads, the observers and the streams.

Other threads talk to it only through `submit()` and `abort()` (a locked inbox drained at the top
of each iteration). Disaggregated serving adds three more inboxes (`receive_kv`, `claim`, and the
KV sender's releases) and one seam: a sequence with a KV handoff leaves the batch after its first
token (see reference_server.engine.disagg). Results go out through each sequence's `sink` on the loop thread; the API
layer's sink hops to its event loop with `call_soon_threadsafe`. Token stamps come after the
step's single host sync (`.tolist()` inside `run`), never after a kernel launch.

A fault in one request is that request's error, never its batch's: a row that fails to sample or a
token that fails to detokenize fails its sequence alone (scheduler), and a forward that raises
fails the requests new to that step (the culprit cannot be found cheaply) while the rest rerun the
same step: the same KV slots, the same greedy ids. Only a step that fails again fails its batch.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Any

from phaselens.common.clocks import MonoTs, monotonic_ts
from phaselens.instrumentation import (
    FINISH_ABORT,
    FINISH_ERROR,
    NULL_REQUEST,
    NULL_STEP,
    RequestObserver,
    StepObserver,
    StepStats,
)
from phaselens.reference_server.engine.config import EngineConfig
from phaselens.reference_server.engine.detokenizer import TextTracker
from phaselens.reference_server.engine.disagg import (
    DEFAULT_STAGE_TIMEOUT_S,
    KvHandoff,
    KvSender,
    ReceivedKv,
    check_header,
)
from phaselens.reference_server.engine.model_runner import ModelRunner
from phaselens.reference_server.engine.scheduler import Batch, Scheduler
from phaselens.reference_server.engine.sequence import (
    FINISH_TRANSFERRED,
    SamplingParams,
    SeqOutput,
    SeqStatus,
    Sequence,
    Sink,
    _drop,
)

log = logging.getLogger(__name__)


class QueueFullError(RuntimeError):
    """The waiting queue holds `max_waiting` requests: the caller should answer 503."""


@dataclass(slots=True)
class EngineStats:
    steps: int = 0
    preemptions: int = 0
    prefill_tokens: int = 0
    decode_tokens: int = 0
    finished: int = 0
    aborted: int = 0
    failed_requests: int = 0  # ended by an engine fault (finish reason "error")
    failed_steps: int = 0
    kv_sent: int = 0  # transfers acknowledged by a decode instance
    kv_send_failed: int = 0
    kv_received: int = 0  # transfers staged here
    kv_refused: int = 0
    kv_expired: int = 0  # staged, never claimed within the stage timeout: freed


class EngineDeadError(RuntimeError):
    """The engine process is gone: the caller should answer 503 (reference_server.process.engine_client)."""


def check_length(prompt_tokens: int, max_tokens: int, max_model_len: int) -> None:
    """ValueError unless 1 <= prompt + max_tokens <= the context, with a prompt."""
    if prompt_tokens + max_tokens > max_model_len or not prompt_tokens:
        raise ValueError(
            f"prompt ({prompt_tokens}) + max_tokens ({max_tokens}) must be "
            f"between 1 and the context length {max_model_len}"
        )


class Engine:
    def __init__(
        self, config: EngineConfig, runner: ModelRunner | None = None, step_observer: StepObserver = NULL_STEP
    ) -> None:
        config.validate()
        self.config = config
        self.runner = runner or ModelRunner(config)
        self.scheduler = Scheduler(config, self.runner.loaded.eos_ids, self.runner.max_model_len)
        self.step_observer = step_observer
        self.stats = EngineStats()
        self._ids = itertools.count(1)
        self._live: dict[int, Sequence] = {}
        self._inbox: deque[Sequence] = deque()
        self._aborts: deque[int] = deque()
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._releases: deque[int] = deque()  # KV handoffs the sender is done with
        self._incoming: deque[ReceivedKv] = deque()  # transfers to stage
        self._staged: dict[str, tuple[Sequence, int]] = {}  # transfer id → (sequence, deadline ns)
        self._claims: deque[Sequence] = deque()
        self._sender: KvSender | None = None
        self.stage_timeout_ns = int(DEFAULT_STAGE_TIMEOUT_S * 1e9)

    @property
    def tokenizer(self):
        return self.runner.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.runner.max_model_len

    @property
    def vocab_size(self) -> int:
        config: Any = self.runner.loaded.model.config  # a transformers PretrainedConfig
        return int(config.vocab_size)

    @property
    def add_special_tokens(self) -> bool:
        return self.runner.loaded.add_special_tokens

    @property
    def model_name(self) -> str:
        return self.runner.loaded.name

    def health(self) -> dict[str, object]:
        """What /health reports: the load and the KV pool (this thread engine is always "ok")."""
        blocks = self.scheduler.blocks
        return {
            "status": "ok",
            "running": self.num_running,
            "waiting": self.num_waiting,
            "kv_blocks_used": blocks.num_used,
            "kv_blocks_total": blocks.num_blocks,
        }

    @property
    def num_waiting(self) -> int:
        return len(self._inbox) + len(self.scheduler.waiting)

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    def submit(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        observer: RequestObserver = NULL_REQUEST,
        sink: Sink = _drop,
        handoff: KvHandoff | None = None,
    ) -> int:
        """Queue a request; returns its id. Raises QueueFullError or ValueError (too long). With
        `handoff` (a prefill instance), its KV goes to a decode instance after its first token."""
        check_length(len(prompt_ids), params.max_tokens, self.max_model_len)
        seq = Sequence(
            seq_id=next(self._ids),
            token_ids=list(prompt_ids),
            num_prompt_tokens=len(prompt_ids),
            params=params,
            observer=observer,
            sink=sink,
            text=TextTracker(self.runner.loaded.decode, params.reasoning_tokens, params.stop),
            generator=self.runner.generator_for(params.seed),
            handoff=handoff,
        )
        with self._lock:
            if self.num_waiting >= self.config.max_waiting:
                raise QueueFullError(f"waiting queue full ({self.config.max_waiting})")
            self._inbox.append(seq)
            observer.enqueued()
        self._wake.set()
        return seq.seq_id

    def receive_kv(self, transfer: ReceivedKv, timeout_s: float = 10.0) -> None:
        """Decode instance, receiver thread: stage a transfer's KV (the loop writes it into the pool);
        returns once it is staged, raises ValueError when it cannot be."""
        self.check_kv_header(transfer.transfer.header)
        with self._lock:
            self._incoming.append(transfer)
        self._wake.set()
        if not transfer.done.wait(timeout_s):
            raise ValueError(f"the engine did not stage the KV within {timeout_s} s")
        if transfer.error:
            raise ValueError(transfer.error)

    def check_kv_header(self, header: dict[str, object]) -> None:
        """ValueError when this engine cannot continue a transfer with this header (disagg.check_header)."""
        check_header(header, self.runner.cache, self.runner.loaded.name, self.max_model_len)

    def claim(
        self, transfer_id: str, params: SamplingParams, observer: RequestObserver = NULL_REQUEST, sink: Sink = _drop
    ) -> int:
        """Decode instance: the request whose prompt KV arrived as `transfer_id` continues here;
        returns its id. KeyError when no such transfer is staged."""
        with self._lock:
            seq, _ = self._staged.pop(transfer_id)
            seq.params, seq.observer, seq.sink = params, observer, sink
            seq.text = TextTracker(self.runner.loaded.decode, params.reasoning_tokens, params.stop)
            seq.generator = self.runner.generator_for(params.seed)
            self._claims.append(seq)
            observer.enqueued()
        self._wake.set()
        return seq.seq_id

    @property
    def num_staged(self) -> int:
        return len(self._staged)

    def abort(self, seq_id: int) -> None:
        """Cancel a request (client went away); its KV is freed at the top of the next iteration."""
        with self._lock:
            self._aborts.append(seq_id)
        self._wake.set()

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="engine-loop", daemon=True)
        self._thread.start()

    def stop(self, timeout_s: float = 10.0) -> None:
        """Stop the loop; every request still in the engine finishes as aborted."""
        self._stopping = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout_s)
            if self._thread.is_alive():  # a forward still running: its state is not ours to touch
                log.error("engine loop did not stop within %.1f s", timeout_s)
                return
        if self._sender is not None:
            self._sender.stop()
        self._drain()
        for seq in list(self._live.values()):
            self._end(seq, FINISH_ABORT)

    def _loop(self) -> None:
        while not self._stopping:
            self._wake.clear()
            if not self.iterate():
                self._wake.wait(0.5)

    def iterate(self) -> bool:
        """One turn of the loop: drain the inboxes, then one step when there is work; False when
        idle. A failed step must not kill the loop: its batch fails, the loop goes on. The engine
        process (reference_server.process.engine_core) drives the engine with this, without the thread."""
        try:
            self._drain()
            if not self.scheduler.has_work():
                return False
            self.step()
        except Exception:
            log.exception("engine step failed")
            self.stats.failed_steps += 1
            try:
                self._fail_running()
            except Exception:
                log.exception("failing the running batch failed")
        return True

    def step(self) -> Batch:
        """One iteration: schedule → run → postprocess, observer stamps at the seams (module
        docstring). Public so tests can drive the engine without the thread."""
        self._drain()
        start_ts = monotonic_ts()
        batch = self.scheduler.schedule()
        self._stamp_waits(batch)
        self._hand_out_received(batch)
        if batch.items:
            token_ids = self._run(batch)
            self._stamp_prefill(batch, start_ts, monotonic_ts())
            self.scheduler.postprocess(batch, token_ids)
            self._hand_out(batch)
            self._record_step(batch, start_ts)
        self.stats.preemptions += batch.preemptions
        return batch

    def _run(self, batch: Batch) -> list[int]:
        """The forward; when it raises, the requests admitted this step fail and the rest rerun once
        (module docstring). Raises when nothing was new, or when the rerun fails too."""
        try:
            return self.runner.run(batch)
        except Exception as exc:
            if not batch.admitted:
                raise
            log.warning("forward failed; failing the %d requests new to the step: %s", len(batch.admitted), exc)
            self.stats.failed_steps += 1
            new = batch.admitted
            batch.items = [item for item in batch.items if item.seq not in new]
            error = f"the forward pass failed with this request new in its batch: {type(exc).__name__}"
            for seq in new:
                self._close(seq, self.scheduler.finish(seq, FINISH_ERROR, SeqOutput(error=error)))
        return self.runner.run(batch) if batch.items else []

    @staticmethod
    def _stamp_waits(batch: Batch) -> None:
        for seq in batch.preempted:  # before the admissions: see Batch
            seq.observer.preempted()
        for seq in batch.admitted:
            seq.observer.scheduled()

    @staticmethod
    def _stamp_prefill(batch: Batch, start_ts: MonoTs, run_end_ts: MonoTs) -> None:
        """A chunk spans the whole step that ran it: scheduling, input building and the forward."""
        for item in batch.items:
            if item.prefill:
                item.seq.observer.prefill_chunk(start_ts, run_end_ts, item.num_tokens, item.cached_tokens)

    @staticmethod
    def _hand_out_received(batch: Batch) -> None:
        """Decode instance: a sequence admitted with received KV hands out its first token (sampled
        by the prefill instance) as it takes its seat, before this step's forward."""
        for seq in batch.received:
            seq.observer.first_token()
            out, seq.received_output = seq.received_output, None
            if out is not None:
                seq.sink(out)

    def _hand_out(self, batch: Batch) -> None:
        """Per sampled token: stamp it, then stream its text (a finished sequence: its final output)."""
        for item in batch.items:
            out = item.output
            if out is None:
                continue
            seq = item.seq
            if seq.num_output_tokens == 1:
                seq.observer.first_token()
            else:
                seq.observer.token(1)
            if out.finish_reason is not None:
                self._close(seq, out)
            elif seq.handoff is not None and seq.num_output_tokens == 1:
                self._hand_off(seq)
            else:
                seq.sink(out)

    def _hand_off(self, seq: Sequence) -> None:
        """Prefill instance: the first token is out; the KV goes to the decode instance, which
        hands out that token's text. The blocks stay held until the sender releases them."""
        self.scheduler.detach(seq)
        if self._sender is None:
            self._sender = KvSender(self.runner.cache, self.runner.loaded.name, self._release)
        self._sender.send(seq)

    def _release(self, seq_id: int) -> None:
        with self._lock:
            self._releases.append(seq_id)
        self._wake.set()

    def _end(self, seq: Sequence, reason: str) -> None:
        """Finish `seq` from outside a step (abort, error, stop)."""
        self._close(seq, self.scheduler.finish(seq, reason))

    def _close(self, seq: Sequence, out: SeqOutput) -> None:
        """A finished sequence (its KV already freed by the scheduler): count it, tell the observer,
        then the stream."""
        self._live.pop(seq.seq_id, None)
        self.stats.finished += out.finish_reason != FINISH_ABORT
        self.stats.aborted += out.finish_reason == FINISH_ABORT
        self.stats.failed_requests += out.finish_reason == FINISH_ERROR
        seq.observer.finished(out.finish_reason)
        seq.sink(out)

    def _record_step(self, batch: Batch, start_ts: MonoTs) -> None:
        prefill, decode = batch.prefill_tokens, batch.decode_tokens
        self.stats.steps += 1
        self.stats.prefill_tokens += prefill
        self.stats.decode_tokens += decode
        blocks = self.scheduler.blocks
        stats = StepStats(
            start_ts,
            monotonic_ts(),
            prefill_tokens=prefill,
            decode_tokens=decode,
            kv_blocks_used=blocks.num_used,
            kv_blocks_total=blocks.num_blocks,
            preemptions=batch.preemptions,
            queue_depth=self.num_waiting,
        )
        self.step_observer.step(stats, [i.seq.observer for i in batch.items])

    def _drain(self) -> None:
        with self._lock:
            arrived, self._inbox = self._inbox, deque()
            aborted, self._aborts = self._aborts, deque()
            released, self._releases = self._releases, deque()
            incoming, self._incoming = self._incoming, deque()
            claimed, self._claims = self._claims, deque()
        for seq in arrived:
            self._live[seq.seq_id] = seq
            self.scheduler.add(seq)
        for seq_id in released:
            self._finish_handoff(self._live[seq_id])
        for transfer in incoming:
            self._stage(transfer)
        for seq in claimed:
            self._admit_claimed(seq)
        for seq_id in aborted:
            seq = self._live.get(seq_id)
            if seq is not None and seq.status != SeqStatus.TRANSFERRING:  # its release ends it
                self._end(seq, FINISH_ABORT)
        if self._staged:
            self._expire_staged()

    def _finish_handoff(self, seq: Sequence) -> None:
        handoff = seq.handoff
        assert isinstance(handoff, KvHandoff)
        self.stats.kv_sent += not handoff.error
        self.stats.kv_send_failed += bool(handoff.error)
        out = SeqOutput(error=handoff.error)
        self._close(seq, self.scheduler.finish(seq, FINISH_ERROR if handoff.error else FINISH_TRANSFERRED, out))

    def _stage(self, received: ReceivedKv) -> None:
        """Reserve blocks for a transfer's prompt KV and write its bytes into them."""
        header = received.transfer.header
        seq = Sequence(
            seq_id=next(self._ids),
            token_ids=list(header["token_ids"]),
            num_prompt_tokens=int(header["num_prompt_tokens"]),
            params=SamplingParams(),
            text=TextTracker(self.runner.loaded.decode),
        )
        if self.scheduler.stage(seq):
            try:
                self.runner.cache.import_blocks(seq.block_table, received.transfer.parts)
            except (ValueError, RuntimeError) as exc:
                self.scheduler.finish(seq, FINISH_ABORT)
                received.error = f"the KV bytes do not fit this cache: {exc}"
        else:
            received.error = f"no room: {len(header['token_ids'])} tokens need more KV blocks than are free"
        if not received.error:
            with self._lock:
                self._staged[received.transfer_id] = (seq, time.monotonic_ns() + self.stage_timeout_ns)
        self.stats.kv_received += not received.error
        self.stats.kv_refused += bool(received.error)
        received.done.set()

    def _admit_claimed(self, seq: Sequence) -> None:
        """A claimed transfer joins the received queue with its first token's text ready; a first
        token that already ends it (a stop string) finishes it at once."""
        self._live[seq.seq_id] = seq
        reason, out = self.scheduler.receive_first_token(seq)
        if reason is None:
            seq.received_output = out
            self.scheduler.add_received(seq)
            return
        seq.observer.scheduled()
        seq.observer.first_token()
        self._close(seq, self.scheduler.finish(seq, reason, out))

    def _expire_staged(self) -> None:
        now = time.monotonic_ns()
        with self._lock:
            expired = [tid for tid, (_, deadline) in self._staged.items() if deadline <= now]
            seqs = [self._staged.pop(tid)[0] for tid in expired]
        for seq in seqs:
            self.scheduler.finish(seq, FINISH_ABORT)
            self.stats.kv_expired += 1

    def _fail_running(self) -> None:
        for seq in list(self.scheduler.running):
            self._end(seq, FINISH_ERROR)
