"""A harness's per-request records as phaselens reads them: what `phaselens import` turns into client views.

Every figure is a duration the harness computed on its own clock, kept exactly as it wrote it
(ms); `start_wall_ts` is the harness's wall clock and only places the client span on a timeline.
Nothing here is ever subtracted from a server timestamp.
"""

from __future__ import annotations

from dataclasses import dataclass, field


class HarnessFormatError(ValueError):
    """An export that cannot be read at all (missing file, not the harness's format)."""


@dataclass(frozen=True, slots=True)
class ClientRecord:
    """One request as the harness measured it. `request_id` is the X-Request-ID it sent;
    `itl_ms` its inter-chunk gaps, in order; a failed request has `error_type`."""

    request_id: str
    start_wall_ts: int
    e2e_ms: float | None = None
    ttft_ms: float | None = None
    ttfo_ms: float | None = None
    tpot_ms: float | None = None
    itl_ms: tuple[float, ...] = ()
    input_tokens: int | None = None
    output_tokens: int | None = None
    error_type: str | None = None


@dataclass(frozen=True, slots=True)
class BadLine:
    """A record that could not be read: where, and why."""

    source: str
    line: int
    reason: str

    def __str__(self) -> str:
        return f"{self.source}:{self.line}: {self.reason}"


@dataclass(frozen=True, slots=True)
class HarnessRun:
    """What one export holds: who measured (`harness`, `version`), the request shape it sent
    (`operation`, `model`: None when the export does not say), the readable records and the bad ones,
    and the server it called (`server_url`)."""

    harness: str
    version: str | None
    operation: str | None
    model: str | None
    records: tuple[ClientRecord, ...]
    bad_lines: tuple[BadLine, ...] = field(default=())
    without_id: int = 0  # records that carry no request id: they cannot be joined, counted here
    server_url: str | None = None  # the URL the harness called (its first, when it balanced over several)
