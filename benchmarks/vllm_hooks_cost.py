"""The vLLM plugin's work in vLLM's API server, replayed outside vLLM: instructions and CPU per request,
the plugin against vLLM unwrapped, in one run. Prints ONE JSON object.

Runs in a virtualenv with vLLM (`.venv-vllm/bin/python`); elsewhere it prints `skipped`. vLLM's own
classes do the work: `OutputProcessor` (detokenizing with the tiny model's tokenizer, stats on) and
`RequestOutputCollector`, `EngineCoreRequest`s, and each engine step's `EngineCoreOutputs` encoded by
vLLM's `MsgpackEncoder` (what the EngineCore sends) and decoded by its `MsgpackDecoder` (what the API
server's output handler does first). Per group of B = 4 requests, on one asyncio loop as in the API
server: each request's task (a stand-in for vLLM's OpenAI completions handler, which needs a whole
engine) receives the body, calls `add_request`, then takes its output (`get_nowait() or await get()`)
and sends one SSE chunk per output; the output handler's part runs once per step (64 steps, one token
each: 64 prompt + 64 output tokens a request): decode, `process_outputs`, `update_scheduler_stats`.

    off     vLLM's methods unwrapped, tracing off: steps carry no trace headers, no middleware
    hooks   the plugin's wrappers (`hooks.install` on subclasses) with tracing on, requests with a
            W3C traceparent, the span-builder child (exporters from OTEL_*; here `none`, so the
            child's CPU is not vLLM's); no middleware: each request's handle opened at its first output
    plugin  the same with its `FirstChunkMiddleware` around the handler, as the plugin is run

Not replayed: vLLM's HTTP server and serving code, the inbound protocol's reads, the sockets.
`--callgrind`: instructions per request of each configuration (callgrind counts inside one
`functools.reduce` per configuration over `--groups` groups after a warm-up group; valgrind needed).
Otherwise CPU per request: the loop thread's CPU over the groups (best of `--repeats`, the two
configurations alternated), and, for the plugin, its `pl-*` threads' CPU over a run paced at
`--rate` requests a second (the shipper wakes every 2 s: its cost a request depends on the rate).
Then (`--zmq-rounds`) each configuration's steps, as encoded, through a ZMQ PUSH → PULL pair over
IPC made by vLLM's `make_zmq_socket`, one step every `--zmq-gap-ms`: the CPU per request of the two
contexts' I/O threads (libzmq's `ZMQbg/IO`, what vLLM's API server and EngineCore each run), and
the steps' bytes per request (the trace headers vLLM echoes in every output when nothing drops them).

    .venv-vllm/bin/python benchmarks/vllm_hooks_cost.py [--groups 24] [--repeats 5] [--rate 10] [--callgrind]
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.incoming_extract import SCOPE
from benchmarks.instrumentation_overhead import reduce_instructions
from phaselens.common.threads import THREAD_PREFIX

BATCH = 4  # requests in flight, each step's outputs
PROMPT_TOKENS = OUTPUT_TOKENS = 64
CONFIGS = ("off", "hooks", "plugin")
# vLLM's JSON (pydantic's `model_dump_json`) has no spaces; one encoder (json.dumps with separators
# makes one a call)
COMPACT_JSON = json.JSONEncoder(separators=(",", ":")).encode
TRACEPARENT = dict(SCOPE["headers"])[b"traceparent"].decode()
# what `vllm serve` has in its argv, where the plugin reads the model's name and the middleware
VLLM_ARGV = [
    "--served-model-name",
    "tiny",
    "--middleware",
    "phaselens.integrations.vllm.middleware.FirstChunkMiddleware",
]
os.environ.setdefault("OTEL_TRACES_EXPORTER", "none")
os.environ.setdefault("OTEL_METRICS_EXPORTER", "none")
os.environ.setdefault("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "http://127.0.0.1:4318/v1/traces")
os.environ.setdefault("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "http/protobuf")


class Replay:
    """One configuration: its output processor, collector class and ASGI app, and its steps' bytes."""

    def __init__(self, plugin: bool, middleware: bool, tokenizer, groups: int) -> None:
        from vllm.v1.engine.output_processor import OutputProcessor, RequestOutputCollector
        from vllm.v1.serial_utils import MsgpackDecoder

        from phaselens.integrations.vllm import hooks
        from phaselens.integrations.vllm.delivery import FirstChunkMiddleware

        processor_cls, self.collector_cls = OutputProcessor, RequestOutputCollector
        if plugin:  # wrapped subclasses: vLLM's own classes stay unwrapped for `off`
            processor_cls = type("PluginOutputProcessor", (OutputProcessor,), {})
            self.collector_cls = type("PluginCollector", (RequestOutputCollector,), {})
            hooks.install(processor_cls, self.collector_cls)
        self.plugin = plugin
        self.processor = processor_cls(tokenizer, log_stats=True, tracing_enabled=plugin)
        self.app = FirstChunkMiddleware(self.serve) if middleware else self.serve
        self.decoder = MsgpackDecoder(_engine_core_outputs())
        self.requests = [self._requests(g) for g in range(groups)]
        self.frames: dict[int, list] = {}  # a group's steps, encoded at its first run (the EngineCore's work)

    def _requests(self, group: int) -> list:
        """A group's requests as vLLM's input processor makes them (a traceparent when traced)."""
        from vllm.sampling_params import RequestOutputKind, SamplingParams
        from vllm.v1.engine import EngineCoreRequest

        headers = {"traceparent": TRACEPARENT} if self.plugin else None
        params = SamplingParams(max_tokens=OUTPUT_TOKENS, ignore_eos=True, output_kind=RequestOutputKind.DELTA)
        prompt = list(range(10, 10 + PROMPT_TOKENS))
        return [
            EngineCoreRequest(
                *(f"cmpl-{group}-{i}-0-5e1ec7ed", prompt, None, params, None, time.time(), None, None, None),
                trace_headers=headers,
                external_req_id=f"cmpl-{group}-{i}-0",
            )
            for i in range(BATCH)
        ]

    @staticmethod
    def _frames(requests: list) -> list:
        """The group's steps as the EngineCore sends them, from the requests as `add_request` left
        them (the EngineCore echoes each request's trace headers in every output)."""
        from vllm.v1.engine import (
            EngineCoreEvent,
            EngineCoreEventType,
            EngineCoreOutput,
            EngineCoreOutputs,
            FinishReason,
        )
        from vllm.v1.metrics.stats import SchedulerStats
        from vllm.v1.serial_utils import MsgpackEncoder

        encoder, frames, start_s = MsgpackEncoder(), [], time.monotonic()
        queued = [
            EngineCoreEvent(EngineCoreEventType.QUEUED, start_s),
            EngineCoreEvent(EngineCoreEventType.SCHEDULED, start_s),
        ]
        for step in range(OUTPUT_TOKENS):
            last = step == OUTPUT_TOKENS - 1
            outputs = [
                EngineCoreOutput(
                    r.request_id,
                    [40 + (step + i) % 200],
                    finish_reason=FinishReason.LENGTH if last else None,
                    events=queued if step == 0 else None,
                    trace_headers=r.trace_headers,
                )
                for i, r in enumerate(requests)
            ]
            stats = SchedulerStats(num_running_reqs=len(requests), kv_cache_usage=0.01)
            frames.append(encoder.encode(EngineCoreOutputs(0, outputs, stats, start_s + 0.001 * (step + 1))))
        return frames

    async def serve(self, scope, receive, send) -> None:
        """vLLM's completions handler, its engine-facing part: add the request, stream its outputs."""
        from vllm.sampling_params import RequestOutputKind

        await receive()
        request = scope["replay.request"]
        queue = self.collector_cls(RequestOutputKind.DELTA, request.request_id)
        self.processor.add_request(request, None, None, 0, queue)
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]})
        while True:
            output = queue.get_nowait() or await queue.get()
            event = {"id": request.external_req_id, "choices": [{"index": 0, "text": output.outputs[0].text}]}
            await send(
                {
                    "type": "http.response.body",
                    "body": f"data: {COMPACT_JSON(event)}\n\n".encode(),
                    "more_body": True,
                }
            )
            if output.finished:
                break
        await send({"type": "http.response.body", "body": b"data: [DONE]\n\n", "more_body": False})

    async def run_group(self, group: int) -> None:
        """The group's B requests through their whole life, the output handler's steps between."""
        from vllm.v1.metrics.stats import IterationStats

        requests = self.requests[group]
        tasks = [asyncio.ensure_future(self.app({**SCOPE, "replay.request": r}, _receive, _send)) for r in requests]
        await asyncio.sleep(0)  # each task adds its request and waits for output
        frames = self.frames.get(group) or self.frames.setdefault(group, self._frames(requests))
        for frame in frames:
            outputs = self.decoder.decode(frame)
            self.processor.process_outputs(outputs.outputs, outputs.timestamp, IterationStats())
            self.processor.update_scheduler_stats(outputs.scheduler_stats)
            await asyncio.sleep(0)  # the requests' tasks take their outputs and send them
        await asyncio.gather(*tasks)


