"""The serving loop's waits for the GIL while the shipper drains a backlog. Prints ONE JSON object.

The shipper thread (`process_sink.ProcessSink`) packs records in C (`wire.pack`), which never
releases the GIL; a serving loop coming back from a GIL-free model call waits until the shipper
gives it up. Here: the fast path's serving side as `instrumentation_overhead.py` runs it (span-builder
child, OTLP/HTTP to a loopback sink), its shipper asleep while the null engine closes `--steps`
steps' records (B = 64, L = 128: ~1,800 records at 1,200 steps), then one flush from another thread
while this thread runs model steps of `--model-step-us` with a little Python between them, as a
serving loop does. A model step is a GIL-free wait, as a loop waiting on its GPU: a ctypes call
(which releases the GIL) of `clock_nanosleep` to an absolute deadline on CLOCK_MONOTONIC (Linux), so
the loop's wait after it is `time.monotonic_ns()` (the same clock) right after the call less the
deadline: the thread's wake-up, then its wait for the GIL. Per drain: the longest wait and the count
over 200 µs; reported as the median over `--drains` drains, beside every drain's value, and beside
the same loop with no drain (`idle`: the wake-up alone, over as many model steps).

    .venv/bin/python benchmarks/shipper_gil_wait.py [--drains 9] [--steps 1200]
"""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import json
import os
import statistics
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.instrumentation_overhead import (
    ModelStandIn,
    measure_on,
    paused_telemetry,
    process_builder_env,
    start_otlp_sink,
)
from phaselens.instrumentation import names

LONG_WAIT_NS = 200_000
CLOCK_MONOTONIC, TIMER_ABSTIME = 1, 1
_LIBC = ctypes.CDLL(ctypes.util.find_library("c"))  # CDLL: each call releases the GIL


class _Timespec(ctypes.Structure):
    _fields_ = (("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long))


def model_waits(step_ns: int, running: Callable[[], bool]) -> list[int]:
    """GIL-free model steps of `step_ns` while `running()`: each one's ns from its deadline to this
    thread running Python again."""
    waits = []
    while running():
        deadline_ts = time.monotonic_ns() + step_ns
        _LIBC.clock_nanosleep(
            CLOCK_MONOTONIC, TIMER_ABSTIME, ctypes.byref(_Timespec(*divmod(deadline_ts, 10**9))), None
        )
        waits.append(time.monotonic_ns() - deadline_ts)
        sum(range(50))  # the loop's own Python between model calls
    return waits


def figures(waits: list[int]) -> dict:
    return {
        "model_steps": len(waits),
        "longest_wait_us": max(waits) / 1000,
        "waits_over_200us": sum(wait > LONG_WAIT_NS for wait in waits),
    }


def one_drain(args, telemetry, no_model: ModelStandIn) -> dict:
    """Fill the sleeping shipper's hand-offs, then time the loop's waits while one flush ships them."""
    measure_on(args, no_model, telemetry)
    queued = telemetry.stats().queued
    flusher = threading.Thread(target=telemetry.flush, args=(120,))
    flusher.start()
    waits = model_waits(int(args.model_step_us * 1000), flusher.is_alive)
    flusher.join()
    return {"records": queued, **figures(waits)}


def summary(drains: list[dict]) -> dict:
    return {
        "longest_wait_us_median": statistics.median(d["longest_wait_us"] for d in drains),
        "waits_over_200us_total": sum(d["waits_over_200us"] for d in drains),
        "longest_wait_us": [round(d["longest_wait_us"], 1) for d in drains],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--drains", type=int, default=9)
    parser.add_argument("--steps", type=int, default=1200, help="engine steps whose records make one backlog")
    parser.add_argument("--model-step-us", type=float, default=250.0)
    args = parser.parse_args()
    args.batch, args.life = 64, 128
    no_model = ModelStandIn(0)
    sink, endpoint = start_otlp_sink()
    process_builder_env(endpoint)
    os.environ[names.ENV_SPAN_BACKEND] = names.SPAN_BACKEND_FAST
    telemetry = paused_telemetry(1 << 20, "process")
    telemetry.flush(60)  # the child is up
    drains = [one_drain(args, telemetry, no_model) for _ in range(args.drains)]
    idle = []
    for drain in drains:  # as many model steps with the shipper and the child idle
        left = iter(range(drain["model_steps"]))
        running = lambda left=left: next(left, None) is not None  # noqa: E731
        idle.append(figures(model_waits(int(args.model_step_us * 1000), running)))
    stats = telemetry.stats().as_dict()
    telemetry.shutdown()
    sink.terminate()
    sink.wait()
    result = {
        "benchmark": "shipper_gil_wait",
        "config": {**vars(args), "load_average": os.getloadavg(), "cpus": os.cpu_count()},
        "records_per_drain": statistics.median(d["records"] for d in drains),
        "drain": summary(drains),
        "idle": summary(idle),
        "spans_dropped": stats.get("spans_dropped", 0),
    }
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
