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
- first_chunk = first_chunk − first_token: the server's part of delivering the first output, from
                the first token handed to the stream to the first body chunk carrying output handed
                to the server's `send` (a streamed response; 0 without). Exactly
                first_chunk = loop_wait + encode:
                  loop_wait = output_ready − first_token   (the event loop took the output: how
                              late the loop was, plus any token that gave no text yet)
                  encode    = first_chunk − output_ready   (SSE encoding, the framework's work)
                Beside it, write = first_chunk_sent − first_chunk (`send` until it returned): the
                bytes going out, on the residual's side (a full socket buffer is a slow reader).
                The term ends where `send` is called, not where it returns: the client may read
                the bytes before the server's coroutine resumes, and the residual stays ≥ 0.
- So, exactly:  server TTFC = first_chunk − received = server TTFT + first_chunk, and the
                client's residual = client TTFT − server TTFC is network both ways + client only.
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
                in gaps at least twice the median (preemption waits, long prefill steps of others…).
"""

from __future__ import annotations

import bisect
import operator
from dataclasses import dataclass, field
from typing import cast

from phaselens.common.quantile import quantile
from phaselens.instrumentation.hotpath.records import RequestRecord
from phaselens.instrumentation.hotpath.timeline import CHUNK_FIELDS, RequestTimeline

Timeline = RequestRecord | RequestTimeline  # the same stamps, frozen or still being written

STALL_FACTOR = 2


@dataclass(slots=True)
class Phases:
    """Budget terms (ns) and span boundaries of one request; 0 / None where a phase did not happen."""

    received_ts: int
    end_ts: int  # responded; the engine's last stamp when later (it worked on after the client left)
    enqueued_ts: int = 0
    scheduled_ts: int = 0
    prefill_end_ts: int = 0
    first_token_ts: int = 0
    last_token_ts: int = 0
    ingress_ns: int = 0
    queue_ns: int = 0
    prefill_ns: int = 0
    first_token_phase_ns: int = 0
    first_chunk_ts: int = 0  # stamp: the first content chunk handed to `send`
    last_chunk_ts: int = 0
    first_chunk_phase_ns: int = 0
    loop_wait_ns: int = 0
    encode_ns: int = 0
    write_ns: int = 0
    decode_ns: int = 0
    delivery_ns: int = 0
    waits: list[tuple[int, int]] = field(default_factory=list)
    initial_chunks: int = 0  # chunks before the first token
    decode_tokens: int = 0
    decode_steps: int = 0
    itl_ns: list[int] = field(default_factory=list)

    @property
    def ttft_ns(self) -> int:
        return self.first_token_ts - self.received_ts if self.first_token_ts else 0

    @property
    def ttfc_ns(self) -> int:
        """Server time to first chunk: received → the first content chunk handed to the server's `send`."""
        return self.first_chunk_ts - self.received_ts if self.first_chunk_ts else 0

    @property
    def e2e_ns(self) -> int:
        return self.end_ts - self.received_ts


def stall_ns(itl_sorted_ns: list[int]) -> float:
    """Σ (g − p50) over gaps g > STALL_FACTOR·p50 (see module docstring), from the gaps in ascending
    order: the stalls are the sorted tail, = Σ tail − p50·len(tail) (exact: ns ints, p50 a half-int)."""
    if not itl_sorted_ns:
        return 0
    median = quantile(cast("list[float]", itl_sorted_ns), 0.5) or 0.0  # ints are floats here
    stalls = itl_sorted_ns[bisect.bisect_right(itl_sorted_ns, STALL_FACTOR * median) :]
    return sum(stalls) - median * len(stalls)


def overlap_ns(waits: list[tuple[int, int]], start_ns: int, end_ns: int) -> int:
    """Total length of the waits inside [start_ns, end_ns]."""
    return sum(max(0, min(b, end_ns) - max(a, start_ns)) for a, b in waits)


def last_stamp_ns(timeline: Timeline) -> int:
    """The latest stamp a request got: where open phases end when it never responded."""
    stamps = [timeline.received_ts, timeline.enqueued_ts, timeline.first_token_ts, timeline.finished_ts]
    stamps.extend(timeline.waits[-1:])
    stamps.extend(timeline.token_ts[-1:])
    stamps.extend(timeline.chunks[1::CHUNK_FIELDS][-1:])
    return max(stamps)


def closed_waits(timeline: Timeline, end_ns: int) -> list[tuple[int, int]]:
    """Queue waits as (start, end) pairs; a wait never ended ends at `end_ns`."""
    waits = list(timeline.waits)
    if len(waits) % 2:
        waits.append(max(end_ns, waits[-1]))
    return list(zip(waits[0::2], waits[1::2], strict=False))


def compute_phases(timeline: Timeline) -> Phases:
    """Phase boundaries and budget terms; the TTFT identity in the module docstring holds exactly."""
    end_ns = max(timeline.responded_ts, last_stamp_ns(timeline))
    p = Phases(received_ts=timeline.received_ts, end_ts=end_ns, enqueued_ts=timeline.enqueued_ts)
    p.waits = closed_waits(timeline, end_ns)
    if not p.enqueued_ts:
        return p
    p.ingress_ns = p.enqueued_ts - p.received_ts
    ft = p.first_token_ts = timeline.first_token_ts
    horizon = ft or end_ns
    p.queue_ns = overlap_ns(p.waits, p.enqueued_ts, horizon)
    if len(timeline.waits) < 2:
        return p
    p.scheduled_ts = timeline.waits[1]
    chunk_ends = [e for e in timeline.chunks[1::CHUNK_FIELDS] if e <= horizon]
    p.initial_chunks = len(chunk_ends)
    p.prefill_end_ts = max([p.scheduled_ts, *chunk_ends])
    p.prefill_ns = p.prefill_end_ts - p.scheduled_ts - overlap_ns(p.waits, p.scheduled_ts, p.prefill_end_ts)
    if not ft:
        return p
    p.first_token_phase_ns = ft - p.prefill_end_ts - overlap_ns(p.waits, p.prefill_end_ts, ft)
    p.last_token_ts = timeline.token_ts[-1] if timeline.token_ts else ft
    p.decode_ns = p.last_token_ts - ft
    p.delivery_ns = max(0, end_ns - p.last_token_ts)
    p.decode_tokens = sum(timeline.token_n.tolist())  # tolist: one C loop, not an int per iteration step
    p.decode_steps = len(timeline.token_ts)
    stamps = timeline.token_ts.tolist()
    p.itl_ns = list(map(operator.sub, stamps, [ft, *stamps[:-1]]))  # gaps b − a of consecutive stamps
    _first_chunk(p, timeline)
    return p


def _first_chunk(p: Phases, timeline: Timeline) -> None:
    """The first_chunk term and its split (module docstring), when a content chunk was sent."""
    ready, first, sent = timeline.output_ready_ts, timeline.first_chunk_ts, timeline.first_chunk_sent_ts
    if not (p.first_token_ts <= ready <= first <= sent):  # not streamed, or no content at all
        return
    p.first_chunk_ts, p.last_chunk_ts = first, timeline.last_chunk_ts
    p.loop_wait_ns, p.encode_ns, p.write_ns = ready - p.first_token_ts, first - ready, sent - first
    p.first_chunk_phase_ns = first - p.first_token_ts
