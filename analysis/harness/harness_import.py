"""Another harness's per-request records → CLIENT spans in the traces of the server requests they made.

The join is the request id the harness sent as X-Request-ID: the per-request view's `x_request_id`
(`analysis/schema/schema.py`). For each record whose id names exactly one server request, one CLIENT span
is built with the OpenTelemetry SDK (a `ReadableSpan`), encoded as OTLP (the exporter's own
encoder), rendered into `otel_traces` rows by the collector's renderer and inserted as the collector
inserts (`collectors/clickhouse_sink.py`). So the imported view is a client span like
`phaselens bench`'s, and the budget, report, diagnosis and dashboards read it unchanged.

- Only durations: the span carries the harness's figures (TTFT, TTFO, TPOT, e2e, ITL, tokens) as it
  computed them; its start is the harness's wall clock (a timeline position, never subtracted from
  a server stamp). residual = client TTFT − server TTFC, both durations.
- Nothing twice: a span's id is a hash of (harness, request id, trace id), spans already stored are
  skipped, and the insert's deduplication token is a hash of its rows, so a re-import adds no row
  even after a crash mid-way.
- Nothing silently: a record whose id reached no server request (`unmatched`), or several
  (`ambiguous`), is counted and listed; bad lines of the export are reported by the parser.
- The default budget sees them: the sealed rollup minutes of the joined requests are recomputed
  (`rollup_backfill`; a request not sealed yet is sealed later with its view).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from clickhouse_connect.driver.exceptions import ClickHouseError
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import Event, ReadableSpan
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.trace import SpanContext, SpanKind, Status, StatusCode, TraceFlags

from phaselens.analysis.harness.harness_records import ClientRecord, HarnessRun
from phaselens.analysis.queries.id_batches import slices
from phaselens.analysis.rollup.rollup_backfill import Backfilled, BackfillError, backfill_requests
from phaselens.analysis.rollup.rollup_copies import cluster_of
from phaselens.analysis.schema.schema import FACTS_VIEW, SPANS_VIEW
from phaselens.collectors.clickhouse_sink import ClickHouseSink
from phaselens.collectors.schema import DISTRIBUTED_TABLE, ident
from phaselens.common.quantile import quantile
from phaselens.instrumentation import names as n

IMPORT_SCOPE = "phaselens.harness_import"  # ScopeName of an imported client span
INSERT_BATCH = 5_000  # spans per insert (one deduplication token each)


@dataclass(slots=True)
class ImportReport:
    """What an import did: `imported` new client spans, `already` stored by an earlier import,
    `unmatched` / `ambiguous` request ids (no server request, or several), and the parser's counts."""

    harness: str
    version: str | None
    records: int
    imported: int
    already: int
    unmatched: list[str]
    ambiguous: list[str]
    bad_lines: int
    without_id: int
    repeated_ids: int  # records whose request id an earlier record of the export had (the last one is kept)
    rollups: list[Backfilled]  # per node: the sealed minutes recomputed with the imported views
    rollup_error: str | None = None  # why they were not: the spans are stored, the exact path reads them


@dataclass(frozen=True, slots=True)
class ServerMatch:
    """The server request a record joins: its trace, and its model (names the span when the
    export does not)."""

    trace_id: str
    model: str | None


def lookup(client: Any, database: str, request_ids: Sequence[str]) -> dict[str, list[ServerMatch]]:
    """request id → the server requests whose `x_request_id` it is (bound parameters, batched)."""
    sql = (
        f"SELECT x_request_id, trace_id, model FROM {ident(database)}.{ident(FACTS_VIEW)} "
        "WHERE has_server AND x_request_id IN {ids:Array(String)}"
    )
    found: dict[str, list[ServerMatch]] = {}
    for part in slices(request_ids):
        rows = client.query(sql, parameters={"ids": list(request_ids[part])}).result_rows
        for request_id, trace_id, model in rows:
            found.setdefault(request_id, []).append(ServerMatch(trace_id, model))
    return found


def stored_span_ids(client: Any, database: str, trace_ids: Sequence[str], span_ids: Sequence[str]) -> set[str]:
    """Which of these client spans are stored already (an earlier import)."""
    sql = (
        f"SELECT DISTINCT SpanId FROM {ident(database)}.{ident(SPANS_VIEW)} "
        "WHERE TraceId IN {t:Array(String)} AND SpanId IN {s:Array(String)} AND ScopeName = {scope:String}"
    )
    out: set[str] = set()
    for part in slices(trace_ids):  # a span id is shorter than its trace id
        params = {"t": list(trace_ids[part]), "s": list(span_ids[part])}
        out |= {row[0] for row in client.query(sql, parameters={**params, "scope": IMPORT_SCOPE}).result_rows}
    return out


