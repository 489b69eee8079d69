"""The disaggregated budget's unobserved edges on every surface: P/D requests through a router,
prefill and decode instance (phaselens's own span model, tests/phaselens_pd_spans.py) whose client
spans carry no send/read stamps and whose router no inbound stamp have those terms NULL, never 0:
`phaselens budget`'s `disaggregated` JSON (null), CSV (empty) and table (`unobserved`), the P/D
Grafana panel (macros expanded) and its exact twin; with the stamps, figures. Spans go through the
real OTel SDK, OTLP exporter, collector and ClickHouse."""

from __future__ import annotations

import csv
import dataclasses
import io
import json
import time

import pytest

from phaselens.analysis import queries
from phaselens.analysis.rollup import rollup
from phaselens.collectors.service import Collector
from phaselens.common.process import LOOPBACK
from tests import phaselens_pd_spans as pds
from tests.analysis_fixtures import client, new_database
from tests.dashboards_fixtures import GrafanaQueryContext, expand_grafana_sql
from tests.native_spans import provider
from tests.test_unobserved import _cli, _context

__all__ = ["client"]

EDGES = ("inbound_ms", "client_ms", "client_late_est_ms")
STATISTICS = ("p50", "p90", "p99", "mean")
BARE = [
    pds.PdRequest((1.5, 4.0, 20.0, 2.0), 0.5, 6.0, 1.0, (1.0, 2.0, 5.0, 0.75), (0.5, 0.25, 0.5), (3.0, 2.5), 4.0),
    pds.PdRequest((2.0, 9.0, 35.0, 2.5), 1.0, 9.0, 1.5, (1.25, 3.0, 6.0, 1.0), (0.75, 0.5, 0.25), (3.5, 2.0), 6.0),
]
STAMPED = [
    dataclasses.replace(r, client_send_ms=0.25 * (i + 1), client_read_ms=0.5, inbound_ms=1.0 + i)
    for i, r in enumerate(BARE)
]


