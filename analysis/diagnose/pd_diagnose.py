"""The `kv_transfer` cause of `phaselens diagnose`, for disaggregated requests (analysis.budget.pd_budget).

Signal at a level (p50, p99) = kv_transfer_ms at that level / client TTFT at that level (a ratio of
percentiles, as the other causes' shares); flagged at ≥ thresholds.KV_TRANSFER_SHARE. A flagged
kv_transfer joins the causes after the primary one (it becomes the primary when nothing else was
flagged). Its levers carry their evidence: KV bytes per request, the transfer's share, the wait for
the sender, and the hops.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol, TypeVar

from phaselens.analysis import thresholds as th
from phaselens.analysis.budget.pd_budget import PdBudget
from phaselens.analysis.diagnose.diagnose_figures import num, pct
from phaselens.analysis.diagnose.levers import Lever

CAUSE = "kv_transfer"


class Signal(Protocol):
    """What diagnose.Signal holds that the placing needs (this module is imported by diagnose)."""

    cause: str
    role: str


S = TypeVar("S", bound=Signal)


def _share(part: float | None, whole: float | None) -> float | None:
    return part / whole if part is not None and whole else None


def signal(pd: PdBudget, make: Callable[..., Any]) -> Any:
    """The kv_transfer row of the verdict as `make(cause, role, p50, p99, threshold, flagged_p50,
    flagged_p99)` (diagnose.Signal), None without a complete disaggregated request."""
    if not pd.complete:
        return None
    kv, ttft = pd.term("kv_transfer_ms"), pd.side["client_ttft_ms"]
    p50, p99 = _share(kv.p50, ttft.p50), _share(kv.p99, ttft.p99)
    threshold = th.KV_TRANSFER_SHARE
    flagged = [x is not None and x >= threshold for x in (p50, p99)]
    return make(CAUSE, "contributing" if any(flagged) else "", p50, p99, threshold, *flagged)


def with_kv_transfer(signals: list[S], kv: S | None) -> list[S]:
    """The verdict's signals with kv_transfer placed: after the primary cause when flagged, first
    (and primary) when the primary was `none`, last when not flagged."""
    if kv is None:
        return signals
    if kv.role != "contributing":
        return [*signals, kv]
    primary = next((i for i, s in enumerate(signals) if s.role == "primary"), None)
    if primary is None or signals[primary].cause == "none":
        kv.role = "primary"
        rest = [s for s in signals if s.cause != "none"]
        return [kv, *rest]
    return [*signals[: primary + 1], kv, *signals[primary + 1 :]]


def levers(pd: PdBudget) -> list[Lever]:
    kv, ttft, wait = pd.term("kv_transfer_ms"), pd.side["client_ttft_ms"], pd.term("kv_wait_ms")
    size = pd.side["kv_bytes"]
    evidence = (
        f"KV transfer p50 = {num(kv.p50)}, p99 = {num(kv.p99)} = {pct(_share(kv.p99, ttft.p99))} of client TTFT "
        f"p99 for {num(size.p50, ' bytes')} of KV per request at p50 (n = {pd.complete})"
    )
    out = [
        Lever(CAUSE, "a faster link between prefill and decode hosts (RDMA/NVLink KV connectors, same rack)", evidence),
        Lever(CAUSE, "fewer KV bytes: a quantised KV cache (fp8), or reuse the decode side's prefix cache", evidence),
    ]
    if wait.p99 is not None and kv.p99 and wait.p99 >= th.KV_TRANSFER_SHARE * kv.p99:
        out.append(
            Lever(
                CAUSE,
                "send KV as each layer finishes, or on more connections: transfers queue behind one another",
                f"wait for the sender p99 = {num(wait.p99)} beside the transfer's {num(kv.p99)}",
            )
        )
    hops = [pd.term(h).p99 for h in ("prefill_hop_ms", "decode_hop_ms")]
    if all(h is not None for h in hops):
        out.append(
            Lever(
                CAUSE,
                "colocate instead (chunked prefill in one batch) when what the transfer and hops add exceeds "
                "the decode stalls they remove (phaselens demo --disagg compares both)",
                f"added per request, mean {num(pd.added_mean_ms())}; hops p99 {num(hops[0])} + {num(hops[1])}",
            )
        )
    return out
