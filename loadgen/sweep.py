"""Capacity sweep: the highest request rate whose SLO attainment meets a target (DistServe's goodput).

Bracketing, then bisection. From `start_rate`: while a probe passes, double the rate (up to
`max_rate`); while it fails, halve it (down to `min_rate`). That gives lo (passes) < hi (fails);
bisect until (hi − lo) / hi ≤ `rel_tol`. capacity = lo, the highest rate seen to pass.
Assumes attainment falls as the rate grows (true for a server that queues under load).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field


@dataclass(slots=True)
class Probe:
    rate: float
    attainment: float
    passed: bool
    summary: dict = field(default_factory=dict)


@dataclass(slots=True)
class SweepResult:
    capacity: float  # 0.0 when even min_rate fails
    bounded: bool  # False when max_rate itself passed: the capacity is at least max_rate
    probes: list[Probe]


ProbeFn = Callable[[float], Awaitable[tuple[float, dict]]]  # rate → (attainment, summary)


async def find_capacity(
    probe: ProbeFn,
    target: float,
    start_rate: float,
    max_rate: float,
    min_rate: float = 0.01,
    rel_tol: float = 0.05,
    max_probes: int = 16,
    on_probe: Callable[[Probe], None] | None = None,
) -> SweepResult:
    if not (0 < target <= 1) or not (0 < min_rate <= start_rate <= max_rate) or rel_tol <= 0:
        raise ValueError("need 0 < target ≤ 1, 0 < min_rate ≤ start_rate ≤ max_rate and rel_tol > 0")
    probes: list[Probe] = []

    async def passes(rate: float) -> bool:
        attained, summary = await probe(rate)
        probes.append(Probe(rate, attained, attained >= target, summary))
        if on_probe is not None:
            on_probe(probes[-1])
        return probes[-1].passed

    lo, hi = 0.0, None
    rate = start_rate
    while len(probes) < max_probes:
        if await passes(rate):
            lo = rate
            if hi is not None or rate >= max_rate:
                break
            rate = min(rate * 2, max_rate)
        else:
            hi = rate
            if lo or rate <= min_rate:
                break
            rate = max(rate / 2, min_rate)
    while hi is not None and lo > 0 and (hi - lo) / hi > rel_tol and len(probes) < max_probes:
        mid = (lo + hi) / 2
        if await passes(mid):
            lo = mid
        else:
            hi = mid
    return SweepResult(capacity=lo, bounded=hi is not None, probes=probes)
