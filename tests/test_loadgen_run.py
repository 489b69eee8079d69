"""The runner, the capacity sweep and the `phaselens bench` command against scripted SSE servers."""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from opentelemetry.sdk.trace import TracerProvider

from phaselens.commands import bench
from phaselens.common.clocks import perf_counter_ts
from phaselens.instrumentation.client.traced_client import TracedClient
from phaselens.loadgen import metrics, runner, session
from phaselens.loadgen.arrivals import GammaArrivals
from phaselens.loadgen.scripted_server import Reply, ScriptedServer, Step, completion_chunk, usage_chunk
from phaselens.loadgen.workloads import LengthDist, SyntheticWorkload
from phaselens.reference_server.serving.sse import DONE_EVENT

ROOT = Path(__file__).resolve().parents[1]
WORK = SyntheticWorkload(LengthDist.parse("8"), LengthDist.parse("4"), seed=0)


def streaming(chunks=4, interval_ms=2.0, hold_ms=0.0):
    async def handler(request):
        steps = [Step(hold_ms, completion_chunk("t"))]
        steps += [Step(interval_ms, completion_chunk("t")) for _ in range(chunks - 1)]
        return Reply(steps=[*steps, Step(0, usage_chunk(8, chunks) + DONE_EVENT)])

    return handler


def run_plan(plan, handler, url=None):
    async def main():
        async with ScriptedServer(handler) as server:
            async with TracedClient(url or server.url, tracer_provider=TracerProvider()) as client:
                return await runner.run(plan, client, WORK.requests()), server.requests

    return asyncio.run(main())


def cli_main(argv: list[str]) -> int:
    """`phaselens ARGV` with only the bench command registered (phaselens.cli imports every command,
    the model server's torch among them: ~20 s this test does not need)."""
    parser = argparse.ArgumentParser(prog="phaselens")
    bench.register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return args.func(args)