def _engine_core_outputs():
    from vllm.v1.engine import EngineCoreOutputs

    return EngineCoreOutputs


async def _receive() -> dict:
    return {"type": "http.request", "body": b'{"model": "tiny", "stream": true}', "more_body": False}


async def _send(message: dict) -> None:
    pass


def tokenizer(folder: Path):
    from vllm.tokenizers import get_tokenizer

    from phaselens.integrations.vllm.tiny_model import tiny_config, tiny_tokenizer

    tok = tiny_tokenizer()
    tok.save_pretrained(folder)
    tiny_config(len(tok), tok.bos_token_id, tok.eos_token_id).save_pretrained(folder)  # what vLLM reads first
    return get_tokenizer(str(folder))


def replays(groups: int) -> dict[str, Replay]:
    with tempfile.TemporaryDirectory() as folder:
        tok = tokenizer(Path(folder))
        return {name: Replay(name != "off", name == "plugin", tok, groups) for name in CONFIGS}


def loop_cpu_us(runs: dict[str, Replay], loop, groups: int, repeats: int) -> dict:
    """Loop-thread CPU per request of each configuration, best of `repeats` (alternated); each
    repeat replays the same groups (new request ids per repeat are not needed: each group finishes)."""
    best = dict.fromkeys(runs, float("inf"))
    for _ in range(repeats):
        for name, replay in runs.items():
            start = time.thread_time_ns()
            for g in range(groups):
                loop.run_until_complete(replay.run_group(g))
            best[name] = min(best[name], (time.thread_time_ns() - start) / (groups * BATCH))
    return {f"{name}_loop_cpu_us_per_request": round(ns / 1000, 1) for name, ns in best.items()}


