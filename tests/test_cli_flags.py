"""Every flag a subcommand accepts takes effect or is refused by name: the refusals (before anything
starts), and the flags of the commands that read ClickHouse each changing the output (one shared
ClickHouse)."""

from __future__ import annotations

import csv
import io
import json

import pytest

from phaselens.analysis.budget import budget_format
from phaselens.analysis.budget.latency_budget import ComponentBudget, Stat, budget
from phaselens.analysis.budget.pd_budget import TTFT_TERMS, PdBudget
from phaselens.cli import main
from tests import spangen
from tests.analysis_fixtures import client, loaded

# (argv, the refused flags and why, as the usage error names them); nothing listens on port 9
REFUSED = [
    (["budget", "--exact", "--approx"], "--exact, --approx choose how to read: give one"),
    (["clickhouse", "--data", "d", "--shards", "2", "--http-port", "8124"], "--http-port set one node's ports"),
    (["clickhouse", "--data", "d", "--shards", "2", "--tcp-port", "9001"], "--tcp-port set one node's ports"),
    (["clickhouse", "--data", "d", "--cluster-name", "c"], "--cluster-name names the cluster of --shards"),
    (
        ["collector", "--clickhouse", "http://127.0.0.1:9", "--cluster-insert", "distributed"],
        "--cluster-insert routes rows to a cluster's shards: give --cluster NAME",
    ),
    (
        ["collector", "--clickhouse", "http://127.0.0.1:9", "--clickhouse-ca", "ca.pem"],
        "--clickhouse-ca verifies an https:// ClickHouse",
    ),
    (["serve", "--role", "router", "--model", "other"], "--model configure a model server; the router runs no model"),
    (["serve", "--role", "router", "--engine", "process"], "--engine configure a model server"),
    (["serve", "--role", "router", "--max-num-seqs", "3"], "--max-num-seqs configure a model server"),
    (
        ["serve", "--role", "router", "--tls-cert", "c.pem", "--tls-key", "k.pem"],
        "--tls-cert, --tls-key are not served by the router (plain HTTP only)",
    ),
    (["serve", "--kv-port", "5555"], "--kv-port is the decode instance's KV-transfer port"),
    (["serve", "--role", "prefill", "--kv-port", "5555"], "--kv-port is the decode instance's KV-transfer port"),
    (["schema", "apply", "--clickhouse", "http://127.0.0.1:9", "--ddl", "per-node"], "--ddl says how to create"),
    (["schema", "apply", "--print", "--clickhouse", "http://127.0.0.1:9"], "--clickhouse is not used by --print"),
    (["schema", "apply"], "--clickhouse URL is required (or --print the statements)"),
    (
        ["dashboards", "push", "--grafana", "http://127.0.0.1:9", "--token", "t", "--user", "u", "--password", "p"],
        "--user, --password would be ignored: a --token (or $GRAFANA_TOKEN) wins",
    ),
    (
        ["bench", "--url", "http://127.0.0.1:9", "--model", "tiny", "--dataset", "p.jsonl", "--input-len", "64"],
        "--input-len size synthetic prompts; --dataset brings its own",
    ),
    (
        ["bench", "--url", "http://127.0.0.1:9", "--model", "tiny", "--dataset", "p.jsonl", "--tokenizer", "gpt2"],
        "--tokenizer size synthetic prompts",
    ),
]


@pytest.mark.parametrize(("argv", "message"), REFUSED, ids=[" ".join(a) for a, _ in REFUSED])
def test_a_flag_that_would_not_take_effect_is_refused_by_name(capsys, argv, message):
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_demo_disagg_refuses_report(capsys):
    """`--disagg` prints its budgets and verdict; a --report it would not write is an error (exit 2)."""
    assert main(["demo", "--disagg", "--report", "r.html"]) == 2
    assert "--report: --disagg writes no HTML report" in capsys.readouterr().err


@pytest.fixture(scope="module")
def db(clickhouse):
    """Two models' requests, a fifth of them server-only."""
    workload = spangen.generate(20, seed=4, models=("tiny", "small"), server_only_every=5, n_steps=4)
    return loaded(clickhouse, workload, transport="insert")


def _out(capsys, argv) -> str:
    assert main(argv) == 0
    return capsys.readouterr().out


# (command with its selection, a flag and its value): each flag must change the output
BUDGET = ["budget", "--since", "1h", "--format", "json"]
CHANGES = [
    (BUDGET, ["--exact"]),
    (BUDGET, ["--approx"]),
    (BUDGET, ["--model", "small"]),
    (BUDGET, ["--service", "nobody"]),
    (BUDGET, ["--slo", "ttft:1"]),
    (BUDGET, ["--since", "all"]),
    (["budget", "--since", "1h"], ["--format", "csv"]),
    (["diagnose", "--since", "1h", "--format", "json"], ["--slo", "tpot:1"]),
    (["diagnose", "--since", "1h", "--format", "json"], ["--model", "small"]),
    (["diagnose", "--since", "1h"], ["--format", "markdown"]),
]


@pytest.mark.parametrize(("base", "flag"), CHANGES, ids=[" ".join(b[:1] + f) for b, f in CHANGES])
def test_each_selection_flag_changes_the_output(clickhouse, db, capsys, base, flag):
    store = ["--clickhouse", clickhouse.url, "--database", db]
    without = _out(capsys, [*base, *store])
    with_flag = _out(capsys, [*base, *store, *flag])
    assert with_flag != without


def test_budget_database_flag_reads_that_database(clickhouse, db, capsys):
    got = json.loads(
        _out(capsys, ["budget", "--clickhouse", clickhouse.url, "--database", db, "--since", "1h", "--format", "json"])
    )
    assert got["requests"] == 20 and got["with_client"] == 16


def test_report_out_writes_there(clickhouse, db, capsys, tmp_path):
    page = tmp_path / "elsewhere.html"
    out = _out(
        capsys, ["report", "--clickhouse", clickhouse.url, "--database", db, "--since", "1h", "--out", str(page)]
    )
    assert str(page) in out and page.read_text().startswith("<!DOCTYPE html>")


SCHEMA = ["schema", "apply", "--print"]
SCHEMA_CHANGES = [
    ["--database", "other"],
    ["--ttl", "72h"],
    ["--cluster", "c"],
    ["--cluster", "c", "--ddl", "per-node"],
    ["--table-engine", "ReplicatedMergeTree('/t/{shard}', '{replica}')"],
]


@pytest.mark.parametrize("flag", SCHEMA_CHANGES, ids=" ".join)
def test_each_schema_flag_changes_the_statements(capsys, flag):
    base = ["--cluster", "c"] if "--ddl" in flag else []
    assert _out(capsys, [*SCHEMA, *flag]) != _out(capsys, [*SCHEMA, *base])


def test_budget_csv_carries_the_disaggregated_budget(client, db):
    """The CSV flattens the P/D budget under `disaggregated.*`, as the JSON nests it."""
    terms = [ComponentBudget(t, Stat(2.0, 3.0, 4.0, 2.5), Stat()) for t in TTFT_TERMS]
    pd = PdBudget(requests=7, complete=6, terms=terms, side={})
    rows = dict(csv.reader(io.StringIO(budget_format.to_csv(budget(client, database=db, since="1h"), pd.to_dict()))))
    assert rows["requests"] == "20" and rows["disaggregated.requests"] == "7"
    assert rows[f"disaggregated.terms.{TTFT_TERMS[0]}.ms.p99"] == "4.0"
