"""The README's "instrument your own loop" example runs as written and exports every phase span."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from instrumentation import names

EXAMPLE = '''
import time
from instrumentation.server import ServerTelemetry

telemetry = ServerTelemetry.from_env("my-llm-server")   # OTEL_* env: exporter, endpoint, sampler
# app = telemetry.asgi(app)   # behind an ASGI app: received/responded stamps + incoming traceparent

def serve(scope, prompt_ids, max_tokens, forward):      # your loop (one request, for brevity)
    req = telemetry.request(scope)                      # stamps `received` (or the middleware did)
    req.describe(operation="text_completion", model="my-model", input_tokens=len(prompt_ids), max_tokens=max_tokens)
    req.enqueued(); req.scheduled()                     # handed to the engine; picked by the scheduler
    t0 = time.monotonic_ns(); token = forward(prompt_ids)
    req.prefill_chunk(t0, time.monotonic_ns(), len(prompt_ids), 0)
    req.first_token()                                   # after the sampled id is on the host
    for _ in range(max_tokens - 1):
        t0 = time.monotonic_ns(); token = forward([token]); req.token()
        telemetry.step_observer.step(t0, time.monotonic_ns(), 0, 1, 0, 0, 0, 0, [req])
    req.finished("length")
    req.complete(output_tokens=max_tokens, finish_reason="length")  # spans are built off the loop

serve({"type": "http", "method": "POST", "headers": []}, [1, 2, 3], 8, lambda ids: 0)
telemetry.shutdown()
'''


def test_readme_example_runs_and_exports_the_phase_spans():
    env = {**os.environ, "OTEL_TRACES_EXPORTER": "console", "OTEL_METRICS_EXPORTER": "none",
           "OTEL_BSP_SCHEDULE_DELAY": "10"}
    done = subprocess.run([sys.executable, "-c", EXAMPLE], cwd=Path(__file__).resolve().parents[1], env=env,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert len([line for line in EXAMPLE.splitlines() if line.strip()]) < 20
    for name in (*names.PHASE_SPANS, names.SPAN_ENGINE_STEP, "text_completion my-model"):
        assert f'"name": "{name}"' in done.stdout, name