def sleep_lateness_ms(requests, interval_ms: float, hold_ms: float = 0.0) -> float:
    """Median of how late the scripted server's sleeps ended (ms; stamps of one loop, one clock): the
    same run's measure of the timer lateness the runner's own sleeps see. Step k ≥ 1 is due
    `interval_ms` after step k − 1, step 0 `hold_ms` after the request arrived."""
    late = []
    for r in requests:
        starts = [r.received_ts, *r.sent_ts[:-2]]  # the last write (usage, [DONE]) has no sleep
        nominal = [hold_ms] + [interval_ms] * (len(starts) - 1)
        late += [(b - a) / 1e6 - due for a, b, due in zip(starts, r.sent_ts, nominal, strict=False) if due > 0]
    return sorted(late)[len(late) // 2]


def lag_bound_ms(requests, interval_ms: float, hold_ms: float = 0.0) -> float:
    """A median schedule lag the runner's overhead explains: 5 ms on an idle machine, twice the
    server's median sleep lateness in the same run on a loaded one (both are one loop's timers)."""
    return max(5.0, 2 * sleep_lateness_ms(requests, interval_ms, hold_ms))


def max_overlap(requests) -> int:
    edges = sorted([(r.received_ts, 1) for r in requests] + [(r.sent_ts[-1], -1) for r in requests])
    return max(itertools.accumulate(step for _, step in edges))


HOLD_MS = 20.0  # the first chunk's hold: twice the mean gap between arrivals at 100 req/s


def test_open_loop_follows_the_seeded_schedule_and_excludes_warmup():
    arrivals = GammaArrivals(rate=100.0, seed=7)
    plan = runner.RunPlan("completions", "m", arrivals=arrivals, requests=40, warmup=3)
    run, seen = run_plan(plan, streaming(hold_ms=HOLD_MS))
    assert len(seen) == 43 and len(run.results) == 40 and len(run.warmup_results) == 3
    expected = [int(o * 1e9) for o in itertools.islice(arrivals.offsets_s(), 40)]
    assert [r.intended_ts - run.start_ts for r in run.results] == expected
    assert all(r.ok and r.sent_ts >= r.intended_ts for r in run.results)
    # a runner that waits for replies queues behind the 20 ms hold (due every 10 ms: ~400 ms at the
    # median), one that sleeps relative to its last send drifts by every late wake-up
    assert sorted(r.schedule_lag_ms for r in run.results)[20] < lag_bound_ms(seen, 2.0, HOLD_MS)
    assert run.duration_s >= expected[-1] / 1e9


def test_duration_bounds_the_arrivals():
    arrivals = GammaArrivals(rate=60.0, seed=1)
    run, _ = run_plan(runner.RunPlan("completions", "m", arrivals=arrivals, duration_s=0.3), streaming())
    due = [o for o in itertools.islice(arrivals.offsets_s(), 100) if o < 0.3]
    assert len(run.results) == len(due) > 5


def test_capped_open_loop_shows_queueing_as_schedule_lag():
    """20 requests due 10 ms apart, each held 50 ms by the server, at most 1 in flight: request i
    is sent about i × 40 ms late. A harness timing from the actual send would hide all of it."""
    plan = runner.RunPlan(
        "completions", "m", arrivals=GammaArrivals(100.0, burstiness=1000.0), concurrency=1, requests=20
    )
    run, seen = run_plan(plan, streaming(chunks=1, hold_ms=50.0))
    assert max_overlap(seen) == 1
    lags = [r.schedule_lag_ms for r in run.results]
    assert lags[-1] >= 19 * 40 * 0.8 and all(b > a for a, b in itertools.pairwise(lags))
    s = metrics.summarize(run.results, run.duration_s, (50,))
    # a quarter: ~50 of ~810 ms here, and a loaded machine's late sleeps lengthen both sides alike
    assert s["latency_ms"]["ttft"]["max"] < 0.25 * s["latency_ms"]["ttft_from_intended"]["max"]


def test_closed_loop_keeps_c_in_flight():
    plan = runner.RunPlan("completions", "m", concurrency=4, requests=24)
    run, seen = run_plan(plan, streaming(chunks=3, interval_ms=10.0))
    assert len(run.results) == 24 and max_overlap(seen) == 4
    assert all(r.ok and r.schedule_lag_ms >= 0 for r in run.results)
    assert sorted(r.schedule_lag_ms for r in run.results)[12] < lag_bound_ms(seen, 10.0)  # the runner's overhead


def test_unreachable_server_fails_every_request_without_crashing():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{s.getsockname()[1]}"
        plan = runner.RunPlan("chat", "m", arrivals=GammaArrivals(float("inf")), requests=5)
        run, _ = run_plan(plan, streaming(), url=url)
    s = metrics.summarize(run.results, run.duration_s, (50, 99))
    assert s["requests"]["errors"] == {"connection_error": 5} and s["requests"]["error_rate"] == 1.0
    assert s["failure_adjusted_ms"]["e2e"] == {"p50": float("inf"), "p99": float("inf")}


def serial_server(service_ms: float, served_ms: list[float]):
    """One request served at a time, `service_ms` each as scheduled: capacity 1000 / service_ms
    requests/s, less as the loaded machine's sleeps end late. Each actual service time goes to `served_ms`."""
    lock = asyncio.Lock()

    async def handler(request):
        async with lock:
            start_ts = perf_counter_ts()
            await asyncio.sleep(service_ms / 1e3)
            served_ms.append((perf_counter_ts() - start_ts) / 1e6)
        return Reply(steps=[Step(0, completion_chunk("x", finish="stop") + DONE_EVENT)])

    return handler


def stalled(probe, slo_ms: float) -> bool:
    """This process stood still for half the TTFT SLO or more during the probe (the machine's load,
    not the server): a request went out that late, and the ones queued behind it missed the SLO.
    Loaded (load 10 on 2 cores) a passing probe's latest send was 12–50 ms late."""
    return probe.summary["latency_ms"]["schedule_lag"]["max"] >= slo_ms / 2


def test_sweep_finds_the_capacity_of_a_queueing_server():
    """Scheduled capacity 50 req/s; measured, 1000 / the mean service time of this run (a loaded
    machine's late sleeps lower it). A sweep finds less only by failing a probe, which a stall of the
    shared machine can do at any rate (client and server run in this process): the lower bound, 0.64 of
    the measured capacity, stands unless a probe that failed at ≤ 0.8 of it shows such a stall."""
    served_ms: list[float] = []

    async def main():
        async with ScriptedServer(serial_server(20.0, served_ms)) as server:
            opts = session.BenchOptions(
                url=server.url,
                model="m",
                rate=20.0,
                burstiness=50.0,
                duration_s=1.0,
                slo=["ttft:100"],
                input_len="4",
                output_len="1",
            )
            return await session.capacity(opts, 0.9, 200.0, tracer_provider=TracerProvider(), rel_tol=0.1)

    found = asyncio.run(main())
    measured = 1e3 * len(served_ms) / sum(served_ms)  # requests/s
    probes = [(p.rate, p.attainment, p.summary["latency_ms"]["schedule_lag"]["max"]) for p in found.probes]
    assert found.bounded and found.capacity <= 55, (measured, probes)  # sleeps never end early
    assert found.capacity >= 0.64 * measured or any(
        not p.passed and p.rate <= 0.8 * measured and stalled(p, 100.0) for p in found.probes
    ), (measured, probes)
    assert all(p.passed == (p.attainment >= 0.9) for p in found.probes)
    assert all(not p.passed for p in found.probes if p.rate > 60), (measured, probes)


@pytest.fixture(scope="module")
def server_url():
    proc = subprocess.Popen(
        [sys.executable, "-m", "phaselens.loadgen.scripted_server", "--interval-ms", "2"],
        stdout=subprocess.PIPE,
        text=True,
        cwd=ROOT,
    )
    try:
        line = proc.stdout.readline().split()
        assert line[:2] == ["READY", "scripted-server"]
        yield line[2]
    finally:
        proc.terminate()
        proc.wait(timeout=10)


@pytest.fixture()
def no_export(monkeypatch):
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "none")
    monkeypatch.setenv("OTEL_METRICS_EXPORTER", "none")


