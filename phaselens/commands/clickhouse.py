"""`phaselens clickhouse`: run the embedded ClickHouse server in the foreground until SIGTERM/Ctrl-C."""

from __future__ import annotations

import signal
import sys
import threading

from phaselens.storage.embedded import EmbeddedClickHouse, EmbeddedClickHouseError


def register(subparsers) -> None:
    parser = subparsers.add_parser("clickhouse", help="run an embedded ClickHouse server (loopback only)")
    parser.add_argument("--data", required=True, metavar="DIR", help="data directory (kept across restarts)")
    parser.add_argument("--http-port", type=int, default=8123)
    parser.add_argument("--tcp-port", type=int, default=9000)
    parser.set_defaults(func=run)


def run(args) -> int:
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    server = EmbeddedClickHouse(args.data, http_port=args.http_port, tcp_port=args.tcp_port)
    try:
        server.start()
    except EmbeddedClickHouseError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    try:
        print(f"READY clickhouse {server.url}", flush=True)
        while not stop.is_set() and server.running():
            stop.wait(0.5)
        return 0 if stop.is_set() else 1
    finally:
        server.stop()
