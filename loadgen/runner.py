"""The async orchestrator: sends the workload on the arrival schedule and collects `StreamResult`s.

Every request records its intended send time (from the schedule) beside the actual one (stamped by
the client), so schedule lag and latency from the intended time are always known. Open loop
(`arrivals` set): requests go at their intended times whatever the server does; `max_concurrency`,
when set, caps requests in flight, and a request waiting for a slot keeps its intended time, so the
wait shows as schedule lag instead of vanishing (no coordinated omission). Closed loop
(`arrivals=None`, `concurrency=C`): C workers, each sending its next request when the previous ends.
Warm-up requests run first, to completion, and are left out of the results.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import itertools
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from phaselens.common.clocks import NOT_STAMPED, MonoTs, WallTs, perf_counter_ts, wall_clock_ts
from phaselens.instrumentation import StreamResult, TracedClient
from phaselens.loadgen.arrivals import GammaArrivals, TraceArrivals
from phaselens.loadgen.workloads import RequestSpec

_START_LEAD_NS = 2_000_000  # the schedule starts 2 ms after setup, so request 0 is not born late


@dataclass(slots=True)
class RunPlan:
    endpoint: str
    model: str
    arrivals: GammaArrivals | TraceArrivals | None = None  # None = closed loop
    concurrency: int | None = None  # closed-loop workers, or the in-flight cap of an open loop
    requests: int | None = None
    duration_s: float | None = None
    warmup: int = 0
    ignore_eos: bool = False
    extra: dict = field(default_factory=dict)  # merged into every request body

    def __post_init__(self):
        if self.arrivals is None and not self.concurrency:
            raise ValueError("a closed loop needs concurrency ≥ 1")
        if self.requests is None and self.duration_s is None and not hasattr(self.arrivals, "entries"):
            raise ValueError("bound the run with requests or duration_s")
        if self.requests is None and getattr(self.arrivals, "rate", 0.0) == float("inf"):
            raise ValueError("rate inf sends everything at once: bound it with a request count")


@dataclass(slots=True)
class RunResult:
    results: list[StreamResult]
    warmup_results: list[StreamResult]
    start_ts: MonoTs  # the schedule's time zero (the client's perf_counter_ns)
    end_ts: MonoTs  # the last response closed
    start_wall_ts: WallTs

    @property
    def duration_s(self) -> float:
        return max(self.end_ts - self.start_ts, 0) / 1e9


OnDone = Callable[[StreamResult], None]


async def run(
    plan: RunPlan, client: TracedClient, specs: Iterator[RequestSpec], on_done: OnDone | None = None
) -> RunResult:
    """Run `plan`: warm-up first, then the measured requests; never raises for a failed request."""
    warmup = await _warmup(plan, client, specs)
    with _frozen_heap():
        start_wall_ts = wall_clock_ts()
        start_ts = MonoTs(perf_counter_ts() + _START_LEAD_NS)
        if plan.arrivals is None:
            results = await _closed_loop(plan, client, specs, start_ts, on_done)
        else:
            results = await _open_loop(plan, client, specs, start_ts, on_done)
    results.sort(key=lambda r: r.intended_ts or NOT_STAMPED)  # `_send` gives every result one
    end_ts = max((r.done_ts for r in results), default=start_ts)
    return RunResult(results, warmup, start_ts, end_ts, start_wall_ts)


@contextlib.contextmanager
def _frozen_heap():
    """Keep the objects made before the run out of the garbage collector's scans while it lasts:
    a full collection of a process heap stalls every stream at once (15–35 ms measured here, with
    imports only), which shows up as schedule lag and late receive stamps."""
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


async def _send(
    plan: RunPlan, client: TracedClient, spec: RequestSpec, intended_ts: MonoTs, on_done: OnDone | None
) -> StreamResult:
    payload = spec.payload(plan.endpoint, plan.model, plan.ignore_eos, plan.extra)
    result = await client.stream(plan.endpoint, payload, intended_ts=intended_ts)
    if on_done is not None:
        on_done(result)
    return result


async def _warmup(plan: RunPlan, client: TracedClient, specs: Iterator[RequestSpec]) -> list[StreamResult]:
    limit = asyncio.Semaphore(plan.concurrency or plan.warmup or 1)

    async def one(spec: RequestSpec) -> StreamResult:
        async with limit:
            return await _send(plan, client, spec, perf_counter_ts(), None)

    return list(await asyncio.gather(*(one(spec) for spec in itertools.islice(specs, plan.warmup))))


async def _open_loop(
    plan: RunPlan, client: TracedClient, specs: Iterator[RequestSpec], start_ts: MonoTs, on_done: OnDone | None
) -> list[StreamResult]:
    limit = asyncio.Semaphore(plan.concurrency) if plan.concurrency else None

    async def one(spec: RequestSpec, intended_ts: MonoTs) -> StreamResult:
        if limit is None:
            return await _send(plan, client, spec, intended_ts, on_done)
        async with limit:  # a wait here counts as schedule lag: intended_ts stays the schedule's
            return await _send(plan, client, spec, intended_ts, on_done)

    assert plan.arrivals is not None  # run() sends a closed loop to _closed_loop
    tasks = []
    try:
        for i, (offset_s, spec) in enumerate(zip(plan.arrivals.offsets_s(), specs, strict=False)):
            if (plan.requests is not None and i >= plan.requests) or (
                plan.duration_s is not None and offset_s >= plan.duration_s
            ):
                break
            intended_ts = MonoTs(start_ts + int(offset_s * 1e9))
            delay_ns = intended_ts - perf_counter_ts()
            if delay_ns > 0:
                await asyncio.sleep(delay_ns / 1e9)
            tasks.append(asyncio.create_task(one(spec, intended_ts)))
        return list(await asyncio.gather(*tasks))
    except BaseException:  # cancelled or failed: no request may outlive the run
        for task in tasks:
            task.cancel()
        raise


async def _closed_loop(
    plan: RunPlan, client: TracedClient, specs: Iterator[RequestSpec], start_ts: MonoTs, on_done: OnDone | None
) -> list[StreamResult]:
    counter = itertools.count()
    deadline_ts = None if plan.duration_s is None else MonoTs(start_ts + int(plan.duration_s * 1e9))
    results: list[StreamResult] = []
    delay_ns = start_ts - perf_counter_ts()
    if delay_ns > 0:
        await asyncio.sleep(delay_ns / 1e9)

    async def worker() -> None:
        # the intended time of a closed-loop request is when its worker became free
        for i in counter:
            now = perf_counter_ts()
            if (plan.requests is not None and i >= plan.requests) or (deadline_ts is not None and now >= deadline_ts):
                return
            spec = next(specs, None)
            if spec is None:
                return
            results.append(await _send(plan, client, spec, now, on_done))

    assert plan.concurrency is not None  # RunPlan requires it of a closed loop
    await asyncio.gather(*(worker() for _ in range(plan.concurrency)))
    return results