def _load(clickhouse, client, tmp_path_factory, requests: list[pds.PdRequest]) -> str:
    """A database holding `requests`, once every one is a complete P/D row; its live rollup refreshed."""
    db = new_database(client, "pd_unobserved")
    collector = Collector(
        clickhouse.url, database=db, spool_dir=str(tmp_path_factory.mktemp("spool")), flush_interval_s=0.05
    ).start()
    endpoint = f"{LOOPBACK}:{collector.grpc_port}"
    tps = {role: pds.provider(endpoint, role) for role in pds.INSTANCES} | {
        "client": provider(endpoint, "phaselens-loadgen")
    }
    tracers = {role: tp.get_tracer("phaselens") for role, tp in tps.items()}
    t0 = (time.time_ns() // 10**9 - 60) * 10**9
    ids = [pds.emit(tracers, r, t0 + i * 10**9) for i, r in enumerate(requests)]
    for tp in tps.values():
        tp.shutdown()
    sql = (
        "SELECT count() FROM {db:Identifier}.phaselens_requests WHERE trace_id IN {ids:Array(String)} "
        "AND kv_bytes_received IS NOT NULL AND client_ttft_ms IS NOT NULL AND decode_first_chunk_ms IS NOT NULL "
        "AND prefill_respond_ms IS NOT NULL AND prefill_hop_ms IS NOT NULL AND decode_hop_ms IS NOT NULL"
    )
    deadline = time.monotonic() + 30  # bounded: the collector flushes every 50 ms
    while client.query(sql, parameters={"db": db, "ids": ids}).result_rows[0][0] < len(ids):
        assert time.monotonic() < deadline, "the P/D rows did not arrive"
        time.sleep(0.1)
    collector.stop()
    rollup.refresh_live(client, db)
    return db


@pytest.fixture(scope="module")
def bare(clickhouse, client, tmp_path_factory) -> str:
    return _load(clickhouse, client, tmp_path_factory, BARE)


@pytest.fixture(scope="module")
def stamped(clickhouse, client, tmp_path_factory) -> str:
    return _load(clickhouse, client, tmp_path_factory, STAMPED)


def _mean(values: list[float]) -> float:
    return sum(values) / len(values)


def _budget_json(capsys, clickhouse, db: str, exact: bool) -> dict:
    argv = ("--clickhouse", clickhouse.url, "--database", db, "--since", "1h", *(["--exact"] * exact))
    got = json.loads(_cli(capsys, *argv, "--format", "json"))["disaggregated"]
    assert (got["requests"], got["complete"]) == (2, 2), got
    return {t["name"]: t["ms"] for t in got["terms"]}


@pytest.mark.parametrize("exact", [False, True])
def test_unstamped_edges_are_null_in_the_json_and_the_rest_add_up(capsys, clickhouse, bare, exact):
    terms = _budget_json(capsys, clickhouse, bare, exact)
    for t in EDGES:
        assert set(terms[t].values()) == {None}, (t, terms[t])
    assert terms["prefill_compute_ms"]["mean"] == pytest.approx(_mean([r.prefill[2] for r in BARE]))
    assert terms["residual_ms"]["mean"] == pytest.approx(_mean([r.network_ms for r in BARE]))
    # the edges counted 0 inside: the figures shown still add up to the mean client TTFT
    shown = sum(ms["mean"] for name, ms in terms.items() if ms["mean"] is not None)
    assert shown == pytest.approx(_mean([r.client_ttft_ms for r in BARE]))


def test_unstamped_edges_are_empty_in_the_csv_and_unobserved_in_the_table(capsys, clickhouse, bare):
    argv = ("--clickhouse", clickhouse.url, "--database", bare, "--since", "1h")
    rows = dict(csv.reader(io.StringIO(_cli(capsys, *argv, "--format", "csv"))))
    assert {rows[f"disaggregated.terms.{t}.ms.{s}"] for t in EDGES for s in STATISTICS} == {""}
    assert float(rows["disaggregated.terms.kv_transfer_ms.ms.mean"]) == pytest.approx(7.5)
    table = _cli(capsys, *argv, "--format", "table")
    pd_table = table[table.index("Disaggregated TTFT budget") :]
    for t in EDGES:
        assert f"{t} {queries.UNOBSERVED}" in pd_table, pd_table
    assert f"kv_transfer_ms {queries.UNOBSERVED}" not in pd_table


def _panel(client, db: str, name: str) -> dict[str, dict]:
    """The P/D budget stack (`name`) with Grafana's macros expanded: statistic → row."""
    ctx: GrafanaQueryContext = _context(None)
    rows = client.query(expand_grafana_sql(queries.render_grafana(name, db), ctx)).named_results()
    return {r.pop("statistic"): r for r in rows}


def _stacks(client, db: str) -> tuple[dict[str, dict], dict[str, dict]]:
    """The P/D panel (rollups) and its exact twin."""
    return _panel(client, db, "pd_budget_stack_rollup"), _panel(client, db, "pd_budget_stack")


def test_the_panel_says_unobserved_and_agrees_with_the_exact_stack(client, bare):
    rollup_rows, exact_rows = _stacks(client, bare)
    assert list(rollup_rows) == list(exact_rows) == list(STATISTICS)
    for s in STATISTICS:
        assert all(rollup_rows[s][t] is None and exact_rows[s][t] is None for t in EDGES), (s, rollup_rows[s])
        observed = [t for t in exact_rows[s] if t not in EDGES]
        assert all(rollup_rows[s][t] is not None and exact_rows[s][t] is not None for t in observed), rollup_rows[s]
    # the means exact on both paths (a sketch's p50 of two requests is one of them, not their midpoint)
    assert rollup_rows["mean"] == pytest.approx(exact_rows["mean"])
    assert exact_rows["mean"]["decode_first_token_ms"] == pytest.approx(5.5)


def test_stamped_edges_are_figures_on_every_path(capsys, clickhouse, client, stamped):
    for exact in (False, True):
        terms = _budget_json(capsys, clickhouse, stamped, exact)
        assert terms["client_ms"]["mean"] == pytest.approx(_mean([0.25 + 0.5, 0.5 + 0.5]))
        assert terms["inbound_ms"]["mean"] == pytest.approx(1.5)
        assert set(terms["client_late_est_ms"].values()) == {None}  # its inputs were not stamped
        assert terms["residual_ms"]["mean"] == pytest.approx(_mean([r.network_ms for r in STAMPED]))
    rollup_rows, exact_rows = _stacks(client, stamped)
    assert rollup_rows["mean"]["client_ms"] == exact_rows["mean"]["client_ms"] == pytest.approx(0.875)
    assert 0.99 <= rollup_rows["p99"]["inbound_ms"] <= 2.02  # a sketch's order statistic: 1 or 2 ms, within 1 %
    assert rollup_rows["mean"]["client_late_est_ms"] is None
