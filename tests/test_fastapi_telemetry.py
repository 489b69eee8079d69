"""One SERVER span per request, whatever FastAPI does: the installed FastAPI's own telemetry, and
opentelemetry-instrumentation-fastapi, beside the phaselens middleware (each case in a process of
its own: a global tracer provider can be set once per process)."""

from __future__ import annotations

import collections
import json
import subprocess
import sys

import pytest

REQUESTS = 4


def spans(mode: str) -> collections.Counter:
    done = subprocess.run(
        [sys.executable, "-m", "tests.fastapi_spans", mode, str(REQUESTS)],
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return collections.Counter((s["name"], s["kind"]) for s in map(json.loads, done.stdout.splitlines()))


def server_spans(counts: collections.Counter) -> dict[str, int]:
    return {name: n for (name, kind), n in counts.items() if kind == "SERVER"}


def test_installed_fastapi_traces_by_itself():
    """The premise: with a global provider, FastAPI alone gives its own SERVER and operation spans."""
    counts = spans("fastapi")
    assert server_spans(counts) == {"POST /v1/completions": REQUESTS, "GET /health": 1}
    assert counts[("fastapi.endpoint", "INTERNAL")] == REQUESTS + 1


@pytest.mark.parametrize("mode", ["ours", "contrib", "contrib-all", "reference"])
def test_one_server_span_per_request_and_it_is_ours(mode):
    counts = spans(mode)
    model = "tiny" if mode == "reference" else "user-model"
    # every request (the LLM ones and /health) has one SERVER span: the phaselens middleware's
    assert server_spans(counts) == {f"text_completion {model}": REQUESTS, "GET": 1}
    assert not any(name.startswith("fastapi.") for name, _ in counts)  # FastAPI's own layer skipped
    # the LLM route excluded, as docs/instrument-your-loop.md says: contrib is left to /health
    if mode == "contrib":
        assert not any(name.startswith("POST /v1/completions") for name, _ in counts)
        assert counts[("GET /health", "INTERNAL")] == 1
    if mode == "contrib-all":  # not excluded: contrib nests as INTERNAL, with a span per chunk sent
        assert counts[("POST /v1/completions", "INTERNAL")] == REQUESTS
        assert counts[("POST /v1/completions http send", "INTERNAL")] >= 4 * REQUESTS
    if mode == "reference":
        assert counts[("llm.first_chunk", "INTERNAL")] == REQUESTS
