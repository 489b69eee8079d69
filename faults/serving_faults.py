"""Fault scenarios of the serving side (faults/serving.py), counted in requests and their server spans:

- span_builder_killed: the span-builder child SIGKILLed `builder_kills` times under closed-loop load.
  Serving must go on (every request answered 200) and every server span must arrive: the serving
  process replays to the replacement what the dead child had not reported exported
  (`records_replayed`). At-least-once: `duplicated` counts requests whose SERVER span was stored
  twice, `duplicated_spans` the extra spans of their trees (engine-step spans, fresh trace ids on a
  replay, are not told apart). recover_s = the longest kill → replacement child alive.
- server_overload: capacity C (requests/s) measured closed-loop at `max_num_seqs` clients, then
  10 × C offered open-loop: excess answered 503 (bounded waiting queue, bounded memory), and
  afterwards a request is as fast as before. recover_s = overload end → a request within 2× the
  pre-overload median latency.
- client_disconnect: streamed requests whose clients leave after the first chunk: KV blocks back to 0
  and each server span marked client_disconnected. recover_s = last client gone → KV blocks at 0.

One server (4 sequences, 16 waiting) serves all three, in this order (the kills last: a replaced
child's restart backoff grows). Outcome columns for these, in requests: sent; acknowledged = answered
200 (disconnect: got a first chunk); stored = with a server root span in ClickHouse; lost =
acknowledged − stored; duplicated = root spans beyond one per request; client_dropped = requests
whose connection failed (no HTTP status).
"""

from __future__ import annotations

import asyncio
import os
import signal
import statistics
import threading
import time
from dataclasses import dataclass

import httpx

from phaselens.faults.collector_faults import Pipeline
from phaselens.faults.outcome import Outcome
from phaselens.faults.params import Params
from phaselens.faults.parts import CollectorProcess, wait_until
from phaselens.faults.serving import ClosedLoop, Reply, ServingRig, complete, leave_after_first_chunk, request
from phaselens.instrumentation import names
from phaselens.instrumentation.pipeline import Counters
from phaselens.storage.clickhouse_url import connect

OVERLOAD_FACTOR = 10
MAX_WAITING = 16
MAX_IN_FLIGHT = 2000  # the open-loop client's own bound


@dataclass(slots=True)
class Served:
    """The collector and server the serving scenarios share (the model loads once)."""

    collector: CollectorProcess
    rig: ServingRig

    @classmethod
    def start(cls, pipeline: Pipeline) -> Served:
        collector = pipeline.collector("serving")
        collector.start_serving()
        try:
            return cls(
                collector,
                ServingRig(collector.grpc_endpoint, "faults-serving", max_num_seqs=4, max_waiting=MAX_WAITING).start(),
            )
        except BaseException:
            collector.stop()
            raise

    def stop(self) -> None:
        self.rig.stop()
        self.collector.stop()


def _roots(pipeline: Pipeline, service: str, trace_ids: list[str]) -> dict[str, tuple[int, str]]:
    """TraceId → (server root spans stored, its client_disconnected attribute)."""
    sql = (
        "SELECT TraceId, count(), any(SpanAttributes[{cd:String}]) FROM {db:Identifier}.otel_traces "
        "WHERE ServiceName = {s:String} AND SpanKind IN ('Server', 'SPAN_KIND_SERVER') "
        "AND TraceId IN {ids:Array(String)} GROUP BY TraceId"
    )
    with connect(pipeline.clickhouse.url) as client:
        rows = client.query(
            sql,
            parameters={"db": pipeline.database, "s": service, "ids": trace_ids, "cd": names.PL_CLIENT_DISCONNECTED},
        ).result_rows
    return {r[0]: (int(r[1]), r[2]) for r in rows}


def _settle(pipeline: Pipeline, service: str, trace_ids: list[str]) -> dict[str, tuple[int, str]]:
    """Root spans of `trace_ids` once all are stored, or their number held still for 1 s (the
    telemetry was flushed: what its child exported is spooled, and in ClickHouse within ~0.2 s).
    Polled every 0.1 s: most runs have them all within a poll or two."""
    found: dict[str, tuple[int, str]] = {}
    still_since = deadline = time.monotonic()
    deadline += 30
    while (now := time.monotonic()) < deadline:
        last, found = len(found), _roots(pipeline, service, trace_ids)
        if len(found) == len(trace_ids):
            break
        if len(found) != last:
            still_since = now
        elif now - still_since >= 1.0:
            break
        time.sleep(0.1)
    return found


