"""reference_server.engine.model_loader with a local Hugging Face folder: loaded offline, without asking the
hub anything, and without changing the environment the process's later children inherit."""

from __future__ import annotations

import http.server
import os
import subprocess
import sys
import textwrap
import threading

import pytest

from phaselens.integrations.vllm.tiny_model import save_tiny_llama
from phaselens.reference_server.engine.model_loader import load, load_tokenizer

# Loads the folder (the hub pointed at the test's counting server); prints the names it loaded.
_LOAD = textwrap.dedent(
    """
    import sys
    from phaselens.reference_server.engine.model_loader import load, load_tokenizer
    loaded = load(sys.argv[1], "float32", "cpu")
    _, _, name = load_tokenizer(sys.argv[1])
    print(name, loaded.name)
    """
)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return save_tiny_llama(tmp_path_factory.mktemp("model") / "tiny-llama")


def test_loading_a_folder_leaves_the_environment_as_it_was(folder, monkeypatch):
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    before = dict(os.environ)
    loaded = load(str(folder), "float32", "cpu")
    tokenizer, add_special_tokens, name = load_tokenizer(str(folder))
    assert dict(os.environ) == before
    assert loaded.name == name == "tiny-llama" and add_special_tokens
    assert loaded.eos_ids == {tokenizer.eos_token_id}


def test_a_folder_loads_without_a_single_hub_request(folder):
    """HF_ENDPOINT names a loopback server that counts what reaches it; huggingface_hub reads it at
    import, hence a child process."""
    requests: list[str] = []

    class Hub(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            requests.append(self.path)
            self.send_error(404)

        do_HEAD = do_GET

        def log_message(self, *args):
            pass

    hub = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Hub)
    threading.Thread(target=hub.serve_forever, daemon=True).start()
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")}
    env["HF_ENDPOINT"] = f"http://127.0.0.1:{hub.server_address[1]}"
    try:
        done = subprocess.run(
            [sys.executable, "-c", _LOAD, str(folder)],
            check=False,
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
    finally:
        hub.shutdown()
        hub.server_close()
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["tiny-llama", "tiny-llama"]
    assert requests == []
