"""The live P/D tests' skewed wall clocks (libfaketime): the sleep shim their instances preload, and
the check that each instance really ran on its own clock (what a budget built from wall stamps would
subtract, and ours never does)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest


def sleep_shim(folder: Path) -> Path:
    """tests/faketime_sleep_shim.c built into `folder`, for the instances to preload beside libfaketime."""
    shim = folder / "faketime_sleep_shim.so"
    source = Path(__file__).with_name("faketime_sleep_shim.c")
    subprocess.run(["cc", "-shared", "-fPIC", "-O2", "-o", str(shim), str(source), "-ldl"], check=True)
    return shim


_STARTS = (
    "SELECT ResourceAttributes['phaselens.pd.role'] AS role, min(toUnixTimestamp64Nano(Timestamp)) AS t "
    "FROM {database}.otel_traces WHERE TraceId = {{t:String}} GROUP BY role"
)


def assert_instances_skewed(stack, trace_id: str, skew_s: float) -> None:
    """The trace's prefill spans start ~`skew_s` before the router's, its decode spans ~`skew_s` after."""
    with stack.client() as ch:
        starts = dict(ch.query(_STARTS.format(database=stack.database), parameters={"t": trace_id}).result_rows)
    assert (starts["prefill"] - starts["router"]) / 1e9 == pytest.approx(-skew_s, abs=60)
    assert (starts["decode"] - starts["router"]) / 1e9 == pytest.approx(skew_s, abs=60)
