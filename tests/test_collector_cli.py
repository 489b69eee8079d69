"""`phaselens clickhouse` and `phaselens collector` as processes: READY line, SIGTERM, port taken."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import clickhouse_connect
import httpx

from phaselens.common.process import free_port

ROOT = Path(__file__).resolve().parent.parent
# Only the command under test is registered: phaselens.cli imports every command (some load torch).
_ONE_COMMAND = (
    "import argparse, importlib, sys; m = importlib.import_module('phaselens.commands.' + sys.argv[1]); "
    "p = argparse.ArgumentParser(prog='phaselens'); m.register(p.add_subparsers()); "
    "a = p.parse_args(sys.argv[1:]); sys.exit(a.func(a))"
)


def _start(*args: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-c", _ONE_COMMAND, *args], cwd=ROOT, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )


def _stop(proc: subprocess.Popen) -> int:
    proc.send_signal(signal.SIGTERM)
    try:
        return proc.wait(30)
    finally:
        proc.kill()


def test_clickhouse_command_ready_persistent_and_port_taken(tmp_path):
    http_port, tcp_port = free_port(), free_port()
    data = str(tmp_path / "data")
    proc = _start("clickhouse", "--data", data, "--http-port", str(http_port), "--tcp-port", str(tcp_port))
    try:
        assert proc.stdout.readline().strip() == f"READY clickhouse http://127.0.0.1:{http_port}"
        client = clickhouse_connect.get_client(host="127.0.0.1", port=http_port)
        client.command("CREATE TABLE default.kept (x UInt8) ENGINE = MergeTree ORDER BY x")
        client.close()
        taken = _start(
            "clickhouse",
            "--data",
            str(tmp_path / "other"),
            "--http-port",
            str(http_port),
            "--tcp-port",
            str(free_port()),
        )
        assert taken.wait(30) == 1 and f"{http_port}: the port is in use by pid " in taken.stderr.read()
    finally:
        assert _stop(proc) == 0
    # the data outlives the server; fresh ports, as the first two may have gone to another process's
    # connections since (they are ephemeral ports: a run on three workers lost one so)
    http_port = free_port()
    proc = _start("clickhouse", "--data", data, "--http-port", str(http_port), "--tcp-port", str(free_port()))
    try:
        line = proc.stdout.readline()
        assert line.startswith("READY clickhouse"), line or proc.communicate(timeout=30)[1]  # why it exited
        client = clickhouse_connect.get_client(host="127.0.0.1", port=http_port)
        assert client.command("EXISTS TABLE default.kept") == 1
        client.close()
    finally:
        assert _stop(proc) == 0


def test_collector_command_ready_health_and_clean_exit(clickhouse, tmp_path):
    proc = _start(
        "collector",
        "--clickhouse",
        clickhouse.url,
        "--grpc-port",
        "0",
        "--http-port",
        "0",
        "--spool",
        str(tmp_path / "spool"),
    )
    try:
        line = proc.stdout.readline().strip()
        assert line.startswith("READY collector grpc=127.0.0.1:") and " http=http://127.0.0.1:" in line
        http = line.split("http=")[1]
        assert httpx.get(f"{http}/health").json() == {"status": "ok"}
        refused = _start(
            "collector", "--clickhouse", clickhouse.url, "--host", "0.0.0.0", "--grpc-port", "0", "--http-port", "0"
        )
        assert refused.wait(30) == 1 and "needs --auth-token" in refused.stderr.read()
    finally:
        assert _stop(proc) == 0
