"""The span-builder child at vLLM's shape and rate: CPU and wake-ups per second, loaded and idle.
Prints ONE JSON object.

In vLLM (`vllm_plugin_overhead.py`: 4 in flight, 64 output tokens, 6-13 requests a second) the
child's fixed costs a second (reads, exports, reports) are shared by few requests. This feeds the
child as the shipper does: the hello, then one write every `--ship-every` seconds of that many
seconds of `--rate` requests' frames (the null engine's records, B = 4, L = 64: 16 step records a
request), for `--seconds`, then (3 s later: the last read's checkpoint) nothing for `--seconds`.
The child exports OTLP/HTTP to a loopback sink (metrics off, as in vLLM's benchmark).
Read from /proc/<child>/task/*/schedstat over each phase: CPU ns (first field, the scheduler's
clock) and times scheduled in (third field: wake-ups, every thread of the child), and the report
lines it wrote. Figures: µs of CPU per request loaded, µs per second and wake-ups per second idle.
Each phase is run `--rounds` times on the same child; medians with [min, max].

`--child-tree DIR`: the child runs from DIR (PYTHONPATH and working directory), where DIR/phaselens
holds another commit's packages (its top-level folders linked under it, C extensions built), for
alternated pairs against it; the frames are this tree's (the wire format is the same).

    .venv/bin/python benchmarks/builder_child_rate.py [--rate 10] [--seconds 10] [--rounds 3] [--child-tree DIR]
"""

from __future__ import annotations

import argparse
import fcntl
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.instrumentation_overhead import (
    FINISH_LENGTH,
    SCOPE,
    ModelStandIn,
    open_requests,
    paused_telemetry,
    run_engine,
    start_otlp_sink,
)
from phaselens.instrumentation import names
from phaselens.instrumentation.hotpath.records import RequestRecord
from phaselens.instrumentation.process import wire
from phaselens.instrumentation.process.process_sink import _F_SETPIPE_SZ as F_SETPIPE_SZ
from phaselens.instrumentation.process.process_sink import PIPE_BYTES, SHIP_INTERVAL_S

BATCH, LIFE = 4, 64  # vLLM's benchmark: 4 in flight, 64 output tokens (one step record a token)
WARM_UP_S = 3
SETTLE_S = 3  # past the child's checkpoint interval (2 s)


def seconds_of_frames(rate: int, seconds: int, every_s: int) -> tuple[bytes, list[bytes]]:
    """(hello, one bytes of frames a write: `rate` requests after the LIFE / BATCH step records each
    of them ran in, steps first as the shipper's hand-offs give them); the hello sets the child's
    checkpoint interval to the writes' `every_s`, as the shipper's does."""
    steps = (seconds * rate + BATCH) * LIFE // BATCH
    paused = paused_telemetry(4 * steps * BATCH, "thread")
    shape = (BATCH, steps, LIFE)
    open_request = lambda: paused.request(dict(SCOPE))  # noqa: E731
    opened = open_requests(open_request, *shape)
    close = lambda req: req.complete(LIFE, FINISH_LENGTH)  # noqa: E731
    run_engine(open_request, close, lambda req: req.token(), paused.step_observer, *shape, ModelStandIn(0), opened)
    paused._closer.expire(force=True)  # a benchmark's look at the records the loop closed
    records = paused._sink._handoffs.take()  # every step, then every request
    requests = [record for record in records if isinstance(record, RequestRecord)]
    step_records = records[: len(records) - len(requests)]
    per_write = rate * LIFE // BATCH
    chunks = [
        wire.pack(step_records[k * per_write : (k + 1) * per_write] + requests[k * rate : (k + 1) * rate]).data
        for k in range(seconds)
    ]
    anchor = paused.anchor
    return wire.hello("bench", anchor.mono_ts, anchor.wall_ts, False, float(every_s)), chunks


def schedstat(pid: int) -> tuple[int, int]:
    """(CPU ns, times scheduled in) summed over `pid`'s threads."""
    cpu = runs = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            fields = (task / "schedstat").read_text().split()
        except OSError:  # the thread ended meanwhile
            continue
        cpu, runs = cpu + int(fields[0]), runs + int(fields[2])
    return cpu, runs


