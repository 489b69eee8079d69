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
from phaselens.instrumentation.hotpath.timeline import CHUNK_FIELDS, RequestTimeline
from phaselens.instrumentation.pipeline._token_gaps import token_gaps

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


def overlap_ns(waits: list[tuple[int, int]], start_ts: MonoTs, end_ts: MonoTs) -> int:
    """Total length (ns) of the waits inside [start_ts, end_ts] (a loop, not sum over a generator:
    three calls a request, usually over one wait)."""
    total = 0
    for a, b in waits:
        inside = (b if b < end_ts else end_ts) - (a if a > start_ts else start_ts)  # noqa: FURB136 — no min/max call: ~4k instructions a request less
        if inside > 0:
            total += inside
    return total


def last_stamp_ts(timeline: Timeline) -> MonoTs:
    """The latest stamp a request got: where open phases end when it never responded."""
    waits, token_ts, chunks = timeline.waits, timeline.token_ts, timeline.chunks
    return MonoTs(
        max(
            timeline.received_ts,
            timeline.enqueued_ts,
            timeline.first_token_ts,
            timeline.finished_ts,
            waits[-1] if waits else 0,
            token_ts[-1] if token_ts else 0,
            chunks[len(chunks) - CHUNK_FIELDS + 1] if chunks else 0,  # the last chunk's end
        )
    )


def closed_waits(timeline: Timeline, end_ts: MonoTs) -> list[tuple[int, int]]:
    """Queue waits as (start, end) pairs; a wait never ended ends at `end_ts`."""
    waits = timeline.waits.tolist()
    if len(waits) % 2:
        waits.append(max(end_ts, waits[-1]))
    pairs = iter(waits)
    return list(zip(pairs, pairs, strict=True))


def compute_phases(timeline: Timeline) -> Phases:
    """Phase boundaries and budget terms; the TTFT identity in the module docstring holds exactly."""
    end_ts = max(timeline.responded_ts, last_stamp_ts(timeline))
    p = Phases(received_ts=timeline.received_ts, end_ts=end_ts, enqueued_ts=timeline.enqueued_ts)
    p.waits = closed_waits(timeline, end_ts)
    _inbound(p, timeline)
    if not p.enqueued_ts:
        return p
    p.ingress_ns = p.enqueued_ts - p.received_ts
    ft = p.first_token_ts = timeline.first_token_ts
    horizon = ft or end_ts
    p.queue_ns = overlap_ns(p.waits, p.enqueued_ts, horizon)
    if len(timeline.waits) < 2:
        return p
    p.scheduled_ts = MonoTs(timeline.waits[1])  # stamps read from int64 views get their type here
    chunk_ends = [e for e in timeline.chunks[1::CHUNK_FIELDS] if e <= horizon]
    p.initial_chunks = len(chunk_ends)
    p.prefill_end_ts = MonoTs(max([p.scheduled_ts, *chunk_ends]))
    p.prefill_ns = p.prefill_end_ts - p.scheduled_ts - overlap_ns(p.waits, p.scheduled_ts, p.prefill_end_ts)
    if not ft:
        return p
    p.first_token_phase_ns = ft - p.prefill_end_ts - overlap_ns(p.waits, p.prefill_end_ts, ft)
    p.last_token_ts = MonoTs(timeline.token_ts[-1]) if timeline.token_ts else ft
    p.decode_ns = p.last_token_ts - ft
    p.delivery_ns = max(0, end_ts - p.last_token_ts)
    p.decode_tokens, gaps = token_gaps(ft, timeline.token_ts, timeline.token_n)
    p.itl_sorted_ns = int64s(gaps)
    p.decode_steps = len(timeline.token_ts)
    _first_chunk(p, timeline)
    return p


def _inbound(p: Phases, timeline: Timeline) -> None:
    """The inbound edge (module docstring), when its stamps are in order."""
    arrived, read = timeline.arrived_ts, timeline.read_ts
    if not 0 < read <= p.received_ts:
        return
    p.read_ts, p.dispatch_ns = read, p.received_ts - read
    if 0 < arrived <= read:
        p.arrived_ts, p.kernel_wait_ns = arrived, read - arrived


def _first_chunk(p: Phases, timeline: Timeline) -> None:
    """The first_chunk term and its split (module docstring), when a content chunk was sent."""
    ready, first, sent = timeline.output_ready_ts, timeline.first_chunk_ts, timeline.first_chunk_sent_ts
    if not (p.first_token_ts <= ready <= first <= sent):  # not streamed, or no content at all
        return
    p.first_chunk_ts, p.last_chunk_ts = first, timeline.last_chunk_ts
    visible, p.held_back_tokens = _visible(p.first_token_ts, timeline)
    p.held_back_known = timeline.visible_tokens > 0
    p.visible_ts, p.held_back_ns = visible, visible - p.first_token_ts
    p.loop_wait_ns, p.encode_ns, p.write_ns = ready - visible, first - ready, sent - first
    p.first_chunk_phase_ns = first - visible


def _visible(first_token_ts: MonoTs, timeline: Timeline) -> tuple[MonoTs, int]:
    """(stamp, tokens held back): the decode step whose token made the first content visible, the
    tokens before it; (first_token, 0) when that was the first token or the count is not known."""
    wanted, count = timeline.visible_tokens, 1
    if wanted <= 1:
        return first_token_ts, 0
    for stamp, n in zip(timeline.token_ts, timeline.token_n, strict=False):
        count += n
        if count >= wanted and stamp <= timeline.output_ready_ts:
            return MonoTs(stamp), wanted - 1
    return first_token_ts, 0
