"""The engine in its own process vs a thread beside the event loop: the same load through
`phaselens serve --engine thread` and `--engine process`, alternating, in the same run. Prints ONE
JSON object.

Per mode and round: a fresh stack (embedded ClickHouse, collector, `phaselens serve --engine MODE`
with the tiny model), `phaselens bench --concurrency C --input-len uniform:32:256 --output-len 24
--ignore-eos` (the load of benchmarks/residual_under_load.py), then from the stored rows p50/p90 of
client TTFT and the server terms where the split shows (`first_token` holds the engine → API hop
in process mode, `loop_wait` the event loop's lateness in taking the first text), the bench's output
tokens/s, and the CPU the server used during the load, split by process:

    cpu_ms_per_request = Δ(utime + stime) of the serving process tree over the load / requests
                         (API process, engine process, span-builder child; start-up excluded)

The two modes alternate `--rounds` times and every row of every round counts, so load from other
processes lands on both; the same-run baseline is the thread mode. `frames` is the transport's own
CPU per request per step (16 requests a step, 5,000 steps, process_time): the engine side's stamp
and encode, the API side's read and decode (without the replay onto handles), and the bytes.

    .venv/bin/python benchmarks/engine_process.py [--concurrency 8] [--requests 48] [--rounds 2]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.residual_under_load import load_argv
from phaselens.common.quantile import quantile
from phaselens.stack import Stack

MODES = ("thread", "process")
TERMS = (
    "client_ttft_ms",
    "server_ttft_ms",
    "first_token_ms",
    "held_back_ms",
    "loop_wait_ms",
    "first_chunk_ms",
    "server_ttfc_ms",
    "residual_ms",
)
_TICK_S = 1 / os.sysconf("SC_CLK_TCK")


def process_cpu_s(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) * _TICK_S  # utime, stime (fields 14, 15 of stat)


def process_tree(pid: int) -> dict[int, str]:
    """pid → its role (api, engine, builder) for the server and its descendants."""
    tree, todo = {pid: "api"}, [pid]
    while todo:
        parent = todo.pop()
        for task in Path(f"/proc/{parent}/task").iterdir():
            for child in map(int, (task / "children").read_text().split()):
                cmdline = Path(f"/proc/{child}/cmdline").read_bytes()
                tree[child] = "engine" if b"engine_core" in cmdline else "builder"
                todo.append(child)
    return tree


def tree_cpu_s(tree: dict[int, str]) -> dict[str, float]:
    cpu = dict.fromkeys(("api", "engine", "builder"), 0.0)
    for pid, role in tree.items():
        cpu[role] += process_cpu_s(pid)
    return cpu


def run(mode: str, concurrency: int, requests: int) -> tuple[list[dict], dict]:
    with (
        tempfile.TemporaryDirectory() as data,
        Stack(data, server_args=("--max-num-seqs", "16", "--engine", mode)) as stack,
    ):
        assert stack.server is not None
        tree = process_tree(stack.server.proc.pid)
        before, wall = tree_cpu_s(tree), time.perf_counter()
        figures = os.path.join(data, "bench.json")
        if stack.bench([*load_argv(concurrency, requests), "--json", figures], timeout_s=600) != 0:
            raise SystemExit(f"bench failed ({mode})")
        wall = time.perf_counter() - wall
        after = tree_cpu_s(tree)
        stack.server.stop(30)
        stack.collector.stop(30)
        with open(figures) as f:
            summary = json.load(f)["summary"]
        with stack.client() as ch:
            rows = list(
                ch.query(
                    f"SELECT {', '.join(TERMS)} FROM {stack.database}.phaselens_request_facts "
                    "WHERE client_ttft_ms IS NOT NULL"
                ).named_results()
            )
    load = {
        "wall_s": wall,
        "output_tokens_per_s": summary["throughput"]["output_tokens_per_s"],
        "requests": summary["requests"]["completed"],
        "cpu_s": {role: after[role] - before[role] for role in after},
    }
    return rows, load


def frame_cost(steps: int = 5000, batch: int = 16) -> dict:
    from phaselens.reference_server.engine.sequence import SeqOutput
    from phaselens.reference_server.process import engine_wire as wire
    from phaselens.reference_server.process.engine_core import StampLog

    dirty: list[StampLog] = []
    logs = [StampLog(i, dirty) for i in range(batch)]
    out = SeqOutput(content="a", new_tokens=1, output_tokens=5)
    step = ((1, 2, 3, 4, 5, 6, 7, 8), list(range(batch)))
    start, frames = time.process_time(), []
    for _ in range(steps):
        entries = []
        for log in logs:
            log.token(1)
            entries.append((log.req_id, log.take(), wire.encode_output(out)))
        dirty.clear()
        frames.append(wire.frame((wire.OUTPUTS, entries, [step], (batch, 0, 10))))
    encode_s, data = time.process_time() - start, b"".join(frames)
    reader, start = wire.FrameReader(), time.process_time()
    for at in range(0, len(data), 1 << 16):
        for message in reader.feed(data[at : at + (1 << 16)]):
            for _, _, fields in message[1]:
                wire.decode_output(fields)
    decode_s, n = time.process_time() - start, steps * batch
    return {
        "engine_us_per_request_step": round(encode_s / n * 1e6, 2),
        "api_us_per_request_step": round(decode_s / n * 1e6, 2),
        "bytes_per_request_step": round(len(data) / n, 1),
    }


def _stats(values: list) -> dict:
    ordered = sorted(v for v in values if v is not None)
    if not ordered:
        return {"n": 0}
    return {"n": len(ordered), "p50": round(quantile(ordered, 0.5), 2), "p90": round(quantile(ordered, 0.9), 2)}


def summarize(rows: list[dict], loads: list[dict]) -> dict:
    requests = sum(load["requests"] for load in loads)
    cpu = {role: sum(load["cpu_s"][role] for load in loads) for role in loads[0]["cpu_s"]}
    return {
        **{term: _stats([r[term] for r in rows]) for term in TERMS},
        "output_tokens_per_s": [round(load["output_tokens_per_s"], 1) for load in loads],
        "cpu_ms_per_request": {
            "total": round(sum(cpu.values()) / requests * 1e3, 2),
            **{role: round(seconds / requests * 1e3, 2) for role, seconds in cpu.items()},
        },
        "load_wall_s": [round(load["wall_s"], 2) for load in loads],
        "requests": requests,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--requests", type=int, default=48)
    parser.add_argument("--rounds", type=int, default=2, help="alternating runs per mode")
    parser.add_argument("--frames-only", action="store_true", help="only the transport's CPU per request-step")
    args = parser.parse_args()
    if args.frames_only:
        print(json.dumps({"benchmark": "engine_process", "frames": frame_cost()}))
        return
    start, cpu = time.monotonic(), os.times()
    rows: dict[str, list[dict]] = {mode: [] for mode in MODES}
    loads: dict[str, list[dict]] = {mode: [] for mode in MODES}
    for _ in range(args.rounds):
        for mode in MODES:
            got, load = run(mode, args.concurrency, args.requests)
            rows[mode] += got
            loads[mode].append(load)
    result: dict[str, object] = {
        "benchmark": "engine_process",
        "concurrency": args.concurrency,
        "load": "--input-len uniform:32:256 --output-len 24 --ignore-eos, tiny model, --max-num-seqs 16",
        "baseline": "engine thread (the same run)",
        **{mode: summarize(rows[mode], loads[mode]) for mode in MODES},
        "frames": frame_cost(),
    }
    end_cpu = os.times()
    result["wall_s"] = round(time.monotonic() - start, 1)
    result["orchestrator_cpu_s"] = round(end_cpu.user + end_cpu.system - cpu.user - cpu.system, 1)
    result["note"] = "wall-clock figures; on a shared 2-core machine they are disturbed by other load"
    print(json.dumps(result))


if __name__ == "__main__":
    main()
