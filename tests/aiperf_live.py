"""Helpers of the AIPerf import tests (tests/test_harness_import.py against the reference server,
tests/test_harness_vllm.py against the session's vLLMs): a stack's joined requests and a live
`aiperf profile` run. A stack is a `phaselens.stack.Stack` or a `tests.vllm_fixtures.ServedVllm`."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

from phaselens.analysis.harness.harness_formats import read_aiperf
from phaselens.analysis.harness.harness_import import lookup
from phaselens.stack import Stack
from tests.source_tree import ROOT
from tests.vllm_fixtures import ServedVllm


def wait_joinable(stack: Stack | ServedVllm, ids: list[str], timeout_s: float = 60) -> None:
    """Until every id names a stored server request (the spans travel through the collector)."""
    deadline = time.monotonic() + timeout_s
    with stack.client() as ch:
        while len(lookup(ch, stack.database, ids)) < len(ids):
            assert time.monotonic() < deadline, "server spans did not arrive"
            time.sleep(0.3)


def facts(stack: Stack | ServedVllm, ids: list[str]) -> dict[str, dict]:
    sql = (
        "SELECT x_request_id, client_harness, client_harness_version, client_ttft_ms, client_ttfo_ms, "
        "client_tpot_ms, client_e2e_ms, client_itl_p99_ms, residual_ms, has_server, span_model "
        f"FROM {stack.database}.phaselens_request_facts WHERE x_request_id IN {{ids:Array(String)}}"
    )
    with stack.client() as ch:
        return {r["x_request_id"]: r for r in ch.query(sql, parameters={"ids": ids}).named_results()}


def settled_facts(stack: Stack | ServedVllm, ids: list[str], timeout_s: float = 60) -> dict[str, dict]:
    """`facts` once every id has its row and its residual (the server's terms can land in a later
    export than the span that made the request joinable); as they are at the deadline otherwise."""
    deadline = time.monotonic() + timeout_s
    while True:
        rows = facts(stack, ids)
        settled = len(rows) == len(ids) and all(r["residual_ms"] is not None for r in rows.values())
        if settled or time.monotonic() > deadline:
            return rows
        time.sleep(0.3)


def aiperf() -> str | None:
    """The `aiperf` to run, when there is one (PHASELENS_AIPERF, or ./setup.sh --aiperf's .venv-aiperf)."""
    found = os.environ.get("PHASELENS_AIPERF") or str(ROOT / ".venv-aiperf" / "bin" / "aiperf")
    return found if Path(found).is_file() else None


def profile(stack: Stack | ServedVllm, tokenizer: Path, artifacts: Path, requests: int) -> list[str]:
    """`aiperf profile` against the stack's server (chat, streamed, 2 in flight, EOS ignored: a
    random tiny model's first token is EOS about once in 2,000 requests, and a request with no
    content has no TTFT, so no residual); the ids it sent, once every one names a stored server
    request."""
    argv = [aiperf(), "profile", "--model", "tiny", "--url", stack.server_url, "--endpoint-type", "chat"]
    argv += ["--streaming", "--tokenizer", str(tokenizer), "--request-count", str(requests)]
    argv += ["--concurrency", "2", "--synthetic-input-tokens-mean", "24", "--output-tokens-mean", "12"]
    argv += ["--extra-inputs", "ignore_eos:true", "--artifact-dir", str(artifacts), "--ui-type", "none"]
    done = subprocess.run(argv, check=False, capture_output=True, text=True, timeout=300)
    log = artifacts / "logs" / "aiperf.log"
    assert done.returncode == 0, (done.stderr or done.stdout)[-2000:] + (
        log.read_text()[-2000:] if log.exists() else ""
    )
    run = read_aiperf(artifacts)
    ids = [r.request_id for r in run.records]
    assert len(ids) == requests and not run.bad_lines
    wait_joinable(stack, ids, timeout_s=120)
    return ids
