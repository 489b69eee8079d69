"""Readers of other harnesses' per-request exports → `HarnessRun` (docs/harness-import.md).

AIPerf (read in aiperf 0.13.0: aiperf/common/models/record_models.py `MetricRecordInfo`, the
metrics in aiperf/metrics/types/): `profile_export.jsonl`, one JSON object per request:

    {"metadata": {"x_request_id": …, "request_start_ns": <time.time_ns()>, "request_end_ns": …, …},
     "metrics": {"<tag>": {"value": …, "unit": "ms" | "tokens" | …}, …}, "error": null | {…}}

and `profile_export_aiperf.json` beside it (`aiperf_version`, `input_config.endpoint.type`, the
model). AIPerf's formulas are phaselens's, so each metric goes to the key of the same formula:

    time_to_first_token         first content response − request start       → ttft_ms
    time_to_first_output_token  first non-reasoning content − request start  → ttfo_ms
    request_latency             last content response − request start        → e2e_ms
    inter_token_latency         (request_latency − TTFT) / (osl − 1)         → tpot_ms (a TPOT, not an ITL)
    inter_chunk_latency         gaps between content responses, in order     → itl_ms
    input/output_sequence_length  tokens as AIPerf counted them              → input/output_tokens

A line that is not a readable record (a truncated last line, bad JSON, a missing field) is reported
with its line number and reason; the other lines are still read.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from phaselens.analysis.harness.harness_records import BadLine, ClientRecord, HarnessFormatError, HarnessRun
from phaselens.instrumentation import names as n

AIPERF = "aiperf"
AIPERF_RECORDS = "profile_export.jsonl"
AIPERF_SUMMARY = "profile_export_aiperf.json"
# AIPerf's endpoint types → gen_ai.operation.name
AIPERF_OPERATIONS = {"chat": n.OP_CHAT, "completions": n.OP_TEXT_COMPLETION}
TIME_UNIT_MS = {"ns": 1e-6, "us": 1e-3, "µs": 1e-3, "ms": 1.0, "s": 1000.0, "sec": 1000.0}
AIPERF_MS = {
    "ttft_ms": "time_to_first_token",
    "ttfo_ms": "time_to_first_output_token",
    "tpot_ms": "inter_token_latency",
    "e2e_ms": "request_latency",
}
AIPERF_TOKENS = {"input_tokens": "input_sequence_length", "output_tokens": "output_sequence_length"}


def _ms(metric: dict[str, Any]) -> float | list[float]:
    """A time metric's value (a number or a list) in ms, from the unit the export states."""
    factor = TIME_UNIT_MS.get(str(metric.get("unit")))
    if factor is None:
        raise ValueError(f"unknown time unit {metric.get('unit')!r}")
    value = metric["value"]
    if isinstance(value, list):
        return [float(v) * factor for v in value]
    return float(value) * factor


def aiperf_record(line: str) -> ClientRecord | None:
    """One line of profile_export.jsonl → a record (None when it carries no request id).
    Raises ValueError (or KeyError, TypeError) for a line that is not a record."""
    raw = json.loads(line)
    if not isinstance(raw, dict):
        raise ValueError("not a JSON object")
    meta, metrics = raw["metadata"], raw.get("metrics") or {}
    request_id = meta.get("x_request_id")
    if not request_id:
        return None
    figures: dict[str, Any] = {key: _ms(metrics[tag]) for key, tag in AIPERF_MS.items() if tag in metrics}
    tokens = {key: int(metrics[tag]["value"]) for key, tag in AIPERF_TOKENS.items() if tag in metrics}
    gaps = _ms(metrics["inter_chunk_latency"]) if "inter_chunk_latency" in metrics else []
    error = raw.get("error")
    error_type = None
    if error:
        error_type = str(error.get("type") or error.get("code") or "error")
    return ClientRecord(
        request_id=str(request_id),
        start_wall_ts=int(meta["request_start_ns"]),
        itl_ms=tuple(gaps) if isinstance(gaps, list) else (gaps,),
        error_type=error_type,
        **figures,
        **tokens,
    )


def _aiperf_paths(path: Path) -> tuple[Path, Path]:
    """(records file, summary file) from the artifact directory or the records file itself."""
    records = path / AIPERF_RECORDS if path.is_dir() else path
    if not records.is_file():
        raise HarnessFormatError(f"no AIPerf export at {path}: expected {AIPERF_RECORDS} (aiperf --artifact-dir)")
    return records, records.with_name(AIPERF_SUMMARY)


def _aiperf_summary(summary: Path) -> tuple[str | None, str | None, str | None, str | None]:
    """(version, operation, model, server URL) from profile_export_aiperf.json; None for what it
    does not say."""
    if not summary.is_file():
        return None, None, None, None
    try:
        data = json.loads(summary.read_text(encoding="utf-8"))
        config = data.get("input_config") or {}
        endpoint = config.get("endpoint") or {}
        models = ((config.get("models") or {}).get("items")) or [{}]
        urls = endpoint.get("urls") or [None]
        operation = AIPERF_OPERATIONS.get(str(endpoint.get("type")))
        return data.get("aiperf_version"), operation, models[0].get("name"), urls[0]
    except (ValueError, AttributeError, TypeError):
        return None, None, None, None  # the per-request file still holds every figure


def read_aiperf(path: str | Path) -> HarnessRun:
    """AIPerf's artifact directory (or its profile_export.jsonl) → a HarnessRun."""
    records_path, summary = _aiperf_paths(Path(path))
    version, operation, model, server_url = _aiperf_summary(summary)
    records: list[ClientRecord] = []
    bad: list[BadLine] = []
    without_id = 0
    with records_path.open(encoding="utf-8", errors="replace") as lines:
        for number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                record = aiperf_record(line)
            except (ValueError, KeyError, TypeError, AttributeError) as e:
                reason = f"missing field {e}" if isinstance(e, KeyError) else str(e).splitlines()[0][:200]
                bad.append(BadLine(str(records_path), number, f"not an AIPerf record ({reason})"))
                continue
            if record is None:
                without_id += 1
            else:
                records.append(record)
    return HarnessRun(AIPERF, version, operation, model, tuple(records), tuple(bad), without_id, server_url)


READERS = {AIPERF: read_aiperf}


def read_export(harness: str, path: str | Path) -> HarnessRun:
    """The export of `harness` (a READERS key) at `path`."""
    reader = READERS.get(harness)
    if reader is None:
        raise HarnessFormatError(f"unknown harness {harness!r}: one of {', '.join(READERS)}")
    return reader(path)
