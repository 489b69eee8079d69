"""The whole span-builder child's instructions per request under callgrind, over a fixed stream of
frames. Prints ONE JSON object.

`benchmarks/instrumentation_overhead.py` counts the builder's own work in-process; this counts the
child process as the serving process runs it (`python -m phaselens.instrumentation.process.builder_child`,
fast backend, OTLP/HTTP spans and metrics to a loopback sink, as that benchmark's live runs): reading
the pipe, building, the exports with their HTTP requests, the checkpoints and reports, its threads,
the garbage collector, its shutdown. The stream: the hello, then the records the null engine closes
(B = 64, L = 128, `--steps` steps: 2 step records a request), a FLUSH after every 100 requests and
at the end; fed from a file on stdin, so the child reads it as fast as it builds (the live child
reads it in bursts, every 0.25 s). Baseline, same run: the same child fed only the hello (startup and
shutdown). Figure: (instructions with the records − hello only) / requests. Under callgrind the
child runs ~50× slower, so its 1 s checkpoints come more often than live: counts move by ~±2 %
between runs.

    .venv/bin/python benchmarks/builder_child_instructions.py [--steps 512] [--keep DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.instrumentation_overhead import (
    FINISH_LENGTH,
    SCOPE,
    ModelStandIn,
    _total_ir,
    open_requests,
    paused_telemetry,
    process_builder_env,
    run_engine,
    start_otlp_sink,
)
from phaselens.instrumentation import names
from phaselens.instrumentation.hotpath.records import RequestRecord
from phaselens.instrumentation.process import wire

BATCH, LIFE, FLUSH_EVERY = 64, 128, 100


def stream(steps: int) -> tuple[bytes, bytes, int, int]:
    """(hello, the records' frames with their FLUSHes, requests, step records)."""
    paused = paused_telemetry(4 * steps * BATCH, "thread")
    shape = (BATCH, steps, LIFE)
    open_request = lambda: paused.request(dict(SCOPE))  # noqa: E731
    close = lambda req: req.complete(LIFE, FINISH_LENGTH)  # noqa: E731
    opened = open_requests(open_request, *shape)
    run_engine(open_request, close, lambda req: req.token(), paused.step_observer, *shape, ModelStandIn(0), opened)
    paused._closer.expire(force=True)  # a benchmark's look at the records the loop closed
    records = paused._sink._handoffs.take()
    anchor = paused.anchor
    frames, requests = [], 0
    for record in records:
        if isinstance(record, RequestRecord):
            frames.append(wire.encode_request(record))
            requests += 1
            if requests % FLUSH_EVERY == 0:
                frames.append(wire.frame(wire.KIND_FLUSH, (requests,)))
        else:
            frames.append(wire.encode_step(record))
    frames.append(wire.frame(wire.KIND_FLUSH, (requests + 1,)))
    hello = wire.frame(wire.KIND_HELLO, ("bench", anchor.mono_ns, anchor.wall_ns, False))
    return hello, b"".join(frames), requests, len(records) - requests


def child_instructions(valgrind: str, folder: str, name: str, data: bytes) -> int:
    """Instructions of one child fed `data` on stdin to its EOF (callgrind, whole process)."""
    path, out = os.path.join(folder, f"{name}.in"), os.path.join(folder, f"{name}.callgrind")
    with open(path, "wb") as stdin:
        stdin.write(data)
    env = {**os.environ, "PYTHONHASHSEED": "0", names.ENV_SPAN_BACKEND: names.SPAN_BACKEND_FAST}
    command = [valgrind, "--tool=callgrind", f"--callgrind-out-file={out}", sys.executable, "-m",
               "phaselens.instrumentation.process.builder_child"]  # fmt: skip
    with open(path, "rb") as stdin, open(os.devnull, "w") as reports:
        fd = reports.fileno()
        subprocess.run(
            [*command, str(fd), str(os.getpid())],
            stdin=stdin,
            pass_fds=(fd,),
            env=env,
            capture_output=True,
            timeout=1800,
            check=True,
        )
    return _total_ir(out)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=512, help="engine steps S of the null engine")
    parser.add_argument(
        "--keep", metavar="DIR", help="keep the callgrind files there (for `callgrind_annotate --inclusive=yes`)"
    )
    args = parser.parse_args()
    valgrind = shutil.which("valgrind")
    if valgrind is None:
        print(json.dumps({"benchmark": "builder_child_instructions", "skipped": "valgrind is not installed"}))
        return 0
    hello, records, requests, steps = stream(args.steps)
    sink, endpoint = start_otlp_sink()
    try:
        process_builder_env(endpoint)
        with tempfile.TemporaryDirectory() as scratch:
            folder = args.keep or scratch
            os.makedirs(folder, exist_ok=True)
            idle = child_instructions(valgrind, folder, "hello", hello)
            work = child_instructions(valgrind, folder, "records", hello + records)
    finally:
        sink.terminate()
        sink.wait()
    result = {
        "benchmark": "builder_child_instructions",
        "config": {"batch": BATCH, "steps": args.steps, "decode_steps_per_request": LIFE, "flush_every": FLUSH_EVERY},
        "requests": requests,
        "step_records": steps,
        "instructions_per_request": (work - idle) / requests,
        "instructions": {"with_records": work, "baseline_hello_only": idle},
    }
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
