"""Phase boundaries and budget terms of one request, from its timeline (pure integer math, ns).

Boundaries (monotonic ns of one process):
    received ─ingress─ enqueued ─queue─ scheduled₀ ─prefill─ prefill_end ─first_token─ first_token
             ─decode─ last_token ─delivery─ responded

- ingress     = enqueued − received (parse, validate, tokenize).
- queue       = Σ queue waits that lie before the first token (the first wait, plus any wait after a
                preemption that happened before the first token).
- prefill     = (prefill_end − scheduled₀) − queue waits inside that interval, where scheduled₀ ends
                the first wait and prefill_end is the end of the last prefill chunk before the first
                token (= scheduled₀ when the loop reported no chunk). The time between being scheduled
                and a chunk's own start, and between chunks, belongs to prefill unless it is a queue wait.
- first_token = (first_token − prefill_end) − queue waits inside that interval.
- So, exactly:  server TTFT = first_token − received = ingress + queue + prefill + first_token.
- held_back   = visible − first_token: the decode steps until the first token that rendered text
                (a byte-level token of an incomplete UTF-8 character renders none; visible = the
                stamp of the step that gave the `visible_tokens`-th token, as the API layer told
                `output_ready`; = first_token, held_back 0, when the first token rendered text or
                the count is not known); `held_back_tokens` = visible_tokens − 1.
- first_chunk = first_chunk − visible: the server's part of delivering the first output, from
                the token that made it visible handed to the stream to the first body chunk carrying
                output handed to the server's `send` (a streamed response; 0 without). Exactly
                first_chunk = loop_wait + encode:
                  loop_wait = output_ready − visible   (the event loop took the output: how
                              late the loop was)
                  encode    = first_chunk − output_ready   (SSE encoding, the framework's work)
                Beside it, write = first_chunk_sent − first_chunk (`send` until it returned): the
                bytes going out, on the residual's side (a full socket buffer is a slow reader).
                The term ends where `send` is called, not where it returns: the client may read
                the bytes before the server's coroutine resumes, and the residual stays ≥ 0.
- So, exactly:  server TTFC = first_chunk − received = server TTFT + held_back + first_chunk, and the
                client's residual = client TTFT − server TTFC is network both ways + client only.
- inbound     = received − arrived = kernel_wait + dispatch, before ingress (`inbound`; 0 and
                `arrived_ts` 0 when not observed): kernel_wait = read − arrived (the request's
                first bytes in the server's kernel until the event loop read them), dispatch =
                received − read (HTTP parsing, the server's task start). So the server's part of
                the client's TTFT is inbound + server TTFC.
- server last chunk = last_chunk − received (the last content chunk handed to `send`: the stream's
                end as the client's e2e sees it).
- decode      = last_token − first_token (waits after a preemption in decode are inside it and show
                as ITL stalls; they are also exported as their own llm.queue spans).
- delivery    = end − last_token, end = responded (or the engine's last stamp when that is later).  e2e = responded − received = TTFT + decode + delivery.
- server TPOT = (last_token − first_token) / (output_tokens − 1), for output_tokens > 1.
- ITL         = gaps between consecutive token stamps, starting at the first token (one per decode
                step that gave the request tokens); p50/p99 by `phaselens.common.quantile` (linear
                interpolation between closest ranks, as the client and ClickHouse compute them).
- stall       = Σ over ITL gaps g with g > 2·p50 of (g − p50): the time lost against a typical step
                in gaps at least twice the median (preemption waits, long prefill steps of others…);
                with p50, p99 and max computed from the sorted gaps by `_token_gaps.itl_ms`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from phaselens.common.clocks import NOT_STAMPED, MonoTs
from phaselens.instrumentation.hotpath.records import Int64s, RequestRecord, int64s
from phaselens.instrumentation.hotpath.timeline import RequestTimeline
from phaselens.instrumentation.pipeline._token_gaps import phase_terms

Timeline = RequestRecord | RequestTimeline  # the same stamps, frozen or still being written

NO_GAPS = int64s(b"")


@dataclass(slots=True)
class Phases:
    """Budget terms (ns) and span boundaries of one request; 0 / None where a phase did not happen."""

    received_ts: MonoTs
    end_ts: MonoTs  # responded; the engine's last stamp when later (it worked on after the client left)
    arrived_ts: MonoTs = NOT_STAMPED  # the request's bytes reached the kernel (0: not observed)
    read_ts: MonoTs = NOT_STAMPED  # the event loop handed them to the HTTP protocol (0: not observed)
    kernel_wait_ns: int = 0
    dispatch_ns: int = 0
    enqueued_ts: MonoTs = NOT_STAMPED
    scheduled_ts: MonoTs = NOT_STAMPED
    prefill_end_ts: MonoTs = NOT_STAMPED
    first_token_ts: MonoTs = NOT_STAMPED
    last_token_ts: MonoTs = NOT_STAMPED
    ingress_ns: int = 0
    queue_ns: int = 0
    prefill_ns: int = 0
    first_token_phase_ns: int = 0
    first_chunk_ts: MonoTs = NOT_STAMPED  # stamp: the first content chunk handed to `send`
    last_chunk_ts: MonoTs = NOT_STAMPED
    first_chunk_phase_ns: int = 0
    visible_ts: MonoTs = NOT_STAMPED  # the token stamp that made the first content (first_token when it did)
    held_back_ns: int = 0
    held_back_tokens: int = 0
    held_back_known: bool = False  # the API layer told which token made the first content
    loop_wait_ns: int = 0
    encode_ns: int = 0
    write_ns: int = 0
    decode_ns: int = 0
    delivery_ns: int = 0
    waits: list[tuple[int, int]] = field(default_factory=list)
    initial_chunks: int = 0  # chunks before the first token
    decode_tokens: int = 0
    decode_steps: int = 0
    itl_sorted_ns: Int64s = NO_GAPS  # ITL gaps, ascending (packed int64s: read for a few quantiles, `itl_ms`)

    @property
    def ttft_ns(self) -> int:
        return self.first_token_ts - self.received_ts if self.first_token_ts else 0

    @property
    def ttfc_ns(self) -> int:
        """Server time to first chunk: received → the first content chunk handed to the server's `send`."""
        return self.first_chunk_ts - self.received_ts if self.first_chunk_ts else 0

    @property
    def inbound_ns(self) -> int:
        """arrived → received (0 when not observed: then `arrived_ts` is 0 too)."""
        return self.received_ts - self.arrived_ts if self.arrived_ts else 0

    @property
    def e2e_ns(self) -> int:
        return self.end_ts - self.received_ts


def compute_phases(timeline: Timeline) -> Phases:
    """Phase boundaries and budget terms; the TTFT identity in the module docstring holds exactly.
    In C (`_token_gaps.phase_terms`, every field from the timeline's stamps in one call, set at the
    Phases' slots): the same steps in Python were ~54k instructions a request at vLLM's shape, most
    of them the interpreter's."""
    return phase_terms(timeline, Phases)
