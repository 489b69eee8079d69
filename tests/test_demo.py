"""`phaselens demo` end to end (real ClickHouse, collector, reference server, load generator), and
the orchestration's promise that no child outlives it, even when it is SIGKILLed."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import clickhouse_connect

from phaselens.common.process import free_port
from phaselens.storage.embedded import EmbeddedClickHouse
from tests.report_fixtures import colour_stats, console_messages, decode_png, run_chromium

ROOT = Path(__file__).resolve().parent.parent


def _stat(pid: int) -> tuple[int, str, int] | None:
    """(ppid, state, start time in ticks) from /proc, or None when the process is gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text[text.rindex(")") + 2:].split()
    return int(fields[1]), fields[0], int(fields[19])


def _all_pids() -> list[int]:
    return [int(p) for p in os.listdir("/proc") if p.isdigit()]


def _track(root: int, seen: dict[int, int]) -> None:
    """Add every live descendant of `root` to `seen` (pid → start time)."""
    family = {root} | set(seen)
    for pid in _all_pids():
        st = _stat(pid)
        if st and st[0] in family and pid not in seen:
            seen[pid] = st[2]


def _alive(pid: int, start: int) -> bool:
    st = _stat(pid)
    return st is not None and st[2] == start and st[1] != "Z"  # a zombie is dead, only not reaped


def _cmdlines_with(text: str) -> list[str]:
    out = []
    for pid in _all_pids():
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if text in cmd:
            out.append(f"{pid}: {cmd}")
    return out


def _run_watched(argv: list[str], timeout_s: float) -> tuple[int, str, dict[int, int]]:
    """Run, recording every descendant while it runs; (exit code, output, descendants)."""
    proc = subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    chunks: list[str] = []
    reader = threading.Thread(target=lambda: chunks.append(proc.stdout.read()), daemon=True)
    reader.start()
    seen: dict[int, int] = {}
    deadline = time.monotonic() + timeout_s
    while proc.poll() is None and time.monotonic() < deadline:
        _track(proc.pid, seen)
        time.sleep(0.2)
    if proc.poll() is None:
        proc.kill()
    proc.wait()
    reader.join(10)
    return proc.returncode, "".join(chunks), seen


def test_demo_end_to_end(tmp_path):
    data, report = tmp_path / "data", tmp_path / "report.html"
    code, out, seen = _run_watched([sys.executable, "-m", "phaselens", "demo", "--requests", "30",
                                    "--data", str(data), "--report", str(report)], timeout_s=115)
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
    time.sleep(0.5)
    assert [pid for pid, start in seen.items() if _alive(pid, start)] == []
    assert _cmdlines_with(str(data)) == []

    # the data persists: every request of the run has both views in otel.phaselens_requests
    trace_ids = [json.loads(line)["trace_id"] for line in (data / "run" / "requests.jsonl").read_text().splitlines()]
    assert len(trace_ids) == 30
    with EmbeddedClickHouse(str(data / "clickhouse")) as ch:
        client = clickhouse_connect.get_client(host=ch.host, port=ch.http_port)
        rows = client.query("SELECT trace_id, client_ttft_ms, server_ttft_ms, prefill_ms, residual_ms "
                            "FROM otel.phaselens_requests WHERE trace_id IN {ids:Array(String)}",
                            parameters={"ids": trace_ids}).result_rows
        client.close()
    assert sorted(r[0] for r in rows) == sorted(trace_ids)
    for _, client_ttft, server_ttft, prefill, residual in rows:
        assert client_ttft > server_ttft > prefill > 0 and residual > 0


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
    proc = subprocess.Popen([sys.executable, "-c", _ORCHESTRATOR, str(data), str(free_port()), str(free_port())],
                            cwd=ROOT, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "up"
        seen: dict[int, int] = {}
        _track(proc.pid, seen)
        _track(proc.pid, seen)  # second pass: grandchildren
        assert len(seen) >= 2 and _cmdlines_with(str(data))
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and any(_alive(p, s) for p, s in seen.items()):
            time.sleep(0.1)
        assert [p for p, s in seen.items() if _alive(p, s)] == [], _cmdlines_with(str(data))
    finally:
        proc.kill()


def test_demo_rejects_bad_options_before_starting_anything(capsys):
    from phaselens import cli

    for argv, message in ((["--rate", "0"], "--rate must be a positive number"),
                          (["--requests", "0"], "--requests must be ≥ 1"),
                          (["--slo", "p99:5"], "--slo: bad SLO 'p99:5': use ttft:MS, tpot:MS")):
        assert cli.main(["demo", *argv]) == 2
        assert message in capsys.readouterr().err
