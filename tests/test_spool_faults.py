"""The spool at its limits: out of disk space (no partial record, a retryable refusal, appends again
when space returns) and a client's retry of a request the previous run spooled but never acknowledged."""

from __future__ import annotations

import json
import subprocess
import sys
import time

from phaselens.collectors.ingest import Ingest
from phaselens.collectors.metrics import CollectorMetrics
from phaselens.collectors.spool import Spool
from tests.collector_payloads import export_request

# RLIMIT_FSIZE makes writes past the limit fail with EFBIG (CPython ignores SIGXFSZ), as a full
# disk would with ENOSPC: the closest to a full filesystem an unprivileged test gets. Its own process.
_OUT_OF_SPACE = """
import json, os, resource, sys
from phaselens.collectors.spool import Spool, SpoolFull
spool = Spool(sys.argv[1])
payload = bytes(range(256)) * 120
soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
resource.setrlimit(resource.RLIMIT_FSIZE, (100_000, hard))
appended, refusal = 0, ""
try:
    while appended < 100:
        spool.append(payload, 1)
        appended += 1
except SpoolFull as exc:
    refusal = str(exc)
resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
spool.append(payload, 1)  # space is back
segment = spool.active_segment()
records = spool.read(segment, 0, 1 << 30)
print(json.dumps({"appended": appended, "refusal": refusal, "records": len(records),
                  "intact": all(r.payload == payload for r in records),
                  "size": os.path.getsize(f"{sys.argv[1]}/seg-{segment:012d}.log"), "end": records[-1].end if records else 0}))
spool.close()
"""


def test_out_of_space_refuses_retryably_leaves_no_partial_record_and_recovers(tmp_path):
    out = subprocess.run(
        [sys.executable, "-c", _OUT_OF_SPACE, str(tmp_path / "spool")],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    assert 0 < result["appended"] < 100
    assert "out of space" in result["refusal"]
    assert result["records"] == result["appended"] + 1  # every acknowledged record, and the one after
    assert result["intact"]
    assert result["size"] == result["end"]  # no torn bytes between them


def test_a_retried_request_spooled_before_a_crash_is_acknowledged_without_a_second_copy(tmp_path):
    crashed = export_request(8, time.time_ns()).SerializeToString()
    first = Spool(str(tmp_path / "spool"))
    first.append(crashed, 8)  # spooled; the process "dies" before its acknowledgement goes out
    first.close()
    spool = Spool(str(tmp_path / "spool"))
    metrics = CollectorMetrics()
    ingest = Ingest(spool, metrics)
    assert ingest.accept(crashed) == 0  # the client's retry: acknowledged, not stored again
    fresh = export_request(8, time.time_ns()).SerializeToString()
    assert ingest.accept(fresh) == 8
    assert (metrics.requests_deduplicated, metrics.spans_received) == (1, 8)
    records = [r.payload for s in spool.segments() for r in spool.read(s, 0, 1 << 30)]
    assert records.count(crashed) == 1 and records.count(fresh) == 1
    spool.close()