def distributed_cluster(client: Any, database: str) -> str | None:
    """The cluster of `database`'s `otel_traces_distributed` table, None on one node. On a cluster the
    spans go through it (a foreground Distributed insert, sharded by cityHash64(TraceId), as the
    collector's `--cluster-insert distributed`), so a client span lands on its server request's shard:
    the per-request parts are shard-local."""
    return cluster_of(client, database, DISTRIBUTED_TABLE)


def span_id_for(harness: str, request_id: str, trace_id: str) -> int:
    """Deterministic, non-zero 64-bit span id: the same record always makes the same span."""
    digest = hashlib.sha256(f"{harness}\0{request_id}\0{trace_id}".encode()).digest()
    return int.from_bytes(digest[:8], "big") or 1


def _ms_to_ns(ms: float) -> int:
    return round(ms * 1e6)


def client_attributes(run: HarnessRun, record: ClientRecord, model: str | None) -> dict[str, Any]:
    """The CLIENT span's attributes: the harness's figures under the keys of phaselens's own client
    span (docs/span-model.md#client-span), who measured them, the request id it sent, and the server
    it called.
        ITL p50/p99/max over the harness's inter-chunk gaps (common/quantile.py)."""
    gaps = sorted(record.itl_ms)
    attributes: dict[str, Any] = {
        n.GEN_AI_OPERATION_NAME: run.operation or n.OP_CHAT,
        n.GEN_AI_REQUEST_MODEL: run.model or model,
        n.PL_CLIENT_HARNESS: run.harness,
        n.PL_CLIENT_HARNESS_VERSION: run.version,
        n.HTTP_REQUEST_HEADER_X_REQUEST_ID: [record.request_id],
        n.PL_CLIENT_TTFT_MS: record.ttft_ms,
        n.PL_CLIENT_TTFO_MS: record.ttfo_ms,
        n.PL_CLIENT_TPOT_MS: record.tpot_ms,
        n.PL_CLIENT_E2E_MS: record.e2e_ms,
        n.PL_CLIENT_ITL_P50_MS: quantile(gaps, 0.5),
        n.PL_CLIENT_ITL_P99_MS: quantile(gaps, 0.99),
        n.PL_CLIENT_ITL_MAX_MS: gaps[-1] if gaps else None,
        n.PL_CLIENT_CHUNKS: len(gaps) + 1 if gaps else None,
        n.PL_CLIENT_INPUT_TOKENS: record.input_tokens,
        n.PL_CLIENT_OUTPUT_TOKENS: record.output_tokens,
        n.ERROR_TYPE: record.error_type,
        n.PL_CLIENT_SENT_WALL_NS: record.start_wall_ts,
    }
    if record.e2e_ms is not None:
        attributes[n.PL_CLIENT_DONE_WALL_NS] = record.start_wall_ts + _ms_to_ns(record.e2e_ms)
    attributes.update(_server_address(run.server_url))
    return {k: v for k, v in attributes.items() if v is not None}


def _server_address(url: str | None) -> dict[str, Any]:
    """server.address / server.port of the URL the harness called (what `diagnose` suggests a second
    run against); nothing for a URL it cannot read."""
    if not url:
        return {}
    try:
        parts = urlsplit(url if "://" in url else f"http://{url}")
        port = parts.port or (443 if parts.scheme == "https" else 80)
    except ValueError:  # a port out of range
        return {}
    return {n.SERVER_ADDRESS: parts.hostname, n.SERVER_PORT: port} if parts.hostname else {}


def client_span(run: HarnessRun, record: ClientRecord, match: ServerMatch, resource: Resource) -> ReadableSpan:
    """One CLIENT span in the server request's trace, from the harness's send to its last chunk:
    start = the harness's wall clock at send, end = start + e2e; events at start + TTFT / TTFO / e2e."""
    trace_id = int(match.trace_id, 16)
    context = SpanContext(trace_id, span_id_for(run.harness, record.request_id, match.trace_id), False, TraceFlags(1))
    start = record.start_wall_ts
    offsets = ((n.EVENT_FIRST_CHUNK, record.ttft_ms), (n.EVENT_FIRST_OUTPUT, record.ttfo_ms))
    events = [Event(name, {}, start + _ms_to_ns(ms)) for name, ms in offsets if ms is not None]
    end = start + _ms_to_ns(record.e2e_ms) if record.e2e_ms is not None else start
    if record.e2e_ms is not None and record.error_type is None:
        events.append(Event(n.EVENT_LAST_CHUNK, {}, end))
    attributes = client_attributes(run, record, match.model)
    failed = record.error_type is not None
    return ReadableSpan(
        name=n.root_span_name(attributes[n.GEN_AI_OPERATION_NAME], attributes.get(n.GEN_AI_REQUEST_MODEL) or ""),
        context=context,
        parent=None,
        resource=resource,
        attributes=attributes,
        events=events,
        kind=SpanKind.CLIENT,
        status=Status(StatusCode.ERROR, record.error_type) if failed else Status(StatusCode.UNSET),
        start_time=start,
        end_time=end,
        instrumentation_scope=InstrumentationScope(IMPORT_SCOPE, run.version),
    )


