"""The serving loop: one thread running `step()` while there is work, and a step reads

    batch = scheduler.schedule()           → stamp queue waits: preempted, scheduled
    token_ids = runner.run(batch)          → stamp prefill chunks (the step's start → forward end)
    scheduler.postprocess(batch, token_ids) → stamp first_token / token, finish, hand out the text
                                            → step observer

The scheduler owns the queues and the KV blocks and decides what each token does to its sequence;
the runner owns the model; the engine owns the threads, the observers and the streams.

Other threads talk to it only through `submit()` and `abort()` (a locked inbox drained at the top
of each iteration). Results go out through each sequence's `sink` on the loop thread; the API
layer's sink hops to its event loop with `call_soon_threadsafe`. Token stamps come after the
step's single host sync (`.tolist()` inside `run`), never after a kernel launch.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass

from phaselens.instrumentation.hotpath.observer import (
    FINISH_ABORT,
    FINISH_ERROR,
    NULL_REQUEST,
    NULL_STEP,
    RequestObserver,
    StepObserver,
)
from phaselens.instrumentation.hotpath.records import StepStats
from phaselens.reference_server.config import EngineConfig
from phaselens.reference_server.detokenizer import TextTracker
from phaselens.reference_server.model_runner import ModelRunner
from phaselens.reference_server.scheduler import Batch, Scheduler
from phaselens.reference_server.sequence import SamplingParams, SeqOutput, Sequence, Sink, _drop

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
    failed_steps: int = 0


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

    @property
    def tokenizer(self):
        return self.runner.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.runner.max_model_len

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
    ) -> int:
        """Queue a request; returns its id. Raises QueueFullError or ValueError (too long)."""
        if len(prompt_ids) + params.max_tokens > self.max_model_len or not prompt_ids:
            raise ValueError(
                f"prompt ({len(prompt_ids)}) + max_tokens ({params.max_tokens}) must be "
                f"between 1 and the context length {self.max_model_len}"
            )
        seq = Sequence(
            seq_id=next(self._ids),
            token_ids=list(prompt_ids),
            num_prompt_tokens=len(prompt_ids),
            params=params,
            observer=observer,
            sink=sink,
            text=TextTracker(self.runner.loaded.decode, params.reasoning_tokens, params.stop),
            generator=self.runner.generator_for(params.seed),
        )
        with self._lock:
            if self.num_waiting >= self.config.max_waiting:
                raise QueueFullError(f"waiting queue full ({self.config.max_waiting})")
            self._inbox.append(seq)
            observer.enqueued()
        self._wake.set()
        return seq.seq_id

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
        self._drain()
        for seq in list(self._live.values()):
            self._end(seq, FINISH_ABORT)

    def _loop(self) -> None:
        while not self._stopping:
            self._wake.clear()
            try:
                self._drain()
                if not self.scheduler.has_work():
                    self._wake.wait(0.5)
                    continue
                self.step()
            except Exception:  # a failed step must not kill the loop: fail its batch, go on
                log.exception("engine step failed")
                self.stats.failed_steps += 1
                try:
                    self._fail_running()
                except Exception:
                    log.exception("failing the running batch failed")

    def step(self) -> Batch:
        """One iteration: schedule → run → postprocess, observer stamps at the seams (module
        docstring). Public so tests can drive the engine without the thread."""
        self._drain()
        start_ns = time.monotonic_ns()
        batch = self.scheduler.schedule()
        self._stamp_waits(batch)
        if batch.items:
            token_ids = self.runner.run(batch)
            self._stamp_prefill(batch, start_ns, time.monotonic_ns())
            self.scheduler.postprocess(batch, token_ids)
            self._hand_out(batch)
            self._record_step(batch, start_ns)
        self.stats.preemptions += batch.preemptions
        return batch

    @staticmethod
    def _stamp_waits(batch: Batch) -> None:
        for seq in batch.preempted:  # before the admissions: see Batch
            seq.observer.preempted()
        for seq in batch.admitted:
            seq.observer.scheduled()

    @staticmethod
    def _stamp_prefill(batch: Batch, start_ns: int, run_end_ns: int) -> None:
        """A chunk spans the whole step that ran it: scheduling, input building and the forward."""
        for item in batch.items:
            if item.prefill:
                item.seq.observer.prefill_chunk(start_ns, run_end_ns, item.num_tokens, item.cached_tokens)

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
            if out.finish_reason is None:
                seq.sink(out)
            else:
                self._close(seq, out)

    def _end(self, seq: Sequence, reason: str) -> None:
        """Finish `seq` from outside a step (abort, error, stop)."""
        self._close(seq, self.scheduler.finish(seq, reason))

    def _close(self, seq: Sequence, out: SeqOutput) -> None:
        """A finished sequence (its KV already freed by the scheduler): count it, tell the observer,
        then the stream."""
        self._live.pop(seq.seq_id, None)
        self.stats.finished += out.finish_reason != FINISH_ABORT
        self.stats.aborted += out.finish_reason == FINISH_ABORT
        seq.observer.finished(out.finish_reason)
        seq.sink(out)

    def _record_step(self, batch: Batch, start_ns: int) -> None:
        prefill, decode = batch.prefill_tokens, batch.decode_tokens
        self.stats.steps += 1
        self.stats.prefill_tokens += prefill
        self.stats.decode_tokens += decode
        blocks = self.scheduler.blocks
        stats = StepStats(
            start_ns,
            time.monotonic_ns(),
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
        for seq in arrived:
            self._live[seq.seq_id] = seq
            self.scheduler.add(seq)
        for seq_id in aborted:
            seq = self._live.get(seq_id)
            if seq is not None:
                self._end(seq, FINISH_ABORT)

    def _fail_running(self) -> None:
        for seq in list(self.scheduler.running):
            self._end(seq, FINISH_ERROR)
