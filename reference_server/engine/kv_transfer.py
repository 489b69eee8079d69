"""The KV-transfer wire protocol between a prefill and a decode instance (one TCP connection per
transfer; docs/disaggregation.md).

    sender → receiver   MAGIC (8 bytes) · header length (u32, big-endian) · header (JSON)
                        · for each tensor in `header["part_bytes"]`: its raw bytes
    receiver → sender   ack length (u32) · ack (JSON: {"ok": bool, "bytes": received, "error": str})

The header names the transfer, the tokens (prompt + the first sampled token), the KV layout and
the byte length of every tensor; the receiver checks the layout against its own cache before it
reads the bytes, writes them into its KV pool, and only then acknowledges. `received_bytes` in the
ack is what the receiver read, so a sender can check it against what it sent.
"""

from __future__ import annotations

import contextlib
import json
import socket
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from phaselens.common.clocks import NOT_STAMPED, MonoTs, monotonic_ts

Check = Callable[[dict[str, Any]], None]  # refuses a header (ValueError) before its bytes are read

MAGIC = b"PLKV0001"
MAX_HEADER_BYTES = 1 << 20
MAX_KV_BYTES = 1 << 34  # 16 GiB: a bound against a garbled length, not a capacity
_LEN = struct.Struct(">I")


class KvTransferError(RuntimeError):
    """The transfer failed (connection, protocol, or the receiver refused it); the message says which."""


@dataclass(slots=True)
class Transfer:
    """A received transfer: its header and its tensors' bytes, in order."""

    header: dict[str, Any]
    parts: list[bytes]
    accepted_ts: MonoTs = NOT_STAMPED  # the connection accepted (monotonic ns of the receiver)

    @property
    def nbytes(self) -> int:
        return sum(len(p) for p in self.parts)


def _read_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        k = sock.recv_into(view[got:], n - got)
        if not k:
            raise KvTransferError(f"connection closed after {got} of {n} bytes")
        got += k
    return bytes(buf)


def _read_json(sock: socket.socket, limit: int) -> dict[str, Any]:
    (length,) = _LEN.unpack(_read_exact(sock, _LEN.size))
    if length > limit:
        raise KvTransferError(f"JSON frame of {length} bytes exceeds {limit}")
    try:
        value = json.loads(_read_exact(sock, length))
    except ValueError as exc:
        raise KvTransferError(f"malformed JSON frame: {exc}") from None
    if not isinstance(value, dict):
        raise KvTransferError("JSON frame is not an object")
    return value


def _json_frame(value: dict[str, Any]) -> bytes:
    raw = json.dumps(value, separators=(",", ":")).encode()
    return _LEN.pack(len(raw)) + raw


def send(address: tuple[str, int], header: dict[str, Any], parts: list[bytes], timeout_s: float) -> dict[str, Any]:
    """Send one transfer and wait for its acknowledgement; returns the ack (`ok` true). Raises
    KvTransferError on a refused transfer, OSError on a connection failure or timeout."""
    header = {**header, "part_bytes": [len(p) for p in parts]}
    with socket.create_connection(address, timeout=timeout_s) as sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            sock.sendall(MAGIC + _json_frame(header))
            for part in parts:
                sock.sendall(part)
        except OSError:  # the receiver may have refused the header and stopped reading: its reason
            ack = _read_json(sock, MAX_HEADER_BYTES)
            raise KvTransferError(
                f"the decode instance refused the KV: {ack.get('error', 'no reason given')}"
            ) from None
        ack = _read_json(sock, MAX_HEADER_BYTES)
    if not ack.get("ok"):
        raise KvTransferError(f"the decode instance refused the KV: {ack.get('error', 'no reason given')}")
    return ack


def receive(sock: socket.socket, check: Check | None = None) -> Transfer:
    """Read one transfer (header, then its bytes) from an accepted connection; `check(header)` may
    refuse it (ValueError) before any of its bytes are read."""
    if _read_exact(sock, len(MAGIC)) != MAGIC:
        raise KvTransferError("not a phaselens KV transfer (bad magic)")
    header = _read_json(sock, MAX_HEADER_BYTES)
    sizes = header.get("part_bytes")
    if not isinstance(sizes, list) or not all(isinstance(n, int) and n >= 0 for n in sizes):
        raise KvTransferError("header.part_bytes must be a list of byte counts")
    if sum(sizes) > MAX_KV_BYTES:
        raise KvTransferError(f"transfer of {sum(sizes)} bytes exceeds {MAX_KV_BYTES}")
    if check is not None:
        check(header)
    return Transfer(header, [_read_exact(sock, n) for n in sizes])


Handler = Callable[[Transfer], None]  # writes the KV where it belongs; raises ValueError to refuse it


class KvReceiver:
    """Listens for transfers; each connection gets a thread that reads it (`check` on its header
    first), hands it to `handler` and acknowledges (`ok` false with the error when either raised)."""

    def __init__(
        self, host: str, port: int, handler: Handler, timeout_s: float = 30.0, check: Check | None = None
    ) -> None:
        self._handler, self._check = handler, check
        self._timeout_s = timeout_s
        self._sock = socket.create_server((host, port))
        self._stopping = False
        self._thread = threading.Thread(target=self._accept, name="kv-receiver", daemon=True)

    @property
    def address(self) -> tuple[str, int]:
        host, port = self._sock.getsockname()[:2]
        return host, port

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stopping = True
        with contextlib.suppress(OSError):  # not connected: nothing to shut down
            self._sock.shutdown(socket.SHUT_RDWR)
        self._sock.close()
        self._thread.join(5)

    def _accept(self) -> None:
        while not self._stopping:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), name="kv-receive", daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        accepted_ts = monotonic_ts()
        with conn:
            conn.settimeout(self._timeout_s)
            try:
                transfer = receive(conn, self._check)
                transfer.accepted_ts = accepted_ts
            except (KvTransferError, OSError, ValueError) as exc:
                self._ack(conn, {"ok": False, "error": str(exc)})
                _discard(conn)
                return
            try:
                self._handler(transfer)
                ack: dict[str, Any] = {"ok": True, "bytes": transfer.nbytes}
            except (ValueError, RuntimeError) as exc:  # a refusal goes back to the sender, named
                ack = {"ok": False, "error": str(exc), "bytes": transfer.nbytes}
            self._ack(conn, ack)

    @staticmethod
    def _ack(conn: socket.socket, ack: dict[str, Any]) -> None:
        with contextlib.suppress(OSError):  # the sender is gone: its own timeout or error reports the transfer
            conn.sendall(_json_frame(ack))


def _discard(conn: socket.socket, limit_s: float = 2.0) -> None:
    """After a refusal: read and drop what the sender still sends (for at most `limit_s`), so that
    closing does not reset the connection before the sender has read the refusal."""
    with contextlib.suppress(OSError):
        conn.shutdown(socket.SHUT_WR)
        conn.settimeout(limit_s)
        deadline = time.monotonic() + limit_s
        while time.monotonic() < deadline and conn.recv(1 << 16):
            pass
