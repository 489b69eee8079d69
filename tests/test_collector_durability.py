"""No acknowledged span is lost or duplicated: ClickHouse down mid-stream, collector SIGKILLed,
and a replay of an already inserted batch (the deduplication token)."""

from __future__ import annotations

import time

import grpc
import pytest

from phaselens.collectors import render, schema
from phaselens.collectors.metrics import CollectorMetrics
from phaselens.collectors.service import Collector
from phaselens.collectors.spool import Spool, SpoolLocked
from phaselens.collectors.writer import ClickHouseSink, SpoolWriter
from phaselens.common.process import restartable_port
from phaselens.faults.parts import wait_until
from phaselens.storage.clickhouse_url import connect
from phaselens.storage.embedded import EmbeddedClickHouse
from tests.collector_fixtures import killed_and_restarted, traces_db, wait_rows
from tests.collector_payloads import export_request

EXPORT = "/opentelemetry.proto.collector.trace.v1.TraceService/Export"


def _payloads(requests: int, spans: int) -> list[bytes]:
    return [export_request(spans, time.time_ns()).SerializeToString() for _ in range(requests)]


def _export_all(endpoint: str, bodies: list[bytes]) -> None:
    with grpc.insecure_channel(endpoint) as channel:
        export = channel.unary_unary(EXPORT)
        for body in bodies:
            export(body, timeout=10)


def _counts(client, database: str) -> tuple[int, int]:
    count, unique = client.query(f"SELECT count(), uniqExact(SpanId) FROM {database}.otel_traces").result_rows[0]
    return int(count), int(unique)


def test_clickhouse_down_mid_stream_loses_and_duplicates_nothing(tmp_path):
    data = str(tmp_path / "ch")
    http_port, tcp_port = restartable_port(), restartable_port()  # kept for its restart
    server = EmbeddedClickHouse(data, http_port=http_port, tcp_port=tcp_port).start()
    client = connect(server.url)
    schema.apply(client, schema.statements("durable"))
    bodies = _payloads(12, 50)
    with Collector(
        server.url, database="durable", spool_dir=str(tmp_path / "spool"), flush_interval_s=0.05
    ) as collector:
        _export_all(collector.grpc_endpoint, bodies[:6])
        assert wait_rows(client, "durable", 300) == 300
        server.stop()
        _export_all(collector.grpc_endpoint, bodies[6:])  # acknowledged from the spool
        assert wait_until(lambda: collector.metrics.snapshot()["insert_retries"] >= 1, 30) is not None
        server = EmbeddedClickHouse(data, http_port=http_port, tcp_port=tcp_port).start()
        client = connect(server.url)
        assert wait_rows(client, "durable", 600, timeout_s=30) == 600
    assert collector.metrics.snapshot()["spans_written"] == 600
    assert _counts(client, "durable") == (600, 600)
    server.stop()


def test_sigkill_then_restart_replays_every_acknowledged_span_once(clickhouse, ch_client, traces_db, tmp_path):
    spool = str(tmp_path / "spool")
    bodies = _payloads(8, 100)

    def before_kill(endpoints) -> None:
        _export_all(endpoints.grpc, bodies[:4])
        wait_rows(ch_client, traces_db, 400)
        _export_all(endpoints.grpc, bodies[4:])  # acknowledged; killed before or while they are written

    with killed_and_restarted(clickhouse.url, traces_db, spool, before_kill):
        assert wait_rows(ch_client, traces_db, 800, timeout_s=30) == 800
    assert _counts(ch_client, traces_db) == (800, 800)


def test_replay_of_an_inserted_batch_is_deduplicated(clickhouse, ch_client, traces_db, tmp_path):
    """A crash after the insert but before the next batch: the pending batch is replayed on start
    with the same insert_deduplication_token, and ClickHouse keeps one copy."""
    directory = str(tmp_path / "spool")
    for _ in range(2):  # the second run is the "restart" over the same spool
        spool = Spool(directory)
        if not spool.pending():
            for body in _payloads(3, 40):
                spool.append(body, render.count_spans(body))
        writer = SpoolWriter(
            spool, ClickHouseSink(clickhouse.url, traces_db), CollectorMetrics(), flush_interval_s=0.01
        )
        writer.start()
        assert wait_rows(ch_client, traces_db, 120) == 120
        writer.stop()
        spool.close()
    assert spool.pending() is not None  # the replay really happened on the second run
    assert _counts(ch_client, traces_db) == (120, 120)


def test_a_new_spool_never_reuses_an_old_spools_tokens(clickhouse, ch_client, traces_db, tmp_path):
    """Two spools (e.g. the default temporary one on two runs) write the same positions: their
    tokens differ, so ClickHouse keeps both batches."""
    body = _payloads(1, 30)[0]
    for run in range(2):
        spool = Spool(str(tmp_path / f"spool-{run}"))
        spool.append(body if run == 0 else _payloads(1, 30)[0], 30)
        writer = SpoolWriter(
            spool, ClickHouseSink(clickhouse.url, traces_db), CollectorMetrics(), flush_interval_s=0.01
        )
        writer.start()
        assert wait_rows(ch_client, traces_db, 30 * (run + 1)) == 30 * (run + 1)
        writer.stop()
        spool.close()
    assert _counts(ch_client, traces_db) == (60, 60)


def test_one_spool_directory_has_one_owner(tmp_path):
    first = Spool(str(tmp_path / "spool"))
    with pytest.raises(SpoolLocked):
        Spool(str(tmp_path / "spool"))
    first.close()
    Spool(str(tmp_path / "spool")).close()  # released on close


def test_a_spooled_request_this_version_cannot_render_is_set_aside(clickhouse, ch_client, traces_db, tmp_path):
    """A spool written by an older, looser version may hold a request the decoder now refuses (here:
    a resource attribute that is not UTF-8). It must neither wedge the writer nor vanish: the rest of its
    batch is inserted, and it is kept, fsync'd, in quarantine/ and counted."""
    good = _payloads(2, 20)
    bad = export_request(5, time.time_ns()).SerializeToString().replace(b"bench-host", b"bench-\xc0\xafst")
    with pytest.raises(render.InvalidSpans):
        render.count_spans(bad)
    spool = Spool(str(tmp_path / "spool"))
    for body, spans in ((good[0], 20), (bad, 5), (good[1], 20)):
        spool.append(body, spans)
    metrics = CollectorMetrics()
    writer = SpoolWriter(spool, ClickHouseSink(clickhouse.url, traces_db), metrics, flush_interval_s=0.01)
    writer.start()
    assert wait_rows(ch_client, traces_db, 40) == 40
    writer.stop()
    spool.close()
    kept = sorted((tmp_path / "spool" / "quarantine").iterdir())
    assert [p.suffix for p in kept] == [".pb", ".why"]
    assert kept[0].read_bytes() == bad and "UTF-8" in kept[1].read_text()
    assert (metrics.spans_written, metrics.spans_quarantined, metrics.spans_dropped) == (40, 5, 0)
    assert _counts(ch_client, traces_db) == (40, 40)
