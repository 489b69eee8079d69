"""The vLLM launcher's start when the port it picked is taken before vLLM binds it.

vLLM is replaced by a stand-in (tests/vllm_bind_standin.py): a real vLLM start takes ~45 s on two
cores; the stand-in binds its --port as vLLM does, before anything else, and fails the same way. The
launcher under test is the real one, its argv and log unchanged; only the python it runs differs.
"""

from __future__ import annotations

import socket
import sys
import urllib.request
from pathlib import Path

import pytest

from phaselens.common.process import BIND_ATTEMPTS, LOOPBACK, free_port
from phaselens.integrations.vllm import launcher
from phaselens.integrations.vllm.launcher import BIND_FAILED, PROTOCOL_GRPC, PROTOCOL_HTTP, TRACES_PROTOCOL, VllmServer
from tests.source_tree import ROOT


def _standin_python(tmp_path: Path) -> Path:
    """An executable that takes the launcher's `PYTHON -m phaselens.integrations.vllm.serve ARGS`
    and runs the stand-in with ARGS."""
    path = tmp_path / "python"
    path.write_text(f'#!/bin/sh\nshift 2\nexec "{sys.executable}" "{ROOT}/tests/vllm_bind_standin.py" "$@"\n')
    path.chmod(0o755)
    return path


def _held_port() -> socket.socket:
    """A socket bound to a loopback port, not listening (so nothing sees it in use before a bind)."""
    holder = socket.socket()
    holder.bind((LOOPBACK, 0))
    return holder


def test_a_picked_port_taken_before_vllm_binds_it_is_picked_again(tmp_path, monkeypatch):
    """The race made certain: the first port picked is already bound elsewhere. That run exits with
    vLLM's bind error; the start picks a fresh port and serves on it."""
    log = tmp_path / "vllm.log"
    with _held_port() as holder:
        taken = holder.getsockname()[1]
        picks = iter([taken])
        monkeypatch.setattr(launcher, "free_port", lambda: next(picks, 0) or free_port())
        server = VllmServer(_standin_python(tmp_path), tmp_path, log).start(timeout_s=30)
        try:
            assert server.port != taken
            with urllib.request.urlopen(f"{server.url}/health", timeout=5) as response:
                assert response.status == 200
            text = log.read_text()
            assert text.count(BIND_FAILED) == 1 and text.count("serving on") == 1
            assert BIND_FAILED not in server.run_output()  # the second run's part of the log
        finally:
            server.stop()


def test_a_port_given_by_the_caller_is_not_replaced(tmp_path):
    """A port the caller chose is theirs: its bind failure is reported, not retried elsewhere."""
    log = tmp_path / "vllm.log"
    with _held_port() as holder:
        taken = holder.getsockname()[1]
        with pytest.raises(RuntimeError, match=BIND_FAILED):
            VllmServer(_standin_python(tmp_path), tmp_path, log, port=taken).start(timeout_s=30)
    assert log.read_text().count(BIND_FAILED) == 1


def test_the_retries_are_bounded(tmp_path, monkeypatch):
    """Every pick taken: BIND_ATTEMPTS runs, then vLLM's bind error."""
    log = tmp_path / "vllm.log"
    with _held_port() as holder:
        monkeypatch.setattr(launcher, "free_port", lambda: holder.getsockname()[1])
        with pytest.raises(RuntimeError, match=BIND_FAILED):
            VllmServer(_standin_python(tmp_path), tmp_path, log).start(timeout_s=30)
    assert log.read_text().count(BIND_FAILED) == BIND_ATTEMPTS


def _env_python(tmp_path: Path) -> Path:
    """An executable standing in for vLLM's python that writes the environment it got and exits."""
    path = tmp_path / "python"
    path.write_text(f'#!/bin/sh\nenv > "{tmp_path}/env.txt"\n')
    path.chmod(0o755)
    return path


@pytest.mark.parametrize(
    ("plugin", "endpoint", "protocol"),
    [(True, "http://127.0.0.1:2/v1/traces", PROTOCOL_HTTP), (False, "http://127.0.0.1:1", PROTOCOL_GRPC)],
)
def test_the_plugin_exports_over_http_and_vllms_own_spans_over_grpc(tmp_path, plugin, endpoint, protocol):
    """`trace_export` points the plugin's span-builder child at the collector's OTLP/HTTP URL (the
    reference server's transport, no grpcio) and vLLM alone at its gRPC port; the launcher hands vLLM
    both the endpoint (--otlp-traces-endpoint) and the protocol its exporters read."""
    chosen, chosen_protocol = launcher.trace_export("http://127.0.0.1:1", "http://127.0.0.1:2/v1/traces", plugin)
    assert (chosen, chosen_protocol) == (endpoint, protocol)
    server = VllmServer(
        _env_python(tmp_path), tmp_path, tmp_path / "vllm.log", otlp_endpoint=chosen, otlp_protocol=chosen_protocol
    )
    server.spawn()
    assert server.proc is not None and server.proc.wait(timeout=30) == 0
    env = dict(line.split("=", 1) for line in (tmp_path / "env.txt").read_text().splitlines() if "=" in line)
    assert env[TRACES_PROTOCOL] == protocol
    assert server.argv()[server.argv().index("--otlp-traces-endpoint") + 1] == endpoint


def test_a_protocol_the_caller_sets_in_env_wins(tmp_path):
    """The caller's environment is applied last, as for every other variable."""
    server = VllmServer(_env_python(tmp_path), tmp_path, tmp_path / "vllm.log", env={TRACES_PROTOCOL: PROTOCOL_HTTP})
    server.spawn()
    assert server.proc is not None and server.proc.wait(timeout=30) == 0
    assert f"{TRACES_PROTOCOL}={PROTOCOL_HTTP}\n" in (tmp_path / "env.txt").read_text()
