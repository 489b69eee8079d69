"""`phaselens demo` end to end (real ClickHouse, collector, reference server, load generator), and
the orchestration's promise that no child outlives it, even when it is SIGKILLed."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import textwrap
import time

import clickhouse_connect

from phaselens.faults.parts import wait_until
from phaselens.storage.embedded import EmbeddedClickHouse
from tests.process_fixtures import ROOT, alive, cmdlines_with, run_watched, track
from tests.report_fixtures import colour_stats, console_messages, decode_png, run_chromium


def test_demo_end_to_end(tmp_path):
    data, report = tmp_path / "data", tmp_path / "report.html"
    code, out, seen = run_watched(
        [sys.executable, "-m", "phaselens", "demo", "--requests", "30", "--data", str(data), "--report", str(report)],
        timeout_s=240,  # a stop for a hung demo, far from a loaded machine's run, within pytest's 300 s
    )
    assert code == 0, out[-4000:]
    assert "TTFT budget (30 requests, 30 with a client view, 0 errors" in out, out[-4000:]
    assert "goodput:" in out and "30/30 requests queryable with client and server views" in out
    html = report.read_text()
    assert html.count("<svg") >= 8 and "Slowest request" in html
    shot = tmp_path / "report.png"
    browser = run_chromium(report, tmp_path, f"--screenshot={shot}", "--window-size=1280,2400")
    assert console_messages(browser.stderr) == [] and colour_stats(decode_png(shot.read_bytes())[2])[0] > 200

    # nothing left behind: ClickHouse, collector, server, bench all gone
    assert len(seen) >= 4, seen
    # a grandchild ends on its dead parent's SIGTERM, on its own time: seconds under load
    wait_until(lambda: not any(alive(pid, start) for pid, start in seen.items()), 10)
    assert [pid for pid, start in seen.items() if alive(pid, start)] == []
    assert cmdlines_with(str(data)) == []

    # the data persists: every request of the run has both views in otel.phaselens_requests
    trace_ids = [json.loads(line)["trace_id"] for line in (data / "run" / "requests.jsonl").read_text().splitlines()]
    assert len(trace_ids) == 30
    with EmbeddedClickHouse(str(data / "clickhouse")) as ch:
        client = clickhouse_connect.get_client(host=ch.host, port=ch.http_port)
        rows = client.query(
            "SELECT trace_id, client_ttft_ms, server_ttft_ms, prefill_ms, residual_ms "
            "FROM otel.phaselens_requests WHERE trace_id IN {ids:Array(String)}",
            parameters={"ids": trace_ids},
        ).result_rows
        client.close()
    assert sorted(r[0] for r in rows) == sorted(trace_ids)
    for _, client_ttft, server_ttft, prefill, residual in rows:
        # the residual is what no stamp explains: on loopback microseconds (the kernel receive stamps'
        # move onto the monotonic clocks costs about one)
        assert client_ttft > server_ttft > prefill > 0 and residual > -0.1


_ORCHESTRATOR = textwrap.dedent("""
    import sys
    import time
    from pathlib import Path

    from phaselens.stack import project_env, spawn

    data, http_port, tcp_port = sys.argv[1:4]
    child = spawn("clickhouse", ["clickhouse", "--data", data, "--http-port", http_port, "--tcp-port", tcp_port],
                  Path(data).parent, project_env())
    child.wait_ready(120)
    print("up", flush=True)
    time.sleep(600)
""")


def test_children_die_with_a_sigkilled_orchestrator(tmp_path):
    """PR_SET_PDEATHSIG: the child (and through it the ClickHouse server process) stops."""
    data = tmp_path / "ch"
    proc = subprocess.Popen(
        [sys.executable, "-c", _ORCHESTRATOR, str(data), "0", "0"],  # ports picked as the server starts
        cwd=ROOT,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout.readline().strip() == "up"
        seen: dict[int, int] = {}
        track(proc.pid, seen)
        track(proc.pid, seen)  # second pass: grandchildren
        assert len(seen) >= 2 and cmdlines_with(str(data))
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and any(alive(p, s) for p, s in seen.items()):
            time.sleep(0.1)
        assert [p for p, s in seen.items() if alive(p, s)] == [], cmdlines_with(str(data))
    finally:
        proc.kill()


def test_demo_rejects_bad_options_before_starting_anything(capsys):
    from phaselens import cli

    for argv, message in (
        (["--rate", "0"], "--rate must be a positive number"),
        (["--requests", "0"], "--requests must be ≥ 1"),
        (["--shards", "0"], "--shards must be ≥ 1"),
        (["--slo", "p99:5"], "--slo: bad SLO 'p99:5': use ttft:MS, tpot:MS"),
        (["--server", "dynamo", "--shards", "2"], "--server dynamo runs on one ClickHouse node"),
        (["--server", "dynamo", "--report", "r.html"], "--server dynamo runs on one ClickHouse node"),
        (["--server", "vllm-native", "--disagg"], "--disagg runs the reference server, vLLM with the plugin"),
    ):
        assert cli.main(["demo", *argv]) == 2
        assert message in capsys.readouterr().err