def test_bench_command_writes_summary_json_and_per_request(server_url, no_export, tmp_path, capsys):
    out, per = tmp_path / "run.json", tmp_path / "req.jsonl"
    rc = cli_main(
        [
            "bench",
            "--url",
            server_url,
            "--model",
            "tiny",
            "--rate",
            "50",
            "--burstiness",
            "0.5",
            "--requests",
            "12",
            "--warmup",
            "2",
            "--output-len",
            "uniform:2:6",
            "--goodput",
            "ttft:500",
            "tpot:100",
            "--percentiles",
            "50,99",
            "--seed",
            "5",
            "--json",
            str(out),
            "--per-request",
            str(per),
            "--quiet",
        ]
    )
    assert rc == 0
    printed = capsys.readouterr().out
    assert "TTFT (ms)" in printed and "SLO attainment" in printed and "12 / 0" in printed
    doc = json.loads(out.read_text())
    assert doc["config"]["arrival"] == {
        "process": "gamma",
        "rate": 50.0,
        "burstiness": 0.5,
        "seed": 5,
        "max_concurrency": None,
    }
    assert doc["config"]["model"] == "tiny" and "opentelemetry-sdk" in doc["config"]["versions"]
    assert doc["summary"]["requests"]["completed"] == 12 and doc["summary"]["goodput"]["attainment"] > 0.5
    rows = [json.loads(line) for line in per.read_text().splitlines()]
    assert len(rows) == 12 and all(len(r["trace_id"]) == 32 and r["error_type"] is None for r in rows)
    assert all(r["output_tokens"] == r["counted_tokens"] == len(r["chunk_tokens"]) for r in rows)
    assert {r["output_tokens"] for r in rows} <= set(range(2, 7))


