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

`--parts`: instead, the builder's parts one at a time in one process over the same records (each
a `functools.reduce` call that callgrind counts alone, per request): reading the frames
(`wire.split_frames`), decoding them, `compute_phases`, the GenAI histograms, the request's spans
(`FastEmitter.emit_request`; inside it llm.decode's description and the SERVER span, `encode_root`), the step spans (`emit_steps`, 2 a request) and the whole
builder (`SpanBuilder.build` over every record), as the child's fast backend runs them, the exports
discarded (`instrumentation_overhead.builder_run`'s setting). Each part runs once uncounted first.

`--vllm`: vLLM's shape instead (B = 4, L = 64: 16 step records a request; a FLUSH every 20
requests, as the live child's checkpoint every 2 s at ~10 requests a second; metrics off, as in
`vllm_plugin_overhead.py`).

    .venv/bin/python benchmarks/builder_child_instructions.py [--steps 512] [--keep DIR] [--parts] [--vllm]
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.util.instrumentation import InstrumentationScope

from benchmarks.instrumentation_overhead import (
    FINISH_LENGTH,
    SCOPE,
    DiscardMetrics,
    EncodingDiscard,
    ModelStandIn,
    _total_ir,
    open_requests,
    paused_telemetry,
    process_builder_env,
    run_engine,
    start_otlp_sink,
)
from phaselens.instrumentation import names
from phaselens.instrumentation.hotpath.clock import ClockAnchor
from phaselens.instrumentation.hotpath.records import RequestRecord
from phaselens.instrumentation.pipeline import spans
from phaselens.instrumentation.pipeline.builder import SpanBuilder
from phaselens.instrumentation.pipeline.genai_metrics import GenAiServerMetrics
from phaselens.instrumentation.pipeline.histograms import HistogramReader
from phaselens.instrumentation.pipeline.otlp_fast import FastEmitter, request_encoder
from phaselens.instrumentation.pipeline.phases import compute_phases
from phaselens.instrumentation.pipeline.span_processor import BatchSettings, CountingBatchSpanProcessor
from phaselens.instrumentation.process import wire
from phaselens.instrumentation.process.process_sink import SHIP_INTERVAL_S


@dataclass(frozen=True, slots=True)
class Shape:
    """The null engine's batch B and decode steps L a request, and requests between FLUSHes."""

    batch: int
    life: int
    flush_every: int


REFERENCE = Shape(64, 128, 100)
# vLLM's benchmark (4 in flight, 64 output tokens: 16 step records a request); a FLUSH every 20
# requests, as the live child's checkpoint every 2 s at ~10 requests a second
VLLM = Shape(4, 64, 20)


def stream(steps: int, shape: Shape = REFERENCE) -> tuple[bytes, bytes, int, int]:
    """(hello, the records' frames with their FLUSHes, requests, step records)."""
    paused = paused_telemetry(4 * steps * shape.batch, "thread")
    engine = (shape.batch, steps, shape.life)
    open_request = lambda: paused.request(dict(SCOPE))  # noqa: E731
    close = lambda req: req.complete(shape.life, FINISH_LENGTH)  # noqa: E731
    opened = open_requests(open_request, *engine)
    run_engine(open_request, close, lambda req: req.token(), paused.step_observer, *engine, ModelStandIn(0), opened)
    paused._closer.expire(force=True)  # a benchmark's look at the records the loop closed
    records = paused._sink._handoffs.take()
    anchor = paused.anchor
    frames, requests = [], 0
    for record in records:
        if isinstance(record, RequestRecord):
            frames.append(wire.encode_request(record))
            requests += 1
            if requests % shape.flush_every == 0:
                frames.append(wire.frame(wire.KIND_FLUSH, (requests,)))
        else:
            frames.append(wire.encode_step(record))
    frames.append(wire.frame(wire.KIND_FLUSH, (requests + 1,)))
    hello = wire.hello("bench", anchor.mono_ts, anchor.wall_ts, False, SHIP_INTERVAL_S)
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


def part_runs(hello: bytes, data: bytes) -> dict[str, Any]:
    """Each part of the builder as a call over all the records (see the module doc)."""
    anchor = ClockAnchor(*wire.split_frames(hello)[0][0][1][1:3])
    provider = TracerProvider()
    processor = CountingBatchSpanProcessor(
        EncodingDiscard(request_encoder(provider)), BatchSettings(1 << 20, 1 << 20, 3_600_000)
    )
    emitter = FastEmitter(provider, [processor])
    scope = InstrumentationScope(names.SERVER_SCOPE)
    reader = HistogramReader(DiscardMetrics(), provider.resource, scope, export_interval_millis=3_600_000)
    metrics = GenAiServerMetrics(MeterProvider(metric_readers=[reader]), dict, [reader])
    builder = SpanBuilder(emitter, metrics, anchor, provider, False)
    decoders = {wire.KIND_REQUEST: wire.decode_request, wire.KIND_STEP: wire.decode_step}
    frames = [(decoders[kind], fields) for kind, fields in wire.split_frames(data)[0] if kind in decoders]
    records = [decode(fields) for decode, fields in frames]
    requests = [(r, compute_phases(r)) for r in records if isinstance(r, RequestRecord)]
    steps = [r for r in records if not isinstance(r, RequestRecord)]
    return {
        "read_frames": lambda: wire.split_frames(data),
        "decode_frames": lambda: [decode(fields) for decode, fields in frames],
        "compute_phases": lambda: [compute_phases(r) for r, _ in requests],
        "genai_histograms": lambda: [metrics.record(r, p) for r, p in requests],
        "request_spans": lambda: ([emitter.emit_request(anchor, r, p, False) for r, p in requests], processor._queue.clear()),
        "request_spans.decode_description": lambda: [spans.decode_description(anchor, r, p, False) for r, p in requests],
        "request_spans.root": lambda: [emitter._root(anchor, r, p, names.TRACE_FULL_HEAD, None) for r, p in requests],
        "step_spans": lambda: (emitter.emit_steps(anchor, steps), processor._queue.clear()),
        "whole_builder": lambda: ([builder.build(r) for r in records], processor._queue.clear()),
    }  # fmt: skip


def parts_child(steps: int, shape: Shape) -> None:
    """Runs under callgrind (`--parts`): each part once uncounted, then once in a functools.reduce call."""
    hello, data, requests, _ = stream(steps, shape)
    runs = part_runs(hello, data)
    for run in runs.values():
        run()
        functools.reduce(lambda _, __: run() and None, [0], None)  # what a part made freed inside the count
    print(json.dumps({"parts": list(runs), "requests": requests}))


def parts_instructions(valgrind: str, folder: str, steps: int, vllm: bool) -> dict[str, float]:
    """Instructions per request of each part (`parts_child` under callgrind, one dump a part)."""
    out = os.path.join(folder, "parts.callgrind")
    command = [valgrind, "--tool=callgrind", "--collect-atstart=no", "--toggle-collect=functools_reduce",
               "--dump-after=functools_reduce", f"--callgrind-out-file={out}", sys.executable, __file__,
               "--parts-child", "--steps", str(steps), *(["--vllm"] if vllm else [])]  # fmt: skip
    env = {**os.environ, "PYTHONHASHSEED": "0"}
    done = subprocess.run(command, capture_output=True, text=True, timeout=1800, check=True, env=env)
    ran = json.loads(done.stdout.strip().splitlines()[-1])
    dumps = sorted(
        (p for p in os.listdir(folder) if p.startswith("parts.callgrind.")), key=lambda p: int(p.rsplit(".", 1)[1])
    )
    counts = [_total_ir(os.path.join(folder, p)) for p in dumps]
    return {part: count / ran["requests"] for part, count in zip(ran["parts"], counts, strict=True)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=512, help="engine steps S of the null engine")
    parser.add_argument(
        "--keep", metavar="DIR", help="keep the callgrind files there (for `callgrind_annotate --inclusive=yes`)"
    )
    parser.add_argument("--parts", action="store_true", help="the builder's parts in-process (module doc)")
    parser.add_argument(
        "--vllm", action="store_true", help="vLLM's shape (B = 4, L = 64, a FLUSH every 20), no metrics"
    )
    parser.add_argument("--parts-child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.parts_child:
        parts_child(args.steps, VLLM if args.vllm else REFERENCE)
        return 0
    valgrind = shutil.which("valgrind")
    if valgrind is None:
        print(json.dumps({"benchmark": "builder_child_instructions", "skipped": "valgrind is not installed"}))
        return 0
    shape = VLLM if args.vllm else REFERENCE
    config = {"batch": shape.batch, "steps": args.steps, "decode_steps_per_request": shape.life,
              "flush_every": shape.flush_every}  # fmt: skip
    with tempfile.TemporaryDirectory() as scratch:
        folder = args.keep or scratch
        os.makedirs(folder, exist_ok=True)
        if args.parts:
            result = {"parts_instructions_per_request": parts_instructions(valgrind, folder, args.steps, args.vllm)}
        else:
            result = whole_child(valgrind, folder, args.steps, shape, metrics=not args.vllm)
    print(json.dumps({"benchmark": "builder_child_instructions", "config": config, **result}, indent=2))
    return 0


def whole_child(valgrind: str, folder: str, steps: int, shape: Shape, metrics: bool) -> dict[str, Any]:
    """The whole child's instructions per request: fed the records − fed only the hello."""
    hello, records, requests, step_records = stream(steps, shape)
    sink, endpoint = start_otlp_sink()
    try:
        process_builder_env(endpoint)
        if not metrics:  # as vLLM's benchmark runs the child
            os.environ["OTEL_METRICS_EXPORTER"] = "none"
        idle = child_instructions(valgrind, folder, "hello", hello)
        work = child_instructions(valgrind, folder, "records", hello + records)
    finally:
        sink.terminate()
        sink.wait()
    return {
        "requests": requests,
        "step_records": step_records,
        "instructions_per_request": (work - idle) / requests,
        "instructions": {"with_records": work, "baseline_hello_only": idle},
    }


if __name__ == "__main__":
    sys.exit(main())
