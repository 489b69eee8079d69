"""The kernel's receive timestamp of the bytes waiting on a TCP socket, read without consuming them.

Linux stamps every received packet (software timestamp, `CLOCK_REALTIME`) once any socket asks for
it (`SO_TIMESTAMPNS`); TCP hands the stamp of the data it returns to `recvmsg` as a
`SCM_TIMESTAMPNS` control message, also with `MSG_PEEK`. So a reader whose event loop does the
`recv` itself (an asyncio transport) can still learn when its next bytes reached the kernel: peek
one byte with `recvmsg` just before the loop reads (`asyncio.BufferedProtocol.get_buffer`), on a
duplicate of the socket's descriptor (the transport's own socket object is not ours to call).

The wait is taken on one clock, the kernel's realtime, over the few milliseconds between the
packet and the peek, and moved onto the caller's monotonic clock as a duration:

    waited_ns  = realtime_now − kernel_stamp          (both CLOCK_REALTIME, one host)
    arrived_ts = clock_now − waited_ns                 (the caller's clock, e.g. time.monotonic_ns)

A wall-clock step between the packet and the peek would bend that one wait; a negative or missing
stamp gives 0 ("not observed"), never a guess. Cost: one `recvmsg` of one byte per network read,
~1.4 µs of CPU here (kernel 6.18); `time.clock_gettime_ns(CLOCK_REALTIME)` ~0.3 µs.

Which packet: TCP returns the stamp of the last packet a read copied. The server wants its request's
first bytes (peek one byte: the oldest pending packet); a client that reads the first content bytes
late may find them behind earlier bytes (the response head, a role-only chunk) in one read, so it
peeks everything pending (`latest`): the newest packet's stamp, never earlier than the content's own
arrival, so the client's read time is never overstated (at most understated, left in the residual).
"""

from __future__ import annotations

import os
import socket
import struct
import time

from phaselens.common.clocks import NOT_STAMPED, MonoClock, MonoTs

# Not exported by Python's socket module; the values of <asm-generic/socket.h> (x86-64, arm64).
SO_TIMESTAMPNS = 35
SCM_TIMESTAMPNS = SO_TIMESTAMPNS
_TIMESPEC = struct.Struct("qq")
_CMSG_BYTES = socket.CMSG_SPACE(_TIMESPEC.size)
_MAX_WAIT_NS = 60 * 10**9  # older than a minute: a stale or stepped stamp, not a wait
_LATEST_PEEK_BYTES = 64 * 1024


class KernelStamper:
    """Peeks the kernel receive stamp of a connected TCP socket's pending bytes (Linux; elsewhere
    `available` is False and every peek gives 0)."""

    __slots__ = ("_clock_ns", "_peek", "_sock")

    def __init__(self, fileno: int, clock_ns: MonoClock, latest: bool = False) -> None:
        self._clock_ns = clock_ns
        # TCP hands back the stamp of the last packet it copied: one byte gives the oldest pending
        # packet's, a peek of everything pending (up to the buffer) the newest one's
        self._peek = memoryview(bytearray(_LATEST_PEEK_BYTES if latest else 1))
        self._sock: socket.socket | None = None
        try:
            dup = socket.socket(fileno=os.dup(fileno))
        except OSError:
            return
        try:
            dup.setsockopt(socket.SOL_SOCKET, SO_TIMESTAMPNS, 1)
            dup.setblocking(False)
        except OSError:
            dup.close()
            return
        self._sock = dup

    @property
    def available(self) -> bool:
        return self._sock is not None

    def arrived_ts(self) -> MonoTs:
        """When the oldest unread bytes (`latest`: the newest) reached the kernel, on `clock_ns`; 0
        when not known."""
        return self.pending()[0]

    def pending(self) -> tuple[MonoTs, int]:
        """(`arrived_ts()`, the bytes the peek saw): the stamp dates those bytes and no later ones,
        so a reader that takes more in its next read (bytes that arrived after the peek) would date
        them too early; (0, 0) when nothing is pending or the connection is gone."""
        sock = self._sock
        if sock is None:
            return NOT_STAMPED, 0
        try:
            peeked, ancillary, _, _ = sock.recvmsg_into([self._peek], _CMSG_BYTES, socket.MSG_PEEK)
        except OSError:  # nothing pending (EAGAIN), or the connection is gone
            return NOT_STAMPED, 0
        now_real, now = time.clock_gettime_ns(time.CLOCK_REALTIME), self._clock_ns()
        for level, kind, data in ancillary:
            if level == socket.SOL_SOCKET and kind == SCM_TIMESTAMPNS and len(data) >= _TIMESPEC.size:
                sec, nsec = _TIMESPEC.unpack_from(data)
                waited = now_real - (sec * 1_000_000_000 + nsec)
                return (MonoTs(now - waited) if 0 <= waited < _MAX_WAIT_NS else NOT_STAMPED), peeked
        return NOT_STAMPED, peeked

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None


def enable_kernel_stamps(sock: socket.socket) -> bool:
    """Ask for receive stamps on a listening socket before it accepts: accepted sockets inherit the
    option, and the kernel starts stamping packets before the first request (it turns stamping on
    system-wide lazily, so the first packets after the first request for it may carry none)."""
    try:
        sock.setsockopt(socket.SOL_SOCKET, SO_TIMESTAMPNS, 1)
    except OSError:
        return False
    return True


# struct tcp_info (<linux/tcp.h>): tcpi_rtt (µs) at byte 68, tcpi_total_retrans at byte 100
_TCP_INFO_BYTES = 104
_TCPI_RTT = struct.Struct("=I")
_TCPI_RTT_AT, _TCPI_TOTAL_RETRANS_AT = 68, 100


def handshake_rtt_ns(sock: socket.socket) -> int | None:
    """The kernel's round-trip sample of a just-connected TCP socket's handshake (`TCP_INFO`
    tcpi_rtt: SYN sent → SYN-ACK received, before any data), in ns; None off Linux, or after a
    retransmission (Karn: no sample of the handshake then)."""
    try:
        info = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, _TCP_INFO_BYTES)
    except (OSError, AttributeError):
        return None
    if len(info) < _TCP_INFO_BYTES or _TCPI_RTT.unpack_from(info, _TCPI_TOTAL_RETRANS_AT)[0]:
        return None
    rtt_us: int = _TCPI_RTT.unpack_from(info, _TCPI_RTT_AT)[0]
    return rtt_us * 1000
