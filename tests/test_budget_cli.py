"""`phaselens budget`: the same figures as the Python API in every format; one-line errors."""

from __future__ import annotations

import argparse
import csv
import io
import json

import pytest

from phaselens.analysis.budget.latency_budget import budget
from phaselens.analysis.queries import sketch
from phaselens.commands import budget as budget_command
from phaselens.common.process import free_port
from phaselens.common.slo import SLO
from tests import spangen
from tests.analysis_fixtures import client, loaded, new_database


@pytest.fixture(scope="module")
def db(clickhouse):
    return loaded(clickhouse, spangen.generate(25, seed=2, server_only_every=5, n_steps=8), transport="insert")


def _cli(capsys, *argv) -> tuple[int, str, str]:
    """The `phaselens budget` subcommand as cli.py registers it (without importing the other
    commands, whose imports load torch)."""
    parser = argparse.ArgumentParser(prog="phaselens")
    budget_command.register(parser.add_subparsers())
    args = parser.parse_args(["budget", *argv])
    rc = args.func(args)
    out = capsys.readouterr()
    return rc, out.out, out.err


@pytest.mark.parametrize("exact", [False, True])
def test_json_matches_the_python_api(clickhouse, client, db, capsys, exact):
    """The default reads the rollups and says so in `source` and `approximation`; --exact every request."""
    rc, out, _ = _cli(
        capsys,
        "--clickhouse",
        clickhouse.url,
        "--database",
        db,
        "--since",
        "1h",
        "--slo",
        "ttft:40,tpot:15",
        "--format",
        "json",
        *(["--exact"] if exact else []),
    )
    assert rc == 0
    got = json.loads(out)
    want = budget(client, database=db, since="1h", slo=SLO(ttft_ms=40, tpot_ms=15), exact=exact).to_dict()
    assert got["requests"] == want["requests"] == 25 and got["with_client"] == 20
    assert got["components"] == json.loads(json.dumps(want["components"]))
    assert got["goodput"]["ttft_slo_ms"] == 40 and got["goodput"]["good_requests"] == want["goodput"]["good_requests"]
    assert (got["source"], got["approximation"]) == (("exact", None) if exact else ("rollup", sketch.NOTE))


def test_table_and_csv(clickhouse, db, capsys):
    rc, out, _ = _cli(capsys, "--clickhouse", clickhouse.url, "--database", db, "--model", "tiny")
    assert rc == 0 and "TTFT budget (25 requests" in out and "prefill_ms" in out and "grew most" in out
    assert "source: rollup (approximate: quantiles from DDSketch rollups" in " ".join(out.split())
    # these spans carry no kernel receive stamps: the edge terms are unobserved, not 0.00, in the
    # budget and in the tail attribution
    edges = (" inbound_ms ", " client_ms ", " client_late_est_ms ", " client_late_est_ms* ")
    edge_rows = [line for line in out.splitlines() if any(edge in line for edge in edges)]
    assert sum("unobserved" in line for line in edge_rows) == 3, edge_rows
    assert len(edge_rows) == 6 and not any("0.00" in line for line in edge_rows), edge_rows
    # the tail table marks the estimate and says what the mark means
    assert sum(" client_late_est_ms* " in line for line in edge_rows) == 1 and "* an estimate, not measured" in out
    rc, out, _ = _cli(capsys, "--clickhouse", clickhouse.url, "--database", db, "--format", "csv")
    rows = dict(csv.reader(io.StringIO(out)))
    assert rc == 0 and rows["requests"] == "25" and float(rows["components.prefill_ms.ms.p50"]) > 0
    assert rows["components.inbound_ms.ms.mean"] == rows["components.client_ms.ms.mean"] == ""
    assert (
        rows["components.client_late_est_ms.ms.mean"] == ""
        and rows["components.client_late_est_ms.estimated"] == "True"
    )


def test_unreachable_clickhouse_is_one_line_and_exit_1(capsys):
    rc, out, err = _cli(capsys, "--clickhouse", f"http://127.0.0.1:{free_port()}")
    assert rc == 1 and out == "" and err.count("\n") == 1 and "cannot reach ClickHouse" in err


def test_missing_schema_is_one_line_and_exit_1(clickhouse, client, capsys):
    client.command("CREATE DATABASE IF NOT EXISTS cli_empty")
    rc, _, err = _cli(capsys, "--clickhouse", clickhouse.url, "--database", "cli_empty")
    assert rc == 1 and err.count("\n") == 1 and "phaselens schema apply" in err


@pytest.mark.parametrize("flag,value,message", [("--slo", "ttft=5", "--slo"), ("--since", "5x", "duration")])
def test_bad_flags_are_one_line_and_exit_1(clickhouse, client, capsys, flag, value, message):
    database = new_database(client)
    rc, _, err = _cli(capsys, "--clickhouse", clickhouse.url, "--database", database, flag, value)
    assert rc == 1 and err.count("\n") == 1 and message in err


def test_a_malicious_model_flag_is_a_harmless_value(clickhouse, client, db, capsys):
    evil = "tiny' OR 1=1) --; DROP TABLE otel_traces"
    rc, out, _ = _cli(
        capsys, "--clickhouse", clickhouse.url, "--database", db, "--since", "all", "--model", evil, "--format", "json"
    )
    assert rc == 0 and json.loads(out)["requests"] == 0
    assert client.query(f"SELECT count() FROM {db}.otel_traces").result_rows[0][0] > 0
