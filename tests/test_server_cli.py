"""`phaselens serve` as a process: READY line, real requests, clean exit 0 on SIGTERM."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys

import httpx
import pytest

from phaselens.common.exposure import authorized, check_exposure
from phaselens.reference_server.engine.config import EngineConfig


def _serve(*args: str) -> tuple[subprocess.Popen, str]:
    env = {**os.environ, "OTEL_TRACES_EXPORTER": "none", "OTEL_METRICS_EXPORTER": "none"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "phaselens", "serve", "--port", "0", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    line = proc.stdout.readline()
    if not line.startswith("READY server http://127.0.0.1:"):
        proc.kill()
        raise AssertionError((line, proc.stderr.read()))
    return proc, line.split()[-1]


def _complete(url: str, model: str) -> httpx.Response:
    body = {"model": model, "prompt": "hi", "max_tokens": 3, "ignore_eos": True}
    return httpx.post(f"{url}/v1/completions", json=body, timeout=30)


@pytest.fixture(scope="module")
def model_folder(tmp_path_factory) -> str:
    from phaselens.reference_server.engine.model_loader import build_tiny

    folder = tmp_path_factory.mktemp("models") / "tiny-llama"
    tiny = build_tiny()
    tiny.model.save_pretrained(folder)
    tiny.tokenizer.save_pretrained(folder)
    return str(folder)


@pytest.mark.parametrize("served", [(), ("team/llama-x", "llama")])
def test_serve_answers_to_the_model_names_vllm_would_and_exits_cleanly_on_sigterm(model_folder, served):
    """READY, then the names. Default: `--model` exactly as given (a path, as harnesses send it back)
    and its base name; with `--served-model-name`, those names only. /v1/models lists the served
    names. The engine's flags are taken, and SIGTERM ends the process with exit 0."""
    flags = ("--served-model-name", *served) if served else ()
    engine = ("--max-num-seqs", "8", "--kv-cache-tokens", "2048", "--policy", "prefill-first")
    proc, url = _serve("--model", model_folder, *flags, *engine)
    try:
        listed = [card["id"] for card in httpx.get(f"{url}/v1/models", timeout=10).json()["data"]]
        assert listed == (list(served) or [model_folder])
        accepted = list(served) or [model_folder, "tiny-llama"]
        for name in accepted:
            reply = _complete(url, name)
            assert reply.status_code == 200 and reply.json()["model"] == name, reply.text
            assert reply.json()["usage"]["completion_tokens"] == 3
        for name in {"tiny", "tiny-llama", model_folder} - set(accepted):
            reply = _complete(url, name)
            assert reply.status_code == 400 and reply.json()["error"]["code"] == "model_not_found"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.parametrize(
    "host,token,insecure,ok",
    [
        ("127.0.0.1", None, False, True),
        ("::1", None, False, True),
        ("localhost", None, False, True),
        ("0.0.0.0", None, False, False),
        ("0.0.0.0", "t", False, True),
        ("10.1.2.3", None, True, True),
    ],
)
def test_non_loopback_host_needs_a_token(host, token, insecure, ok):
    if ok:
        check_exposure(host, token, insecure)
    else:
        with pytest.raises(ValueError, match="auth-token"):
            check_exposure(host, token, insecure)


def test_bearer_token_check_shared_by_server_and_collector():
    assert authorized(None, None) and authorized("Bearer x", None)
    assert authorized("Bearer s3cret", "s3cret")
    assert not any(authorized(h, "s3cret") for h in (None, "", "Bearer s3cre", "bearer s3cret", "s3cret"))


def test_bad_engine_flags_are_refused():
    with pytest.raises(ValueError, match="policy"):
        EngineConfig(policy="fifo").validate()
    with pytest.raises(ValueError, match="max_num_seqs"):
        EngineConfig(max_num_seqs=0).validate()


def test_accepted_connections_have_tcp_nodelay():
    """asyncio sets TCP_NODELAY only on sockets whose proto says TCP; without it a streamed
    response's first chunk after a keep-alive request waited ~40 ms for the client's delayed ACK."""
    from phaselens.reference_server.serve import bind

    async def accepted_nodelay() -> int:
        seen = asyncio.get_running_loop().create_future()

        async def on_connect(reader, writer):
            seen.set_result(writer.get_extra_info("socket").getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
            writer.close()

        server = await asyncio.start_server(on_connect, sock=bind("127.0.0.1", 0))
        _, writer = await asyncio.open_connection(*server.sockets[0].getsockname()[:2])
        value = await asyncio.wait_for(seen, 10)
        writer.close()
        server.close()
        return value

    assert asyncio.run(accepted_nodelay()) == 1
