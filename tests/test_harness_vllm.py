"""`phaselens import aiperf` against the session's shared vLLMs (tests/vllm_fixtures.py): AIPerf's
requests joined to vLLM's own spans and to the plugin's. Apart from tests/test_harness_import.py
(the reference server's stack) so that only this module shares the vLLMs' unit of work
(tests/conftest.py's `SHARED_UNITS`) and the rest runs on either worker."""

from __future__ import annotations

import pytest

from phaselens.commands import harness_import
from tests.aiperf_live import aiperf, profile, settled_facts
from tests.cli_fixtures import run_command
from tests.vllm_fixtures import VLLM_PYTHON


@pytest.mark.skipif(
    aiperf() is None or VLLM_PYTHON is None,
    reason="needs AIPerf (./setup.sh --aiperf) and vLLM (./setup.sh --vllm)",
)
@pytest.mark.timeout(600)  # the first of them may start both shared vLLMs
@pytest.mark.parametrize("server", ["native", "plugin"])
def test_live_aiperf_run_against_vllm_joins_every_request(vllm_servers, tmp_path, capsys, server):
    """A real vLLM 0.32 (CPU) on the tiny model: with its own `llm_request` spans, the header reaches
    the view only through vLLM's request id (`chatcmpl-{X-Request-Id}`); with the phaselens plugin
    (service `vllm`), likewise. Every AIPerf request is joined and its residual ≥ 0. The session's
    shared vLLMs (tests/vllm_fixtures.py), each with a database of its own."""
    requests = 6
    served = vllm_servers[server]
    artifacts = tmp_path / "artifacts"
    ids = profile(served, served.model_dir, artifacts, requests)
    argv = ["import", "aiperf", str(artifacts), "--clickhouse", served.clickhouse_url, "--database", served.database]
    assert run_command(harness_import.register, *argv) == 0
    assert f"imported {requests} client spans, 0 already stored" in capsys.readouterr().out
    rows = settled_facts(served, ids)
    assert sorted(rows) == sorted(ids)
    if server == "native":
        assert {r["span_model"] for r in rows.values()} == {"vllm-native"}
    assert all(r["residual_ms"] >= 0 and r["client_harness"] == "aiperf" for r in rows.values()), rows