def _insert(sink: ClickHouseSink, spans: Sequence[ReadableSpan]) -> None:
    """Rows rendered by the collector's renderer, one insert per batch, its token a hash of the rows:
    the same spans inserted again are dropped by ClickHouse."""
    for i in range(0, len(spans), INSERT_BATCH):
        rows = sink.render(encode_spans(spans[i : i + INSERT_BATCH]).SerializeToString())
        sink.insert([rows], "phaselens-import:" + hashlib.sha256(rows).hexdigest())


def import_run(client: Any, url: str, run: HarnessRun, database: str = "otel") -> ImportReport:
    """Join `run`'s records to the server requests stored in `database` and insert their client spans."""
    records = list({r.request_id: r for r in run.records}.values())  # a harness's retry of an id: the last
    matches = lookup(client, database, [r.request_id for r in records])
    joined: list[tuple[ClientRecord, ServerMatch]] = []
    unmatched: list[str] = []
    ambiguous: list[str] = []
    for record in records:
        found = matches.get(record.request_id, [])
        if len(found) == 1:
            joined.append((record, found[0]))
        else:
            (ambiguous if found else unmatched).append(record.request_id)
    resource = Resource.create({"service.name": run.harness})
    spans = [client_span(run, record, match, resource) for record, match in joined]
    stored = stored_span_ids(
        client, database, [m.trace_id for _, m in joined], [f"{s.context.span_id:016x}" for s in spans]
    )
    new = [s for s in spans if f"{s.context.span_id:016x}" not in stored]
    cluster = distributed_cluster(client, database)
    sink = ClickHouseSink(url, database, cluster=cluster)
    try:
        _insert(sink, new)
    finally:
        sink.close()
    # every joined request, stored before or not: an import run again also repairs the rollups
    rollups: list[Backfilled] = []
    rollup_error = None
    try:
        rollups = backfill_requests(client, url, database, cluster, [m.trace_id for _, m in joined]) if joined else []
    except (BackfillError, ClickHouseError, OSError) as e:
        rollup_error = str(e).strip().splitlines()[0]
    return ImportReport(
        run.harness,
        run.version,
        len(run.records),
        len(new),
        len(spans) - len(new),
        unmatched,
        ambiguous,
        len(run.bad_lines),
        run.without_id,
        len(run.records) - len(records),
        rollups,
        rollup_error,
    )


def summary_lines(report: ImportReport, run: HarnessRun, list_ids: int = 10) -> tuple[list[str], list[str]]:
    """(what to print, warnings and errors for stderr): every record is accounted for:
    records = imported + already + unmatched + ambiguous + repeated ids; bad lines and records
    without an id are on top (they never became records)."""
    who = f"{report.harness} {report.version or '(version unknown)'}"
    out = [
        f"{who}: {report.records} records",
        f"  imported {report.imported} client spans, {report.already} already stored",
    ]
    if report.rollups:
        minutes = max(b.minutes for b in report.rollups)
        sealed = sum(b.requests for b in report.rollups)
        out.append(
            f"  rollups: {minutes} minute{'s' if minutes != 1 else ''} recomputed "
            f"({sealed} requests sealed already; the rest seal with their view)"
        )
    warnings = []
    if report.rollup_error:
        warnings.append(
            f"error: the rollups were not recomputed ({report.rollup_error}): `phaselens budget --exact` reads the "
            "imported views; `phaselens rollup backfill --since …` puts them in the rollups"
        )
    for label, ids in (("no server request", report.unmatched), ("several server requests", report.ambiguous)):
        if ids:
            shown = ", ".join(ids[:list_ids]) + (" …" if len(ids) > list_ids else "")
            warnings.append(f"warning: {len(ids)} records with {label} for their X-Request-ID: {shown}")
    if report.repeated_ids:
        warnings.append(f"warning: {report.repeated_ids} records repeat an earlier record's id (the last is kept)")
    if report.without_id:
        warnings.append(f"warning: {report.without_id} records carry no request id")
    warnings += [f"error: {bad}" for bad in run.bad_lines]
    return out, warnings