def own_threads_ns() -> int:
    """CPU ns of this process's phaselens threads (OS names `pl-*`), from the scheduler's clock."""
    total = 0
    for task in Path("/proc/self/task").iterdir():
        try:
            if (task / "comm").read_text().startswith(THREAD_PREFIX):
                total += int((task / "schedstat").read_text().split()[0])
        except OSError:  # ended meanwhile
            continue
    return total


def paced_threads_us(replay: Replay, loop, groups: int, rate: float) -> dict:
    """The plugin's threads' CPU per request over `groups` groups started at `rate` requests a
    second, flushed at the end (its wake-up included), and the child's CPU as it reports it."""
    from phaselens.integrations.vllm import hooks

    telemetry = hooks.tracker().telemetry
    telemetry.flush()
    before, child_before = own_threads_ns(), telemetry.stats().child_cpu_ns
    start = time.monotonic()
    for g in range(groups):
        loop.run_until_complete(replay.run_group(g))
        time.sleep(max(0.0, start + (g + 1) * BATCH / rate - time.monotonic()))
    telemetry.flush()
    requests = groups * BATCH
    return {
        "plugin_threads_cpu_us_per_request": round((own_threads_ns() - before) / requests / 1000, 1),
        "plugin_child_cpu_us_per_request": round((telemetry.stats().child_cpu_ns - child_before) / requests / 1000, 1),
        "paced_requests_per_s": round(requests / (time.monotonic() - start), 1),
    }