def _outcome(
    name: str, pipeline: Pipeline, rig: ServingRig, before: Counters, replies: list[Reply], recover_s, **detail
) -> Outcome:
    """`before`: the telemetry's counters when the scenario began (the server is shared)."""
    rig.telemetry.flush(15)
    after = rig.telemetry.stats()
    ok = [r.trace_id for r in replies if r.status == 200]
    roots = _settle(pipeline, rig.service, [r.trace_id for r in replies])
    stored = {t for t in ok if t in roots}
    errors = [r.error for r in replies if r.status == 0]
    detail.update(
        unit="requests",
        statuses=_statuses(replies),
        transport_errors={e: errors.count(e) for e in sorted(set(errors))},
        telemetry_spans_dropped=after.spans_dropped - before.spans_dropped,
        child_restarts=after.child_restarts - before.child_restarts,
    )
    return Outcome(
        name,
        len(replies),
        len(ok),
        len(stored),
        len(ok) - len(stored),
        sum(n - 1 for n, _ in roots.values()),
        sum(r.status == 0 for r in replies),
        None if recover_s is None else round(recover_s, 2),
        detail,
    )


def _statuses(replies: list[Reply]) -> dict[str, int]:
    out: dict[str, int] = {}
    for reply in replies:
        out[str(reply.status)] = out.get(str(reply.status), 0) + 1
    return out


def _span_copies(pipeline: Pipeline, service: str, trace_ids: list[str]) -> tuple[int, int]:
    """(span rows, rows beyond the first copy) in the traces of `trace_ids`. A replayed request's
    SERVER span repeats its id, its other spans get fresh ids: a trace with its SERVER span n times
    holds n copies of its tree, rows − rows/n of them extra."""
    sql = (
        "SELECT sum(rows), sum(if(roots > 1, rows - intDiv(rows, roots), 0)) FROM ("
        "SELECT count() AS rows, countIf(SpanKind IN ('Server', 'SPAN_KIND_SERVER')) AS roots "
        "FROM {db:Identifier}.otel_traces WHERE ServiceName = {s:String} AND TraceId IN {ids:Array(String)} "
        "GROUP BY TraceId)"
    )
    with connect(pipeline.clickhouse.url) as client:
        rows, extra = client.query(
            sql, parameters={"db": pipeline.database, "s": service, "ids": trace_ids}
        ).result_rows[0]
    return int(rows), int(extra)


def span_builder_killed(pipeline: Pipeline, served: Served, params: Params) -> Outcome:
    rig, before = served.rig, served.rig.telemetry.stats()
    load = ClosedLoop(rig.url).start()
    recover: list[float | None] = []
    try:
        time.sleep(params.warm_s)
        for _ in range(params.builder_kills):
            old = rig.telemetry.span_builder_pid
            if old is None:  # the last kill's replacement never came (its recovery is None): none to kill
                break
            os.kill(old, signal.SIGKILL)
            recover.append(wait_until(lambda old=old: rig.telemetry.span_builder_pid not in (None, old), 60))
        time.sleep(params.after_s)
    finally:
        replies = load.stop()
    outcome = _outcome(
        "span_builder_killed",
        pipeline,
        rig,
        before,
        replies,
        None if None in recover else max(r for r in recover if r is not None),
        kills=params.builder_kills,
    )
    rows, extra = _span_copies(pipeline, rig.service, [r.trace_id for r in replies])
    replayed = rig.telemetry.stats().records_replayed - before.records_replayed
    outcome.detail.update(request_spans_stored=rows, duplicated_spans=extra, records_replayed=replayed)
    return outcome


def _open_loop(url: str, rate_per_s: float, duration_s: float) -> list[Reply]:
    """Requests started at `rate_per_s` whatever the answers (at most MAX_IN_FLIGHT at once)."""

    async def run() -> list[Reply]:
        limits = httpx.Limits(max_connections=MAX_IN_FLIGHT, max_keepalive_connections=64)
        async with httpx.AsyncClient(timeout=60, limits=limits) as client:
            # a running count, not a scan of every task per start: the client shares the server's CPUs
            tasks: list[asyncio.Future[Reply]] = []
            in_flight, started = 0, time.monotonic()

            def finished(_task) -> None:
                nonlocal in_flight
                in_flight -= 1

            while (elapsed := time.monotonic() - started) < duration_s:
                if len(tasks) < (elapsed * rate_per_s) and in_flight < MAX_IN_FLIGHT:
                    tasks.append(asyncio.ensure_future(_complete_async(client, url)))
                    tasks[-1].add_done_callback(finished)
                    in_flight += 1
                else:
                    await asyncio.sleep(0.002)
            return list(await asyncio.gather(*tasks))

    return asyncio.run(run())


