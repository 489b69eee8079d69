"""The fault suite: every scenario in turn on one loopback pipeline, bounded in time.

`SHORT` is the CI form (tests/test_faults.py); `FULL` what the table of docs/faults.md comes from
(`benchmarks/faults.py`), with ClickHouse down for 30 s and the spool full for longer than the
OTel SDK's 10 s retry budget.
"""

from __future__ import annotations

import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from phaselens.faults import collector_faults, serving_faults
from phaselens.faults.outcome import Outcome
from phaselens.faults.params import Params

SHORT = Params(
    warm_s=1.0,
    after_s=0.5,
    outage_s=2.0,
    store_timeout_s=20.0,  # the longest recovery bound of tests/test_faults.py
    slow_s=2.0,
    full_s=3.0,
    spool_cap_bytes=256 << 10,
    builder_kills=2,
    capacity_s=1.5,
    overload_s=1.5,
    disconnects=3,
)
FULL = Params(
    warm_s=5.0,
    after_s=5.0,
    outage_s=30.0,
    slow_s=20.0,
    full_s=20.0,
    builder_kills=3,
    capacity_s=5.0,
    overload_s=10.0,
    disconnects=16,
)

PIPELINE_SCENARIOS = {
    "no_fault": collector_faults.no_fault,
    "collector_sigkill": collector_faults.collector_sigkill,
    "clickhouse_outage": collector_faults.clickhouse_outage,
    "clickhouse_slow": collector_faults.clickhouse_slow,
    "spool_full": collector_faults.spool_full,
    # the same two faults with Rotel in the collector's place (docs/collectors.md "Which collector")
    "rotel_sigkill": collector_faults.rotel_sigkill,
    "rotel_clickhouse_outage": collector_faults.rotel_clickhouse_outage,
}
SERVING_SCENARIOS = {  # one server for all three (serving_faults.Served), the kills last
    "client_disconnect": serving_faults.client_disconnect,
    "server_overload": serving_faults.server_overload,
    "span_builder_killed": serving_faults.span_builder_killed,
}
SCENARIOS = (*PIPELINE_SCENARIOS, *SERVING_SCENARIOS)


def run(
    params: Params,
    only: tuple[str, ...] = SCENARIOS,
    work_dir: str | None = None,
    on_outcome: Callable[[Outcome], None] = lambda outcome: None,
) -> list[Outcome]:
    """Runs the chosen scenarios (in SCENARIOS order); each outcome is also passed to `on_outcome`."""
    unknown = set(only) - set(SCENARIOS)
    if unknown:
        raise ValueError(f"unknown scenario(s) {sorted(unknown)}; known: {', '.join(SCENARIOS)}")
    root = Path(work_dir or tempfile.mkdtemp(prefix="phaselens-faults-"))
    pipeline = collector_faults.Pipeline(root, store_timeout_s=params.store_timeout_s).start()
    served, outcomes = None, []
    try:
        for name in (n for n in SCENARIOS if n in only):
            started = time.monotonic()
            if name in PIPELINE_SCENARIOS:
                outcome = PIPELINE_SCENARIOS[name](pipeline, params)
            else:
                served = served or serving_faults.Served.start(pipeline)
                outcome = SERVING_SCENARIOS[name](pipeline, served, params)
            outcome.detail["scenario_s"] = round(time.monotonic() - started, 1)
            outcomes.append(outcome)
            on_outcome(outcome)
    finally:
        if served is not None:
            served.stop()
        pipeline.stop()
    return outcomes
