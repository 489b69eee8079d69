"""Per-request timing of a vLLM KV connector's work, without vLLM (the glue is `kv_connector.py`).

The scheduler side names, per engine step, the requests whose KV the connector may save (new
requests it does not load) and those it loads (`StepRequests`); the worker side times the
connector's calls of that step (`StepTiming`) and turns them into records, one per request:

    [request id, "save" | "load", first call's start (ns), last call's end (ns), ns inside the calls, bytes | None]

(monotonic ns of this host: the worker, the EngineCore and the API server read one CLOCK_MONOTONIC).
The records ride vLLM's KV-connector stats (`KV_RECORDS` in their payload) from the worker through
the EngineCore to the API server, where the plugin's tracker hands them to the requests' handles.
A request's save (load) is the time the connector's save (load) calls took in the step that ran
its prefill: the step ran its requests' KV moves one after another and none of them had its first
token before the step ended. A step whose calls moved no byte (ExampleConnector: the prompt's KV
was stored already, or a local prefix-cache hit left nothing to load) makes no record. Bytes are
per request only when one request moved in the step (None otherwise, and where the connector does
not say).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

KV_RECORDS = "phaselens_kv"  # the key of the records in the connector stats' payload
INNER = "inner"  # the delegate connector's own stats payload, beside them
SAVE, LOAD = "save", "load"


@dataclass(slots=True)
class CallTimes:
    """The calls of one kind in one step: first start, last end, time inside them (monotonic ns)."""

    first_ts: int = 0
    last_ts: int = 0
    busy_ns: int = 0
    nbytes: int | None = None

    @contextmanager
    def timed(self) -> Iterator[None]:
        start = time.monotonic_ns()
        try:
            yield
        finally:
            end = time.monotonic_ns()
            self.first_ts = self.first_ts or start
            self.last_ts, self.busy_ns = end, self.busy_ns + end - start

    def add_bytes(self, nbytes: int) -> None:
        self.nbytes = (self.nbytes or 0) + nbytes


@dataclass(slots=True)
class StepTiming:
    """One engine step on the worker: which requests save and load (from the scheduler's metadata)
    and the connector's calls timed."""

    saves: tuple[str, ...] = ()
    loads: tuple[str, ...] = ()
    save: CallTimes = field(default_factory=CallTimes)
    load: CallTimes = field(default_factory=CallTimes)

    def records(self) -> list[list[Any]]:
        """The step's records (none for a kind whose calls did not run or had no request)."""
        out: list[list[Any]] = []
        for op, requests, calls in ((SAVE, self.saves, self.save), (LOAD, self.loads, self.load)):
            if not calls.first_ts or not requests or calls.nbytes == 0:  # nothing moved (e.g. already stored)
                continue
            nbytes = calls.nbytes if len(requests) == 1 else None
            out += [[req_id, op, calls.first_ts, calls.last_ts, calls.busy_ns, nbytes] for req_id in requests]
        return out


def step_requests(new_request_ids: list[str], loading: set[str]) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(saves, loads) of a step: its new requests, split by whether the connector loads their KV."""
    loads = tuple(r for r in new_request_ids if r in loading)
    return tuple(r for r in new_request_ids if r not in loading), loads


def merged(records: list[list[Any]], inner: dict[str, Any] | None) -> dict[str, Any]:
    """The stats payload: our records and the delegate's own payload."""
    return {KV_RECORDS: records, INNER: inner}


def records_of(payload: Any) -> list[list[Any]]:
    """The records in a SchedulerStats' `kv_connector_stats` payload (none when another connector's)."""
    return list(payload.get(KV_RECORDS) or ()) if isinstance(payload, dict) else []


def example_connector_bytes(metadata: Any, kv_layer: Any, store: bool) -> int | None:
    """Bytes one layer's save (`store`) or load moves for vLLM's ExampleConnector, whose metadata
    lists `requests` with `is_store` and `slot_mapping` (one slot per token) and whose layer tensor
    is [blocks, K/V, block_size, ...]; None for a connector shaped otherwise.

        bytes = tokens × (layer elements / (blocks × block_size)) × element size"""
    requests = getattr(metadata, "requests", None)
    if requests is None or getattr(kv_layer, "ndim", 0) < 3:
        return None
    tokens = sum(len(r.slot_mapping) for r in requests if getattr(r, "is_store", None) is store)
    per_token = kv_layer.numel() // (kv_layer.shape[0] * kv_layer.shape[2])
    return int(tokens * per_token * kv_layer.element_size())
