"""One scenario's figures, as the suite reports them (JSON and the table of docs/faults.md)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from phaselens.faults.load import Ledger


@dataclass(slots=True)
class Outcome:
    scenario: str
    sent: int
    acknowledged: int
    stored: int  # distinct span ids in ClickHouse
    lost: int  # acknowledged, not stored
    duplicated: int  # stored rows beyond the first copy of a span id
    client_dropped: int  # dropped by the SDK: queue overflow, or a batch given up after its retry budget
    recover_s: float | None  # None: did not recover within the scenario's bound
    detail: dict = field(default_factory=dict)

    @classmethod
    def of(
        cls, scenario: str, ledger: Ledger, stored_ids: set[str], rows: int, recover_s: float | None, detail: dict
    ) -> Outcome:
        return cls(
            scenario,
            ledger.sent,
            len(ledger.acknowledged),
            len(stored_ids),
            len(ledger.acknowledged - stored_ids),
            rows - len(stored_ids),
            ledger.client_dropped(),
            None if recover_s is None else round(recover_s, 2),
            detail,
        )

    def as_dict(self) -> dict:
        return asdict(self)


def markdown(outcomes: list[Outcome]) -> str:
    """The rows of the table in docs/faults.md."""
    head = (
        "| scenario | sent | acknowledged | stored | lost | duplicated | client-side drops | recover s |\n"
        "|---|---|---|---|---|---|---|---|\n"
    )
    return head + "".join(
        f"| {o.scenario} | {o.sent:,} | {o.acknowledged:,} | {o.stored:,} | {o.lost:,} | {o.duplicated:,} | "
        f"{o.client_dropped:,} | {'—' if o.recover_s is None else o.recover_s} |\n"
        for o in outcomes
    )
