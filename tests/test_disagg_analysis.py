"""The pure parts of the disaggregated analysis: where diagnose places the kv_transfer cause, and
the verdict rule of `demo --disagg` (their SQL and numbers: tests/test_disagg_stack.py)."""

from __future__ import annotations

from phaselens.analysis.budget.latency_budget import BudgetReport, ComponentBudget, DecodeStalls, Goodput, Stat
from phaselens.analysis.budget.pd_budget import TTFT_TERMS, PdBudget
from phaselens.analysis.diagnose.diagnosis import Signal
from phaselens.analysis.diagnose.pd_diagnose import levers, signal, with_kv_transfer
from phaselens.demo import LoadRun
from phaselens.demo_disagg import RunBudget, verdict


def _pd(kv_p50: float, kv_p99: float, ttft_p50: float, ttft_p99: float) -> PdBudget:
    terms = [ComponentBudget(t, Stat(1.0, 1.0, 1.0, 1.0), Stat()) for t in TTFT_TERMS]
    terms[TTFT_TERMS.index("kv_transfer_ms")] = ComponentBudget(
        "kv_transfer_ms", Stat(kv_p50, 0, kv_p99, kv_p50), Stat()
    )
    side = {name: Stat(ttft_p50, 0, ttft_p99, ttft_p50) for name in ("client_ttft_ms", "kv_bytes")}
    return PdBudget(requests=10, complete=10, terms=terms, side=side)


def _sig(cause: str, role: str) -> Signal:
    return Signal(cause, role, 0.5, 0.5, 0.3, role == "primary", role == "primary")


def test_a_large_transfer_contributes_after_the_primary_cause_a_small_one_does_not():
    base = [_sig("queue", "primary"), _sig("prefill", "contributing"), _sig("network", "")]
    big = signal(_pd(kv_p50=30, kv_p99=60, ttft_p50=100, ttft_p99=200), Signal)
    assert (big.p50_signal, big.p99_signal, big.role) == (0.3, 0.3, "contributing")
    assert [s.cause for s in with_kv_transfer(base, big)] == ["queue", "kv_transfer", "prefill", "network"]
    small = signal(_pd(kv_p50=1, kv_p99=2, ttft_p50=100, ttft_p99=200), Signal)
    assert not (small.flagged_p50 or small.flagged_p99)
    assert [s.cause for s in with_kv_transfer(base, small)][-1] == "kv_transfer" and small.role == ""


def test_the_transfer_becomes_primary_when_nothing_else_was_flagged():
    placed = with_kv_transfer([_sig("none", "primary")], signal(_pd(40, 80, 100, 200), Signal))
    assert [(s.cause, s.role) for s in placed] == [("kv_transfer", "primary")]


def test_no_disaggregated_request_no_signal_and_levers_carry_evidence():
    assert signal(PdBudget(), Signal) is None
    assert with_kv_transfer([_sig("queue", "primary")], None)[0].cause == "queue"
    found = levers(_pd(30, 60, 100, 200))
    assert found and all(lever.cause == "kv_transfer" and "ms" in lever.evidence for lever in found)


def _report(attainment: float, tpot_p99: float, ttft_p99: float, mixed: int):
    dists = {
        "client_tpot_ms": Stat(1, 1, tpot_p99, 1),
        "client_ttft_ms": Stat(1, 1, ttft_p99, 1),
    }
    return BudgetReport(
        requests=10,
        with_client=10,
        with_server=10,
        errors=0,
        no_output=0,
        reference="client",
        components=[],
        distributions=dists,
        tail=None,
        goodput=Goodput(100, 50, int(attainment * 10), 10.0, attainment, attainment, False, "client"),
        stalls=DecodeStalls(1.0, 10, 8, mixed, float(mixed), 0.0, 0),
    )


def test_demo_verdict_rule():
    load = LoadRun([], 0, 1.0)
    pd = _pd(10, 20, 100, 200)
    colocated = RunBudget("colocated", load, _report(0.5, 80, 300, mixed=6))
    better = RunBudget("disaggregated", load, _report(0.7, 40, 350, mixed=0), pd)
    assert "did not pay" not in verdict(colocated, better) and "paid" in verdict(colocated, better)
    worse = RunBudget("disaggregated", load, _report(0.4, 40, 250, mixed=0), pd)
    assert "did not pay" in verdict(colocated, worse)
    tie_tail = RunBudget("disaggregated", load, _report(0.5, 40, 250, mixed=0), pd)
    assert "did not pay" not in verdict(colocated, tie_tail)
    assert "removed 6 decode steps carrying prefill" in verdict(colocated, tie_tail)
