"""`phaselens diagnose` on real runs: the reference server (tiny model) under `phaselens bench`,
through the collector into embedded ClickHouse. Five scenarios, one server each (its own
service.name selects it), the session's ClickHouse and collector for all (tests/stack_fixtures.py);
each load lasts a few seconds.

Each scenario states the SLO it is judged against: a verdict is always relative to a contract. The
SLOs are chosen so that CPU contention can only move a figure further from the margin line
(a tight SLO where the scenario must be at risk, a loose one for the healthy run); the verdict
itself rests on shares and ratios (analysis/thresholds.py).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from html import escape

import numpy as np
import pytest

from phaselens.analysis import queries as queries
from phaselens.analysis.diagnose.diagnose_figures import Figures, input_len_words, load_dependence
from phaselens.analysis.diagnose.diagnose_format import headline
from phaselens.analysis.diagnose.diagnosis import CAUSES, diagnose
from phaselens.analysis.report.report import write_report
from phaselens.commands import diagnose as diagnose_command
from phaselens.common.slo import parse_slo
from phaselens.loadgen.workloads import words
from tests.cli_fixtures import bench_argv
from tests.dashboards_fixtures import ALL, GrafanaQueryContext, expand_grafana_sql
from tests.stack_fixtures import serve, wait_stored


@dataclass(frozen=True, slots=True)
class Scenario:
    server_args: tuple[str, ...]
    bench_args: tuple[str, ...]
    slo: str


LONG_PROMPT_WORDS = "400"  # ≈ 1,900 tokens of the tiny model's byte-level vocabulary (context 4,096)
SCENARIOS = {
    # 24 requests at once into 2 seats: most of TTFT is waiting for a seat
    "overload": Scenario(
        ("--max-num-seqs", "2"),
        ("--rate", "inf", "--requests", "24", "--input-len", "32", "--output-len", "32"),
        "ttft:200,tpot:100",
    ),
    # long prompts, one output token, one request at a time: TTFT is the prompt's compute
    "prefill": Scenario(
        (),
        ("--concurrency", "1", "--requests", "5", "--input-len", LONG_PROMPT_WORDS, "--output-len", "1"),
        "ttft:50,tpot:1000",
    ),
    # 8 decoding streams, prompts up to 400 words admitted into their steps (mixed policy)
    "stalls": Scenario(
        ("--policy", "mixed"),
        (
            "--concurrency",
            "8",
            "--requests",
            "16",
            "--input-len",
            f"uniform:4:{LONG_PROMPT_WORDS}",
            "--output-len",
            "32",
        ),
        "ttft:10000,tpot:20",
    ),
    # 12 short prompts growing to 128 tokens each in a 512-token KV cache: preemptions
    "kv": Scenario(
        ("--kv-cache-tokens", "512", "--max-num-seqs", "16"),
        ("--rate", "inf", "--requests", "12", "--input-len", "2", "--output-len", "128"),
        "ttft:20,tpot:5",
    ),
    # two short requests per second, far below capacity even when other jobs take most of the CPU
    # (at 4 req/s and a 1 s / 100 ms SLO, a load average of 6 on the 2 cores once pushed the p99 over)
    "healthy": Scenario(
        (), ("--rate", "2", "--requests", "8", "--input-len", "32", "--output-len", "16"), "ttft:2000,tpot:200"
    ),
}


def service(name: str) -> str:
    return f"diagnose-{name}"


@pytest.fixture(scope="module")
def stack(pipeline):
    """The session's pipeline; every scenario's server started at once (their start-up is most of the
    time), then each load run alone, its server stopped (flushing its spans) before the next."""
    servers = {name: serve(pipeline, f"server-{name}", service(name), *s.server_args) for name, s in SCENARIOS.items()}
    try:
        for name, s in SCENARIOS.items():
            url = servers[name].wait_ready(180)
            bench = subprocess.run(
                bench_argv(url, "--quiet", "--ignore-eos", *s.bench_args),
                env=pipeline.otel_env(f"{service(name)}-client"),
                capture_output=True,
                text=True,
                timeout=300,
                check=False,
            )
            assert bench.returncode == 0, bench.stderr[-2000:]
            assert servers[name].stop(30) == 0
    finally:
        for server in servers.values():
            server.stop(30)
    wait_stored(pipeline)
    return pipeline


@pytest.fixture(scope="module")
def verdicts(stack):
    with stack.client() as ch:
        return {
            name: diagnose(
                ch, database=stack.database, service=service(name), since=None, slo=parse_slo(s.slo, ("ttft", "tpot"))
            )
            for name, s in SCENARIOS.items()
        }


def test_overload_is_queueing_and_asks_for_a_second_rate(verdicts):
    d = verdicts["overload"]
    assert d.primary_cause == "queue", d.signals
    assert d.levels["p50"].primary_cause == "queue" and d.levels["p99"].primary_cause == "queue"
    queue = next(s for s in d.signals if s.cause == "queue")
    assert queue.p50_signal > 0.5  # most of the median TTFT is the wait for a seat
    # one burst, one arrival rate: the verdict says a slower run is needed and names it
    assert d.load.single_rate and d.load.grows is None
    assert d.load.next_run.startswith("phaselens bench ") and "--rate " in d.load.next_run
    assert any(lever.cause == "queue" and d.load.next_run in lever.evidence for lever in d.levers)


def test_long_prompts_at_a_low_rate_are_prefill(verdicts):
    d = verdicts["prefill"]
    assert d.primary_cause == "prefill", d.signals
    assert d.levels["p50"].primary_cause == "prefill"
    prefill = next(s for s in d.signals if s.cause == "prefill")
    assert prefill.p50_signal > 0.5
    assert {lever.cause for lever in d.levers} >= {"prefill"}
    assert any("prefix-cache hit rate" in lever.evidence for lever in d.levers)


def test_long_prompts_mixed_into_decoding_streams_are_prefill_stalls(verdicts):
    d = verdicts["stalls"]
    assert "prefill_stalls" in d.causes, d.signals
    stalls = next(s for s in d.signals if s.cause == "prefill_stalls")
    assert stalls.p50_signal >= 0.2  # a fifth of the decode-token time lost in steps carrying prefill
    lever = next(lv for lv in d.levers if lv.cause == "prefill_stalls" and "--max-num-batched-tokens" in lv.action)
    assert "carried prefill" in lever.evidence


def test_a_tiny_kv_cache_is_kv_pressure(verdicts):
    d = verdicts["kv"]
    assert d.primary_cause == "kv_pressure", d.signals
    assert d.levels["p50"].primary_cause == "kv_pressure" and d.levels["p99"].primary_cause == "kv_pressure"
    assert any("preempt" in lever.evidence for lever in d.levers if lever.cause == "kv_pressure")


def test_a_healthy_run_is_none(verdicts):
    d = verdicts["healthy"]
    assert (d.primary_cause, d.causes) == ("none", ["none"]), d.signals
    assert d.levers == []
    assert d.steps[4].finding == "100 % of requests meet every SLO"


def test_every_verdict_uses_the_vocabulary_and_six_steps(verdicts):
    for name, d in verdicts.items():
        args = SCENARIOS[name].bench_args
        assert d.requests == int(args[args.index("--requests") + 1])  # the scenario's requests, no other's
        assert d.primary_cause in CAUSES and set(d.causes) <= set(CAUSES)
        assert d.causes[0] == d.primary_cause
        assert [s.number for s in d.steps] == [1, 2, 3, 4, 5, 6]
        assert all(s.evidence for s in d.steps)
        assert all(lever.evidence for lever in d.levers)


def _cli(capsys, *argv) -> tuple[int, str, str]:
    parser = argparse.ArgumentParser(prog="phaselens")
    diagnose_command.register(parser.add_subparsers())
    args = parser.parse_args(["diagnose", *argv])
    rc = args.func(args)
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_the_cli_formats_say_the_same_verdict(stack, verdicts, capsys):
    argv = (
        "--clickhouse",
        stack.clickhouse_url,
        "--database",
        stack.database,
        "--service",
        service("overload"),
        "--since",
        "all",
        "--slo",
        SCENARIOS["overload"].slo,
    )
    rc, out, _ = _cli(capsys, *argv, "--format", "json")
    got = json.loads(out)
    assert rc == 0 and got["primary_cause"] == "queue" and got["causes"] == verdicts["overload"].causes
    assert set(got["levels"]) == {"p50", "p99"}
    rc, out, _ = _cli(capsys, *argv, "--format", "markdown")
    assert rc == 0 and out.startswith("**verdict: queue (p50: queue; p99: queue)")
    rc, out, _ = _cli(capsys, *argv)
    assert rc == 0 and "verdict: queue" in out and "6. Cause, from server-side evidence" in out


def test_cli_errors_are_one_line(capsys):
    rc, _, err = _cli(capsys, "--clickhouse", "http://127.0.0.1:9", "--since", "all")
    assert rc == 1 and err.startswith("error: cannot reach ClickHouse") and err.count("\n") == 1
    rc, _, err = _cli(capsys, "--slo", "ttft:-1")
    assert rc == 1 and err.startswith("error: --slo:")


def test_an_empty_selection_is_an_error_not_a_verdict(stack, capsys):
    where = ("--clickhouse", stack.clickhouse_url, "--database", stack.database)
    rc, out, err = _cli(capsys, *where, "--service", "no-such-service", "--since", "all")
    assert (rc, out) == (1, "")
    assert (
        err
        == "error: no requests in the selection (database stack, all time, service no-such-service): nothing to diagnose\n"
    )


@pytest.mark.parametrize("name", ["kv", "healthy"])
def test_the_grafana_verdict_panel_says_what_the_cli_says(stack, verdicts, name):
    """The panel's SQL (macros expanded by the STAND-IN of tests/dashboards_fixtures.py) ranks the
    same causes with the same roles as `diagnose`."""
    slo = parse_slo(SCENARIOS[name].slo, ("ttft", "tpot"))
    now = int(time.time())
    ctx = GrafanaQueryContext(
        now - 3600,
        now + 60,
        10,
        {"service": service(name), "model": ALL, "ttft_slo_ms": f"{slo.ttft_ms:g}", "tpot_slo_ms": f"{slo.tpot_ms:g}"},
        options={"model": ["tiny"]},
    )
    with stack.client() as ch:
        rows = ch.query(expand_grafana_sql(queries.render_grafana("diagnosis_causes", stack.database), ctx)).result_rows
    assert [(cause, role) for cause, role, *_ in rows] == [(s.cause, s.role) for s in verdicts[name].signals]


def test_the_html_report_opens_with_the_diagnosis(stack, verdicts, tmp_path):
    d = verdicts["overload"]
    page = tmp_path / "report.html"
    with stack.client() as ch:
        write_report(
            ch,
            str(page),
            database=stack.database,
            since=None,
            service=service("overload"),
            slo=parse_slo(SCENARIOS["overload"].slo, ("ttft", "tpot")),
        )
    main = page.read_text(encoding="utf-8").split("<main>", 1)[1]
    assert main.lstrip().startswith('<section id="diagnosis">')  # above the KPIs and every chart
    diagnosis = main.split("</section>", 1)[0]
    assert headline(d) in diagnosis and "6. Cause, from server-side evidence" in diagnosis
    assert all(escape(lever.evidence) in diagnosis for lever in d.levers) and d.levers


def _buckets(rates_and_queues: list[tuple[float, float]], bucket_s: int) -> list[dict]:
    """`queueing_vs_load` rows in time order, a partial bucket at each edge."""
    edge = {"arrivals_per_s": 1.0 / bucket_s, "queue_p50_ms": 0.0}
    return [edge, *({"arrivals_per_s": r, "queue_p50_ms": q} for r, q in rates_and_queues), edge]


def test_load_dependence_compares_the_slower_and_faster_buckets():
    f = Figures(requests=120, window_s=60.0, models=["tiny"], quantiles={"input_tokens": [100, 200]})
    grows = load_dependence(_buckets([(1.0, 5.0), (1.2, 6.0), (4.0, 40.0), (5.0, 80.0)], 10), 10, f)
    assert (grows.single_rate, grows.grows) == (False, True)
    assert (grows.queue_low_ms, grows.queue_high_ms) == (5.5, 60.0)  # medians of each half
    flat = load_dependence(_buckets([(1.0, 5.0), (1.2, 6.0), (4.0, 6.0), (5.0, 5.0)], 10), 10, f)
    assert (flat.single_rate, flat.grows) == (False, False)


def test_one_rate_asks_for_a_second_run_at_a_quarter_of_it():
    f = Figures(
        requests=120,
        window_s=60.0,
        models=["tiny"],
        server_url="http://127.0.0.1:8000",
        quantiles={"input_tokens": [100.0, 300.0], "output_tokens": [32.0, 32.0]},
    )
    # Poisson noise around 2 req/s, and the edge buckets (partial) left out of the comparison
    d = load_dependence(_buckets([(1.8, 50.0), (2.1, 60.0), (2.3, 90.0)], 10), 10, f)
    assert (d.single_rate, d.grows, d.buckets) == (True, None, 3)
    assert d.next_run == (
        "phaselens bench --url http://127.0.0.1:8000 --model tiny --rate 0.50 --requests 120 "
        "--input-len 21 --output-len 32 --ignore-eos"
    )  # words of ~4.8 bytes: ≈ 100 tokens


@pytest.mark.parametrize("tokens", [100.0, 1900.0])
def test_the_suggested_input_len_gives_the_tiny_model_the_measured_prompt_tokens(tokens):
    """The tiny model counts one token per UTF-8 byte: `--input-len` words of bench's prompts must come
    to the measured prompt tokens (±10 %), not to ~4.8× as many (past its 4,096-token context)."""
    f = Figures(requests=10, window_s=5.0, models=["tiny"], quantiles={"input_tokens": [tokens, tokens]})
    n = input_len_words(f)
    prompt_bytes = [len(words(np.random.default_rng(seed), n).encode()) for seed in range(20)]
    assert abs(statistics.mean(prompt_bytes) - tokens) <= 0.1 * tokens
    # a model of another vocabulary: words ≈ tokens (English BPE)
    assert input_len_words(Figures(models=["Qwen/Qwen2.5-0.5B"], quantiles={"input_tokens": [tokens]})) == tokens