class Child:
    """The span-builder process, its stdin written by the caller, its report lines counted."""

    def __init__(self, endpoint: str, tree: str | None = None) -> None:
        env = {
            **os.environ,
            "OTEL_TRACES_EXPORTER": "otlp",
            "OTEL_METRICS_EXPORTER": "none",
            "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/protobuf",
            "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": f"{endpoint}/v1/traces",
            names.ENV_SPAN_BACKEND: names.SPAN_BACKEND_FAST,
        }
        if tree is not None:  # its `phaselens` first: run from there, so the working tree's is not found first
            env["PYTHONPATH"] = tree
        report_read, report_write = os.pipe()
        command = [sys.executable, "-m", "phaselens.instrumentation.process.builder_child"]
        self.proc = subprocess.Popen(
            [*command, str(report_write), str(os.getpid())],
            stdin=subprocess.PIPE,
            pass_fds=(report_write,),
            env=env,
            cwd=tree,
        )
        os.close(report_write)
        assert self.proc.stdin is not None
        fcntl.fcntl(self.proc.stdin.fileno(), F_SETPIPE_SZ, PIPE_BYTES)  # as the shipper's pipe
        self.lines = 0
        self.last: dict = {}
        self.reader = threading.Thread(target=self._read, args=(os.fdopen(report_read, "rb"),), daemon=True)
        self.reader.start()

    def _read(self, reports) -> None:
        for line in reports:
            self.lines += 1
            report = json.loads(line)
            if len(report) > 1:
                self.last = report

    def write(self, data: bytes) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(data)
        self.proc.stdin.flush()

    def phase(self, chunks: list[bytes], seconds: int, every_s: int = 1) -> dict:
        """CPU and wake-ups over `seconds`, writing one chunk every `every_s` (no chunks: idle)."""
        cpu, runs = schedstat(self.proc.pid)
        lines, started = self.lines, time.monotonic()
        for write in range(seconds // every_s):
            if chunks:
                self.write(chunks[write % len(chunks)])
            time.sleep(max(0.0, started + (write + 1) * every_s - time.monotonic()))
        cpu_after, runs_after = schedstat(self.proc.pid)
        return {"cpu_ns": cpu_after - cpu, "wakeups": runs_after - runs, "reports": self.lines - lines}

    def stop(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        self.proc.wait(60)
        self.reader.join(10)


def _spread(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rate", type=int, default=10, help="requests a second")
    parser.add_argument("--seconds", type=int, default=10, help="of each phase")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--ship-every",
        type=int,
        default=int(SHIP_INTERVAL_S),
        help="seconds between writes and the child's checkpoint interval (the shipper's, rounded down)",
    )
    parser.add_argument(
        "--child-tree",
        metavar="DIR",
        help="run the child from DIR/phaselens (another commit's packages, e.g. to compare in alternated pairs)",
    )
    args = parser.parse_args()
    every_s = args.ship_every
    hello, chunks = seconds_of_frames(args.rate * every_s, args.seconds // every_s, every_s)
    sink, endpoint = start_otlp_sink()
    child = Child(endpoint, args.child_tree)
    try:
        child.write(hello)
        child.phase(chunks, WARM_UP_S * every_s, every_s)
        loaded, idle = [], []
        for _ in range(args.rounds):
            loaded.append(child.phase(chunks, args.seconds, every_s))
            time.sleep(SETTLE_S)  # the last read's checkpoint, outside the idle phase
            idle.append(child.phase([], args.seconds))
        child.stop()
    finally:
        sink.kill()
        sink.wait()
    requests = args.rate * args.seconds
    print(
        json.dumps(
            {
                "benchmark": "builder_child_rate",
                "child_tree": args.child_tree,
                "requests_per_s": args.rate,
                "ship_every_s": every_s,
                "step_records_per_request": LIFE // BATCH,
                "seconds": args.seconds,
                "load_average_1m": os.getloadavg()[0],
                "loaded_cpu_us_per_request": _spread([p["cpu_ns"] / requests / 1000 for p in loaded]),
                "loaded_wakeups_per_s": _spread([p["wakeups"] / args.seconds for p in loaded]),
                "loaded_reports_per_s": _spread([p["reports"] / args.seconds for p in loaded]),
                "idle_cpu_us_per_s": _spread([p["cpu_ns"] / args.seconds / 1000 for p in idle]),
                "idle_wakeups_per_s": _spread([p["wakeups"] / args.seconds for p in idle]),
                "idle_reports_per_s": _spread([p["reports"] / args.seconds for p in idle]),
                "spans_exported": child.last.get("export_exported"),
                "spans_built": child.last.get("spans_built"),
            },
            indent=2,
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
