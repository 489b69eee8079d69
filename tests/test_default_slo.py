"""Goodput without `--slo`: budget, diagnose and report judge against the one default SLO, say so, and
say whose figures they judged; on server-only rows that is the server's TTFT/TPOT, not a 0 % goodput."""

from __future__ import annotations

import csv
import io
import json

import pytest

from phaselens.commands import budget as budget_command
from phaselens.commands import diagnose as diagnose_command
from phaselens.commands import report as report_command
from phaselens.common.slo import DEFAULT_SLO, SLO, goodput_slo
from tests import spangen
from tests.analysis_fixtures import loaded
from tests.cli_fixtures import run_command

N = 12


@pytest.fixture(scope="module")
def server_only(clickhouse) -> str:
    """N server-only requests, every one well within the default SLO (spangen's TTFTs are tens of ms)."""
    return loaded(clickhouse, spangen.generate(N, seed=7, server_only_every=1), transport="insert")


def _run(capsys, register, clickhouse, db, *argv) -> str:
    rc = run_command(register, argv[0], "--clickhouse", clickhouse.url, "--database", db, "--since", "1h", *argv[1:])
    out = capsys.readouterr()
    assert rc == 0, out.err
    return " ".join(out.out.split())  # rich wraps long lines


def test_goodput_slo_fills_each_key_left_out():
    assert goodput_slo(None) == DEFAULT_SLO == SLO(ttft_ms=500, tpot_ms=50)
    assert goodput_slo("ttft:200") == SLO(ttft_ms=200, tpot_ms=50)
    assert goodput_slo("tpot:20") == SLO(ttft_ms=500, tpot_ms=20)
    with pytest.raises(ValueError, match="bad SLO 'e2el:9'"):
        goodput_slo("e2el:9")


@pytest.mark.parametrize("exact", [False, True])
def test_budget_without_slo_judges_the_default_on_server_figures(clickhouse, server_only, capsys, exact):
    flags = ["--exact"] if exact else []
    out = _run(capsys, budget_command.register, clickhouse, server_only, "budget", *flags)
    assert f"goodput: {N} good requests" in out and "attainment 100.0%" in out, out
    assert "SLO ttft ≤ 500 ms, tpot ≤ 50 ms (the default: set one with --slo ttft:MS,tpot:MS)" in out
    assert "judged on server TTFT/TPOT: no client view" in out
    got = json.loads(
        _run(capsys, budget_command.register, clickhouse, server_only, "budget", "--format", "json", *flags)
    )
    assert got["goodput"]["good_requests"] == N and got["goodput"]["attainment"] == 1.0
    assert (got["goodput"]["slo_is_default"], got["goodput"]["judged_on"]) == (True, "server")
    out = _run(capsys, budget_command.register, clickhouse, server_only, "budget", "--format", "csv", *flags)
    rows = dict(csv.reader(io.StringIO(out.replace(" ", "\n"))))
    assert (rows["goodput.slo_is_default"], rows["goodput.judged_on"], rows["goodput.ttft_slo_ms"]) == (
        "True",
        "server",
        "500.0",
    )


def test_budget_key_left_out_takes_its_default(clickhouse, server_only, capsys):
    """A TTFT SLO below every request's TTFT: none good, and the TPOT SLO is the default's, not absent."""
    got = json.loads(
        _run(capsys, budget_command.register, clickhouse, server_only, "budget", "--slo", "ttft:1", "--format", "json")
    )
    g = got["goodput"]
    assert (g["good_requests"], g["ttft_slo_ms"], g["tpot_slo_ms"], g["slo_is_default"]) == (0, 1, 50, False)
    out = _run(capsys, budget_command.register, clickhouse, server_only, "budget", "--slo", "ttft:1")
    assert "SLO ttft ≤ 1 ms, tpot ≤ 50 ms; judged on server" in out and "the default" not in out


def test_diagnose_without_slo_names_the_default(clickhouse, server_only, capsys):
    got = json.loads(_run(capsys, diagnose_command.register, clickhouse, server_only, "diagnose", "--format", "json"))
    assert got["slo"] == {"ttft_ms": 500, "tpot_ms": 50}
    assert (got["slo_is_default"], got["judged_on"]) == (True, "server")
    goodput = next(s for s in got["steps"] if s["number"] == 5)
    assert goodput["finding"] == "100 % of requests meet every SLO", goodput
    assert "(the default: set one with --slo" in goodput["evidence"][0]


def test_report_without_slo_shows_the_default_goodput(clickhouse, server_only, capsys, tmp_path):
    page = tmp_path / "r.html"
    _run(capsys, report_command.register, clickhouse, server_only, "report", "--out", str(page))
    html = page.read_text()
    assert "judged on server TTFT/TPOT: no client view" in html and "100.0%" in html
    assert "SLO ttft ≤ 500 ms, tpot ≤ 50 ms (the default" in html
