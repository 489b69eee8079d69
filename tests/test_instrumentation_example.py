"""The "instrument your own serving loop" example (docs/instrument-your-loop.md) runs as written and
exports every phase span."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from phaselens.instrumentation import names

ROOT = Path(__file__).resolve().parents[1]
# The example is read from the page itself, so the documentation cannot drift from what runs.
EXAMPLE = re.search(
    r"## The example.*?```python\n(.*?)```", (ROOT / "docs" / "instrument-your-loop.md").read_text(), re.DOTALL
).group(1)


def test_example_runs_and_exports_the_phase_spans():
    env = {
        **os.environ,
        "OTEL_TRACES_EXPORTER": "console",
        "OTEL_METRICS_EXPORTER": "none",
        "OTEL_BSP_SCHEDULE_DELAY": "10",
    }
    done = subprocess.run(
        [sys.executable, "-c", EXAMPLE], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 0, done.stderr
    assert len([line for line in EXAMPLE.splitlines() if line.strip()]) < 25
    for name in (*names.PHASE_SPANS, names.SPAN_ENGINE_STEP, "text_completion my-model"):
        assert f'"name": "{name}"' in done.stdout, name
