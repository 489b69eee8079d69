"""Which vLLM the plugin knows, checked once at load (docs/vllm.md#supported-versions).

The plugin wraps four methods of vLLM's `OutputProcessor` and two of its `RequestOutputCollector` and reads `RequestStateStats`,
`IterationStats` and `SchedulerStats`, which vLLM states are not a stable interface. So it wraps
only a vLLM whose version lies in `SUPPORTED` (or in $PHASELENS_VLLM_SUPPORTED, for an operator who
accepts the risk of a newer release) and whose methods still take the parameters it was written
against; otherwise it logs one line and leaves vLLM untouched.
"""

from __future__ import annotations

import inspect
import os

from packaging.specifiers import SpecifierSet
from packaging.version import InvalidVersion, Version

SUPPORTED = ">=0.32.0,<0.33"
ENV_SUPPORTED = "PHASELENS_VLLM_SUPPORTED"
# method → the parameters (after self) it must take, in order
HOOKED_METHODS: dict[str, tuple[str, ...]] = {
    "process_outputs": ("engine_core_outputs", "engine_core_timestamp", "iteration_stats"),
    "do_tracing": ("engine_core_output", "req_state", "iteration_stats"),
    "update_scheduler_stats": ("scheduler_stats",),
    "add_request": ("request", "prompt", "parent_req", "request_index", "queue"),
}
COLLECTOR_METHODS = ("get", "get_nowait")  # RequestOutputCollector: the request's task takes output
STATS_FIELDS = ("arrival_time", "queued_ts", "scheduled_ts", "first_token_ts", "last_token_ts", "num_generation_tokens")


def supported_range() -> str:
    return os.environ.get(ENV_SUPPORTED, "").strip() or SUPPORTED


def version_problem(version: str, spec: str) -> str | None:
    """Why this vLLM version is not one the plugin knows, or None. A local suffix (`+cpu`) is ignored."""
    try:
        release = Version(version.split("+", 1)[0])
    except InvalidVersion:
        return f"vLLM version {version!r} is not a version number"
    if release not in SpecifierSet(spec):
        return f"vLLM {version} is outside the supported range {spec}"
    return None


def interface_problem(output_processor_cls: type, stats_cls: type, collector_cls: type) -> str | None:
    """Why vLLM's classes do not look as the plugin expects, or None."""
    missing_methods = [m for m in COLLECTOR_METHODS if not callable(getattr(collector_cls, m, None))]
    if missing_methods:
        return f"RequestOutputCollector lacks {missing_methods}"
    for name, params in HOOKED_METHODS.items():
        method = getattr(output_processor_cls, name, None)
        if method is None:
            return f"OutputProcessor.{name} is missing"
        got = tuple(inspect.signature(method).parameters)[1 : 1 + len(params)]
        if got != params:
            return f"OutputProcessor.{name} takes {got}, expected {params}"
    fields = getattr(stats_cls, "__dataclass_fields__", {})
    missing = [f for f in STATS_FIELDS if f not in fields]
    return f"RequestStateStats lacks {missing}" if missing else None
