"""KV transfer between a prefill and a decode instance, on loopback: what one transfer costs.

For a sequence of `--tokens` prompt tokens of the tiny model (block size 16): copy its blocks out of
a KV pool (`PagedKVCache.export_blocks`), send them with `kv_transfer.send` to a `KvReceiver` whose
handler writes them into a second pool (`import_blocks`), wait for the acknowledgement. Same-run
baseline: the same bytes through a plain socket `sendall` to a reader that only reads them, and an
ack byte back. Prints one JSON object: per transfer wall ms (median of `--repeat`), the CPU ms of
this process (both ends run in it), MB/s, and the baseline's. Wall times on a shared machine vary.

    python benchmarks/kv_transfer.py --tokens 512 --repeat 30
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import threading
import time

import torch

from phaselens.reference_server.engine import kv_transfer
from phaselens.reference_server.engine.kv_cache import PagedKVCache
from phaselens.reference_server.engine.model_loader import build_tiny

BLOCK = 16


def _pool(model) -> PagedKVCache:
    cfg = model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    kv_heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
    return PagedKVCache(cfg.num_hidden_layers, 256, BLOCK, kv_heads, head_dim, torch.float32, torch.device("cpu"))


def _phaselens(src: PagedKVCache, dst: PagedKVCache, blocks: list[int], repeat: int) -> tuple[list[float], float, int]:
    receiver = kv_transfer.KvReceiver("127.0.0.1", 0, lambda t: dst.import_blocks(blocks, t.parts))
    receiver.start()
    walls, nbytes = [], 0
    cpu0 = time.process_time()
    try:
        for i in range(repeat):
            start = time.perf_counter()
            parts = src.export_blocks(blocks)
            nbytes = sum(len(p) for p in parts)
            kv_transfer.send(receiver.address, {"transfer_id": str(i)}, parts, 30)
            walls.append(time.perf_counter() - start)
    finally:
        receiver.stop()
    return walls, (time.process_time() - cpu0) / repeat, nbytes


def _baseline(nbytes: int, repeat: int) -> tuple[list[float], float]:
    server = socket.create_server(("127.0.0.1", 0))
    payload = bytes(nbytes)

    def serve() -> None:
        for _ in range(repeat):
            conn, _ = server.accept()
            with conn:
                got = 0
                while got < nbytes:
                    got += len(conn.recv(1 << 20))
                conn.sendall(b"k")

    reader = threading.Thread(target=serve, daemon=True)
    reader.start()
    walls = []
    cpu0 = time.process_time()
    for _ in range(repeat):
        start = time.perf_counter()
        with socket.create_connection(server.getsockname()) as sock:
            sock.sendall(payload)
            sock.recv(1)
        walls.append(time.perf_counter() - start)
    reader.join(10)
    server.close()
    return walls, (time.process_time() - cpu0) / repeat


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--repeat", type=int, default=30)
    args = parser.parse_args()
    torch.set_num_threads(1)
    model = build_tiny().model
    src, dst = _pool(model), _pool(model)
    blocks = list(range(-(-args.tokens // BLOCK)))
    walls, cpu_s, nbytes = _phaselens(src, dst, blocks, args.repeat)
    base_walls, base_cpu_s = _baseline(nbytes, args.repeat)
    wall, base = statistics.median(walls), statistics.median(base_walls)
    print(
        json.dumps(
            {
                "benchmark": "kv_transfer",
                "tokens": args.tokens,
                "kv_bytes": nbytes,
                "repeat": args.repeat,
                "transfer_wall_ms_p50": round(wall * 1e3, 3),
                "transfer_cpu_ms": round(cpu_s * 1e3, 3),
                "transfer_mb_per_s": round(nbytes / wall / 1e6, 1),
                "baseline_socket_wall_ms_p50": round(base * 1e3, 3),
                "baseline_socket_cpu_ms": round(base_cpu_s * 1e3, 3),
                "baseline_mb_per_s": round(nbytes / base / 1e6, 1),
                "note": "both ends in this process; wall times on a shared machine",
            }
        )
    )


if __name__ == "__main__":
    main()
