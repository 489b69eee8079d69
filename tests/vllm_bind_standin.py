"""A stand-in for `vllm serve` that binds its port as vLLM does, for the launcher's port-race test (a
real vLLM start takes ~45 s on two cores).

`python tests/vllm_bind_standin.py [vllm serve arguments]`: reads --host and --port, binds them as
vLLM's `create_server_socket` does (SO_REUSEADDR, then bind, before anything else: a port bound by
another socket ends the run with `OSError: [Errno 98] Address already in use`, as vLLM's does), then
answers GET /health with 200 until SIGTERM.
"""

from __future__ import annotations

import argparse
import socket
import sys
from http.server import BaseHTTPRequestHandler, HTTPServer


class Health(BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        self.send_response(200 if self.path == "/health" else 404)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--host", required=True)
    parser.add_argument("--port", type=int, required=True)
    args, _ = parser.parse_known_args(argv)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((args.host, args.port))  # raises, uncaught, as in vLLM
    server = HTTPServer((args.host, args.port), Health, bind_and_activate=False)
    server.socket.close()
    server.socket = sock
    server.server_activate()
    print(f"serving on {args.host}:{args.port}", flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main(sys.argv[1:])