def warm_up(runs: dict[str, Replay], loop, groups: int) -> None:
    """Each group once per configuration: its steps encoded, caches and the span-builder child warm."""
    for replay in runs.values():
        for g in range(groups):
            loop.run_until_complete(replay.run_group(g))


def _zmq_io_tids(before: set[int]) -> list[int]:
    """This process's ZMQ I/O threads (libzmq's OS name `ZMQbg/IO/N`) started since `before`: the
    first that shows up (a new thread takes its name a moment after it starts)."""
    for _ in range(100):
        tids = [
            int(task.name)
            for task in Path("/proc/self/task").iterdir()
            if int(task.name) not in before and (task / "comm").read_text().startswith("ZMQbg/IO")
        ]
        if tids:
            return tids
        time.sleep(0.01)
    raise RuntimeError("no ZMQ I/O thread showed up")


def _thread_cpu_ns(tids: list[int]) -> int:
    return sum(int(Path(f"/proc/self/task/{tid}/schedstat").read_text().split()[0]) for tid in tids)


def zmq_window(frames: list, folder: str, gap_s: float) -> tuple[int, int]:
    """`frames` (one engine step each) sent as the EngineCore sends them (PUSH, `send_multipart`,
    no copy) to a PULL socket as vLLM's API server reads them (`recv_multipart`, no copy), over IPC,
    both made by vLLM's `make_zmq_socket`, one step every `gap_s`; each side's own context: (the
    receiver's I/O thread CPU ns, the sender's) over the window."""
    import threading

    import zmq
    from vllm.utils.network_utils import make_zmq_socket

    address = f"ipc://{folder}/outputs"
    known = {int(t.name) for t in Path("/proc/self/task").iterdir()}
    receiver_ctx = zmq.Context(io_threads=1)
    pull = make_zmq_socket(receiver_ctx, address, zmq.PULL, bind=True)
    receiver_io = _zmq_io_tids(known)
    known |= set(receiver_io)
    sender_ctx = zmq.Context(io_threads=1)
    push = make_zmq_socket(sender_ctx, address, zmq.PUSH, bind=False, linger=4000)
    sender_io = _zmq_io_tids(known)

    def send_all() -> None:
        for frame in frames:
            push.send_multipart(frame, copy=False)
            time.sleep(gap_s)

    push.send_multipart([b"warm-up"])
    pull.recv_multipart()
    start = _thread_cpu_ns(receiver_io), _thread_cpu_ns(sender_io)
    sender = threading.Thread(target=send_all)
    sender.start()
    for _ in frames:
        pull.recv_multipart(copy=False)
    sender.join()
    used = _thread_cpu_ns(receiver_io) - start[0], _thread_cpu_ns(sender_io) - start[1]
    for sock in (push, pull):
        sock.close(linger=0)
    for ctx in (sender_ctx, receiver_ctx):
        ctx.term()
    return used