async def _complete_async(client: httpx.AsyncClient, url: str) -> Reply:
    trace_id, headers, body = request(8)
    started = time.monotonic()
    try:
        async with client.stream("POST", f"{url}/v1/completions", json=body, headers=headers) as r:
            async for _ in r.aiter_bytes():
                pass
            status = r.status_code
    except httpx.HTTPError as e:
        return Reply(trace_id, 0, time.monotonic() - started, type(e).__name__)
    return Reply(trace_id, status, time.monotonic() - started)


def _recovery(url: str, good_s: float, timeout_s: float = 30.0) -> tuple[float | None, list[Reply]]:
    """Probes one request after another until one is answered 200 within `good_s`: (seconds, probes)."""
    started, probes = time.monotonic(), []
    with httpx.Client(timeout=30) as client:
        while time.monotonic() - started < timeout_s:
            probes.append(complete(client, url))
            if probes[-1].status == 200 and probes[-1].latency_s <= good_s:
                return time.monotonic() - started, probes
    return None, probes


def _peak_rss_mb() -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmHWM")) / 1024


def _watch_waiting(rig: ServingRig, stop: threading.Event, seen: list[int]) -> threading.Thread:
    def watch() -> None:
        while not stop.wait(0.01):
            seen.append(rig.engine.num_waiting)

    thread = threading.Thread(target=watch, name="fault-waiting", daemon=True)
    thread.start()
    return thread


def server_overload(pipeline: Pipeline, served: Served, params: Params) -> Outcome:
    rig, before = served.rig, served.rig.telemetry.stats()
    closed_loop = ClosedLoop(rig.url, clients=4).start()
    time.sleep(params.capacity_s)
    baseline = closed_loop.stop()
    capacity = len(baseline) / params.capacity_s
    median_s = statistics.median(r.latency_s for r in baseline)
    rss_before, waiting, stop = _peak_rss_mb(), [0], threading.Event()
    watcher = _watch_waiting(rig, stop, waiting)
    burst = _open_loop(rig.url, OVERLOAD_FACTOR * capacity, params.overload_s)
    stop.set()
    watcher.join()
    recover_s, probes = _recovery(rig.url, 2 * median_s)
    return _outcome(
        "server_overload",
        pipeline,
        rig,
        before,
        [*baseline, *burst, *probes],
        recover_s,
        capacity_req_s=round(capacity, 1),
        offered_req_s=round(OVERLOAD_FACTOR * capacity, 1),
        sent_req_s=round(len(burst) / params.overload_s, 1),  # the client's own limit may be lower
        overload_statuses=_statuses(burst),
        max_waiting_seen=max(waiting),
        max_waiting=MAX_WAITING,
        peak_rss_growth_mb=round(_peak_rss_mb() - rss_before, 1),
        median_latency_ms_before=round(median_s * 1000, 1),
        median_latency_ms_after=round(probes[-1].latency_s * 1000, 1),
    )


def client_disconnect(pipeline: Pipeline, served: Served, params: Params) -> Outcome:
    rig, before = served.rig, served.rig.telemetry.stats()
    trace_ids = [leave_after_first_chunk(rig.url, max_tokens=2000) for _ in range(params.disconnects)]
    gone = time.monotonic()
    freed = wait_until(lambda: rig.kv_blocks_used() == 0 and rig.engine.num_running == 0, 30)
    recover_s = None if freed is None else time.monotonic() - gone
    replies = [Reply(t, 200, 0.0) for t in trace_ids]  # each got its first chunk
    outcome = _outcome(
        "client_disconnect", pipeline, rig, before, replies, recover_s, kv_blocks_used_after=rig.kv_blocks_used()
    )
    roots = _roots(pipeline, rig.service, trace_ids)
    outcome.detail["spans_marked_disconnected"] = sum(v == "true" for _, v in roots.values())
    return outcome
