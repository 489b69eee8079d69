"""Iteration-level scheduling: which sequences run this step and how many tokens each computes
(`schedule()`), and what the step's sampled tokens do to them (`postprocess()`). The scheduler owns
the KV blocks: it allocates them on admission and decode growth, frees them on preemption and at
the finish, and publishes full blocks to the prefix cache.

Every step has a token budget (`max_num_batched_tokens`) and a seat limit (`max_num_seqs`).

- `mixed` (Sarathi-style): running decodes first (1 token each), then the unfinished prefills,
  then newly admitted prompts fill what is left of the budget in chunks; decodes never stall
  behind a long prompt.
- `prefill-first`: any prefill work takes the step (chunks up to the budget); decodes run only in
  steps without prefill work, so a long prompt stalls every running decode (visible in the spans).

When a decode needs a new block and none is free, the newest running sequence is preempted by
recompute: its blocks are freed and it goes back to the front of the waiting queue with its
output so far; re-admission recomputes its KV (often from the prefix cache).

Disaggregated serving (docs/disaggregation.md): on a prefill instance a sequence whose KV goes to a
decode instance leaves the running batch after its first token (`detach`) and keeps its blocks
until the transfer is acknowledged; on a decode instance received KV is written into blocks
reserved by `stage`, and the sequence, its first token known, waits in `received` for a seat
(`add_received`); its admission schedules its first decode at once, without a prefill.

A sequence finishes on EOS (unless `ignore_eos`), on a stop string, at `max_tokens`, at the context
length, or when the engine ends it (abort, error); its KV is freed at once. A token that failed to
sample (`FAULT_ID`) or to detokenize fails its own sequence with an error, never the step.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from phaselens.instrumentation import FINISH_ERROR, FINISH_LENGTH, FINISH_STOP
from phaselens.reference_server.engine.block_manager import BlockManager
from phaselens.reference_server.engine.config import POLICY_MIXED, EngineConfig
from phaselens.reference_server.engine.sequence import FAULT_ID, SeqOutput, SeqStatus, Sequence


@dataclass(slots=True)
class ScheduledSeq:
    seq: Sequence
    num_tokens: int  # tokens whose KV this step computes
    prefill: bool
    cached_tokens: int = 0  # prefix-cache hits of this admission (first chunk only)
    samples: bool = True  # a decode, or the chunk that ends the prefill: the step yields a token
    output: SeqOutput | None = None  # what the sampled token released (postprocess)

    @classmethod
    def prefill_chunk(cls, seq: Sequence, num_tokens: int, cached_tokens: int = 0) -> ScheduledSeq:
        ends = seq.num_computed + num_tokens == seq.prefill_target
        return cls(seq, num_tokens, prefill=True, cached_tokens=cached_tokens, samples=ends)


@dataclass(slots=True)
class Batch:
    items: list[ScheduledSeq] = field(default_factory=list)
    # Queue-wait boundaries of this step, for the observers. A preemption always comes before an
    # admission within one step (decodes, which preempt, are scheduled before new prompts, or
    # alone), so stamping `preempted` first, then `admitted`, keeps each request's order.
    preempted: list[Sequence] = field(default_factory=list)
    admitted: list[Sequence] = field(default_factory=list)
    received: list[Sequence] = field(default_factory=list)  # admitted with received KV: first token to hand out

    @property
    def preemptions(self) -> int:
        return len(self.preempted)

    @property
    def prefill_tokens(self) -> int:
        return sum(i.num_tokens for i in self.items if i.prefill)

    @property
    def decode_tokens(self) -> int:
        return sum(i.num_tokens for i in self.items if not i.prefill)


class Scheduler:
    def __init__(self, config: EngineConfig, eos_ids: frozenset[int], max_model_len: int) -> None:
        self.config = config
        self.blocks = BlockManager(config.num_kv_blocks, config.block_size)
        self.eos_ids = eos_ids
        self.max_model_len = max_model_len
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.received: deque[Sequence] = deque()

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.received)

    def detach(self, seq: Sequence) -> None:
        """Prefill instance: `seq` leaves the batch after its first token; its blocks stay held
        (they are being sent) until `finish`."""
        self.running.remove(seq)
        seq.status = SeqStatus.TRANSFERRING

    def stage(self, seq: Sequence) -> bool:
        """Decode instance: reserve blocks for the prompt KV of `seq` (its token_ids: prompt + the
        first token), to be written by the caller; False when they are not free."""
        if self.blocks.blocks_for(seq.num_prompt_tokens) > self.blocks.num_free:
            return False
        self.blocks.reserve(seq, seq.num_prompt_tokens)
        seq.num_computed = seq.prefill_target = seq.num_prompt_tokens
        seq.status = SeqStatus.STAGED
        return True

    def receive_first_token(self, seq: Sequence) -> tuple[str | None, SeqOutput]:
        """Decode instance: the text (and finish reason) of the received first token, by this
        request's own detokenizer and stop rules."""
        return self._check_finish(seq, seq.token_ids[-1])

    def add_received(self, seq: Sequence) -> None:
        seq.status = SeqStatus.WAITING
        self.received.append(seq)

    def schedule(self) -> Batch:
        batch = Batch()
        budget = self.config.max_num_batched_tokens
        if self.config.policy == POLICY_MIXED:
            budget = self._schedule_decodes(batch, budget)
            budget = self._admit_received(batch, budget)
            budget = self._schedule_running_prefills(batch, budget)
            self._admit_waiting(batch, budget)
            return batch
        budget = self._schedule_running_prefills(batch, budget)
        budget = self._admit_waiting(batch, budget)
        if not batch.items:
            self._admit_received(batch, self._schedule_decodes(batch, budget))
        return batch

    def postprocess(self, batch: Batch, token_ids: list[int]) -> None:
        """After the forward: advance each sequence by the KV the step computed, publish its full
        blocks, and append the sampled ids (one per sampling item, in batch order) into
        `item.output`; a sequence that finishes leaves the queues and frees its KV here."""
        sampled = iter(token_ids)
        for item in batch.items:
            seq = item.seq
            seq.num_computed += item.num_tokens
            self.blocks.register_full_blocks(seq)
            if item.samples:
                item.output = self._append_token(seq, next(sampled))

    def finish(self, seq: Sequence, reason: str, out: SeqOutput | None = None) -> SeqOutput:
        """End `seq` (any queue): free its KV at once; on a normal end flush the text the detokenizer
        held back. Returns its final output, `finish_reason` set."""
        out = SeqOutput() if out is None else out
        if seq.status == SeqStatus.RUNNING:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        elif seq in self.received:
            self.received.remove(seq)
        self.blocks.free(seq)
        seq.status = SeqStatus.FINISHED
        if reason in (FINISH_STOP, FINISH_LENGTH):
            rest = seq.text.finish()
            out.reasoning += rest.reasoning
            out.content += rest.content
        seq.finish_reason = out.finish_reason = reason
        out.output_tokens = seq.num_output_tokens
        out.reasoning_tokens = min(seq.num_output_tokens, seq.params.reasoning_tokens)
        out.cached_tokens = seq.cached_tokens
        return out

    def _append_token(self, seq: Sequence, token_id: int) -> SeqOutput:
        if token_id == FAULT_ID:
            return self.finish(seq, FINISH_ERROR, SeqOutput(error="sampling its next token failed"))
        seq.token_ids.append(token_id)
        try:
            reason, out = self._check_finish(seq, token_id)
        except Exception as exc:  # noqa: BLE001 — the detokenizer on this request's ids: its fault, not the batch's
            return self.finish(seq, FINISH_ERROR, SeqOutput(error=f"detokenizing token {token_id} failed: {exc}"))
        return out if reason is None else self.finish(seq, reason, out)

    def _check_finish(self, seq: Sequence, token_id: int) -> tuple[str | None, SeqOutput]:
        """Finish reason (or None) and the text this token releases; EOS adds no text."""
        out = SeqOutput(new_tokens=1, output_tokens=seq.num_output_tokens)  # the count so far: held_back
        if token_id in self.eos_ids and not seq.params.ignore_eos:
            return FINISH_STOP, out
        delta = seq.text.push(token_id)
        out.reasoning, out.content = delta.reasoning, delta.content
        if delta.stopped:
            return FINISH_STOP, out
        if seq.num_output_tokens >= seq.params.max_tokens or seq.num_tokens >= self.max_model_len:
            return FINISH_LENGTH, out
        return None, out

    def _schedule_decodes(self, batch: Batch, budget: int) -> int:
        for seq in [s for s in self.running if not s.in_prefill]:
            if budget == 0:
                break
            if seq.status != SeqStatus.RUNNING or not self._make_room(seq, batch):
                continue
            self.blocks.append(seq)
            batch.items.append(ScheduledSeq(seq, 1, prefill=False))
            budget -= 1
        return budget

    def _make_room(self, seq: Sequence, batch: Batch) -> bool:
        """Preempt the newest unscheduled sequences until `seq` can grow; False if `seq` itself went."""
        scheduled = {id(i.seq) for i in batch.items}
        while not self.blocks.can_append(seq):
            victims = [s for s in self.running if id(s) not in scheduled]
            victim = victims[-1]
            self._preempt(victim, batch)
            if victim is seq:
                return False
        return True

    def _preempt(self, seq: Sequence, batch: Batch) -> None:
        self.running.remove(seq)
        self.blocks.free(seq)
        seq.num_computed = 0
        seq.status = SeqStatus.WAITING
        self.waiting.appendleft(seq)
        batch.preempted.append(seq)

    def _admit_received(self, batch: Batch, budget: int) -> int:
        """Sequences whose prompt KV arrived: each takes a seat and decodes its first token this
        step (1 token of budget), in arrival order, while their next block fits."""
        while self.received and budget > 0 and len(self.running) < self.config.max_num_seqs:
            seq = self.received[0]
            if not self.blocks.can_append(seq):
                break
            self.received.popleft()
            seq.status = SeqStatus.RUNNING
            self.running.append(seq)
            batch.admitted.append(seq)
            batch.received.append(seq)
            self.blocks.append(seq)
            batch.items.append(ScheduledSeq(seq, 1, prefill=False))
            budget -= 1
        return budget

    def _schedule_running_prefills(self, batch: Batch, budget: int) -> int:
        for seq in self.running:
            if budget == 0:
                break
            if seq.in_prefill:
                n = min(seq.tokens_to_compute, budget)
                batch.items.append(ScheduledSeq.prefill_chunk(seq, n))
                budget -= n
        return budget

    def _admit_waiting(self, batch: Batch, budget: int) -> int:
        """Admit from the head of the queue (FIFO, no overtaking). While others run, 1% of the
        blocks stay free for their decodes, so a new prompt is not admitted only to be preempted."""
        reserve = max(1, self.blocks.num_blocks // 100)
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[0]
            if not self.blocks.can_admit(seq, reserve if self.running else 0):
                break
            self.waiting.popleft()
            cached = self.blocks.admit(seq)
            seq.num_computed, seq.prefill_target = cached, seq.num_tokens
            if seq.num_output_tokens == 0:
                seq.cached_tokens = cached
            seq.status = SeqStatus.RUNNING
            self.running.append(seq)
            batch.admitted.append(seq)
            n = min(seq.tokens_to_compute, budget)
            batch.items.append(ScheduledSeq.prefill_chunk(seq, n, cached))
            budget -= n
        return budget