def zmq_io_cpu_us(runs: dict[str, Replay], groups: int, rounds: int, gap_s: float) -> dict:
    """Each configuration's steps through a ZMQ pair (`zmq_window`), alternated over `rounds`: the
    I/O threads' CPU per request, median [min, max], and the steps' bytes per request."""
    per_request: dict[str, list[tuple[float, float]]] = {name: [] for name in runs}
    with tempfile.TemporaryDirectory() as folder:
        for _ in range(rounds):
            for name, replay in runs.items():
                frames = [frame for g in range(groups) for frame in replay.frames[g]]
                used = zmq_window(frames, folder, gap_s)
                per_request[name].append(tuple(ns / (groups * BATCH) / 1000 for ns in used))
    result = {}
    for name, values in per_request.items():
        for side, index in (("receiver", 0), ("sender", 1)):
            side_values = sorted(v[index] for v in values)
            result[f"{name}_zmq_{side}_io_cpu_us_per_request"] = [
                round(statistics.median(side_values), 1),
                round(side_values[0], 1),
                round(side_values[-1], 1),
            ]
        frames = [frame for g in range(groups) for frame in runs[name].frames[g]]
        result[f"{name}_step_bytes_per_request"] = round(
            sum(len(part) for frame in frames for part in frame) / (groups * BATCH)
        )
    return result


def callgrind_child(groups: int) -> None:
    """Under callgrind: a warm-up pass, then per configuration one counted `functools.reduce`."""
    runs = replays(groups)
    loop = asyncio.new_event_loop()
    warm_up(runs, loop, groups)
    for replay in runs.values():
        functools.reduce(lambda _, g: loop.run_until_complete(replay.run_group(g)), range(groups), None)
    print(json.dumps(plugin_counters()))


def plugin_counters() -> dict:
    """What the plugin's pipeline took: a hook that failed (logged once, swallowed) shows here."""
    from phaselens.integrations.vllm import hooks

    telemetry = hooks.tracker().telemetry
    telemetry.flush()
    stats = telemetry.stats()
    return {"plugin_requests_offered": stats.requests_offered, "plugin_spans_dropped": stats.spans_dropped}


def callgrind_counts(groups: int) -> dict:
    counted = reduce_instructions(__file__, ["--groups", str(groups)])
    if counted is None:
        return {"skipped": "valgrind is not installed"}
    counts, stdout = counted
    counts = counts[-len(CONFIGS) :]  # the last dumps: imports (vLLM's among them) call functools.reduce too
    per_request = {name: n / (groups * BATCH) for name, n in zip(CONFIGS, counts, strict=True)}
    return {
        **{f"{name}_instructions_per_request": round(n) for name, n in per_request.items()},
        **{
            f"{name}_added_instructions_per_request": round(n - per_request["off"])
            for name, n in per_request.items()
            if name != "off"
        },
        **json.loads(stdout.strip().splitlines()[-1]),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--groups", type=int, default=24, help="groups of 4 requests per measurement")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--rate", type=float, default=10.0, help="requests a second of the paced run")
    parser.add_argument("--zmq-rounds", type=int, default=5, help="alternated windows of the ZMQ pair (0: none)")
    parser.add_argument("--zmq-gap-ms", type=float, default=2.0, help="time between two steps' messages")
    parser.add_argument("--callgrind", action="store_true")
    parser.add_argument("--callgrind-child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    sys.argv += VLLM_ARGV
    try:
        import vllm  # noqa: F401
    except ImportError:
        print(json.dumps({"skipped": "vLLM is not importable here: run it with .venv-vllm/bin/python"}))
        return
    if args.callgrind_child:
        callgrind_child(args.groups)
    elif args.callgrind:
        print(json.dumps(callgrind_counts(args.groups)))
    else:
        runs = replays(args.groups)
        loop = asyncio.new_event_loop()
        warm_up(runs, loop, args.groups)
        result = {"groups": args.groups, "batch": BATCH, "load_average": os.getloadavg()}
        result |= loop_cpu_us(runs, loop, args.groups, args.repeats)
        result["plugin_added_loop_cpu_us_per_request"] = round(
            result["plugin_loop_cpu_us_per_request"] - result["off_loop_cpu_us_per_request"], 1
        )
        result |= paced_threads_us(runs["plugin"], loop, args.groups, args.rate)
        result |= plugin_counters()
        if args.zmq_rounds:
            result |= zmq_io_cpu_us(runs, args.groups, args.zmq_rounds, args.zmq_gap_ms / 1000)
        print(json.dumps(result))


if __name__ == "__main__":
    main()
