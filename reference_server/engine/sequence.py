"""Per-request state the scheduler moves between the waiting and running queues."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING

from phaselens.instrumentation import NULL_REQUEST, RequestObserver
from phaselens.reference_server.engine.detokenizer import TextTracker

if TYPE_CHECKING:  # torch loads with the model runner, not with the request bookkeeping
    import torch


FINISH_TRANSFERRED = "transferred"  # prefill instance: the request goes on at a decode instance
FAULT_ID = -1  # a sampled id that failed (reference_server.engine.sampler): its request fails alone


class SeqStatus(Enum):
    WAITING = 1
    RUNNING = 2
    FINISHED = 3
    TRANSFERRING = 4  # prefill instance: prefill done, its KV held until the decode instance acknowledges it
    STAGED = 5  # decode instance: KV received, waiting for its request (disagg)


GREEDY_BELOW = 1e-5  # as vLLM: a smaller temperature is greedy (logits / it would overflow to NaN)


@dataclass(slots=True, frozen=True)
class SamplingParams:
    """temperature below GREEDY_BELOW (0 included) means greedy; top_k 0 and top_p 1 disable those filters."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    reasoning_tokens: int = 0  # the first N output tokens are reasoning text

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW


@dataclass(slots=True)
class SeqOutput:
    """What one step hands to the response stream of one request (on the loop thread)."""

    content: str = ""
    reasoning: str = ""
    new_tokens: int = 0
    finish_reason: str | None = None
    output_tokens: int = 0  # the request's output tokens so far, this step's included
    reasoning_tokens: int = 0
    cached_tokens: int = 0
    error: str = ""  # why the engine failed this request, when it knows (a KV transfer's failure)


Sink = Callable[[SeqOutput], None]


def _drop(_: SeqOutput) -> None:
    """Default sink: nobody listens."""


@dataclass(slots=True, eq=False)
class Sequence:
    """`token_ids` = prompt + output; the KV of the first `num_computed` tokens is in the cache.

    A sequence is in prefill while `num_computed < prefill_target` (all tokens known when it was
    last admitted: the prompt, or prompt + output after a recompute preemption), then in decode,
    where each step feeds the last sampled token.
    """

    seq_id: int
    token_ids: list[int]
    num_prompt_tokens: int
    params: SamplingParams
    text: TextTracker
    observer: RequestObserver = NULL_REQUEST
    sink: Sink = _drop
    status: SeqStatus = SeqStatus.WAITING
    num_computed: int = 0
    prefill_target: int = 0
    cached_tokens: int = 0
    block_table: list[int] = field(default_factory=list)
    num_hashed_blocks: int = 0
    finish_reason: str | None = None
    generator: torch.Generator | None = None  # when the request carries a seed
    handoff: object | None = None  # prefill instance: a disagg.KvHandoff, where its KV goes after the first token
    received_output: SeqOutput | None = None  # decode instance: the received first token's output, not yet handed out

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def in_prefill(self) -> bool:
        return self.num_computed < self.prefill_target

    @property
    def tokens_to_compute(self) -> int:
        """Tokens whose KV is still missing: the rest of the prefill, or the one fed token of a decode."""
        return self.prefill_target - self.num_computed if self.in_prefill else self.num_tokens - self.num_computed