def test_bench_command_replays_a_trace_on_chat(server_url, no_export, tmp_path, capsys):
    trace = tmp_path / "trace.jsonl"
    trace.write_text(
        "".join(json.dumps({"timestamp": t, "output_len": n}) + "\n" for t, n in ((0, 2), (0.1, 3), (0.15, 1)))
    )
    out = tmp_path / "run.json"
    rc = cli_main(
        [
            "bench",
            "--url",
            server_url + "/v1",
            "--model",
            "tiny",
            "--endpoint",
            "chat",
            "--trace",
            str(trace),
            "--json",
            str(out),
            "--quiet",
        ]
    )
    summary = json.loads(out.read_text())["summary"]
    assert rc == 0 and summary["requests"]["completed"] == 3 and summary["tokens"]["output"] == 6
    assert json.loads(out.read_text())["config"]["arrival"]["process"] == "trace"


BENCH_ONLY = (
    "import argparse, sys\nfrom phaselens.commands import bench\n"
    "p = argparse.ArgumentParser(prog='phaselens')\nbench.register(p.add_subparsers())\n"
    "a = p.parse_args(sys.argv[1:])\nsys.exit(a.func(a))"
)


def test_bench_command_exports_client_spans_through_otel_setup(server_url):
    """In a process of its own: the SDK console exporter binds the real stdout when imported."""
    env = {**os.environ, "OTEL_TRACES_EXPORTER": "console", "OTEL_METRICS_EXPORTER": "none"}
    done = subprocess.run(
        [
            sys.executable,
            "-c",
            BENCH_ONLY,
            "bench",
            "--url",
            server_url,
            "--model",
            "tiny",
            "--requests",
            "3",
            "--output-len",
            "2",
            "--quiet",
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
        check=False,
    )
    printed = done.stdout
    assert done.returncode == 0, done.stderr
    assert printed.count('"name": "text_completion tiny"') == 3 and printed.count('"kind": "SpanKind.CLIENT"') == 3
    assert '"service.name": "phaselens-loadgen"' in printed and "exported 3, failed 0, dropped 0" in printed


def test_bench_sweep_command_prints_each_probe(server_url, no_export, capsys):
    rc = cli_main(
        [
            "bench",
            "sweep",
            "--url",
            server_url,
            "--model",
            "tiny",
            "--slo",
            "ttft:1000,e2el:2000",
            "--max-rate",
            "8",
            "--duration",
            "0.25",
            "--output-len",
            "2",
            "--quiet",
        ]
    )
    printed = capsys.readouterr().out
    assert rc == 0 and printed.count("probe rate") == 4 and "capacity: 8.000 req/s" in printed
    assert "at least" in printed


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--model", "m"], "--url and --model"),
        (["--url", "http://x", "--model", "m", "--rate", "2", "--concurrency", "3"], "not allowed with"),
        (["--url", "http://x", "--model", "m", "--burstiness", "2"], "needs --rate"),
        (["--url", "http://x", "--model", "m", "--rate", "-1"], "must be > 0"),
        (["--url", "http://x", "--model", "m", "--input-len", "zipf:2"], "length distribution"),
        (["--url", "http://x", "--model", "m", "--goodput", "ttft"], "bad SLO"),
        (["--url", "http://x", "--model", "m", "--percentiles", "50,100"], "comma list"),
        (["--url", "http://x", "--model", "m", "--requests", "0"], "must be > 0"),
        (["--url", "http://x", "--model", "m", "--dataset", "/nonexistent.jsonl"], "No such file"),
        (["--url", "http://x", "--model", "m", "--endpoint", "embeddings"], "invalid choice"),
        (["--url", "http://x", "--model", "m", "--rate", "inf", "--duration", "3"], "request count"),
        (["sweep", "--url", "http://x", "--model", "m"], "--slo"),
        (["sweep", "--url", "http://x", "--model", "m", "--slo", "ttft:9", "--concurrency", "2"], "varies --rate"),
    ],
)
def test_bad_flags_are_usage_errors(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli_main(["bench", *argv])
    assert exit_info.value.code == 2 and message in capsys.readouterr().err
