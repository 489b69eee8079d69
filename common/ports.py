"""Listening ports that rebind at once after a crash, and a clear error when one is really taken.

A process that dies (SIGKILL included) leaves its accepted connections in TIME_WAIT/FIN_WAIT for up
to a minute; without SO_REUSEADDR a restart on the same port fails with EADDRINUSE all that time.
On Linux SO_REUSEADDR only lifts that: a port with a live LISTEN socket still refuses the bind.
SO_REUSEPORT is never set (it would let two live processes share a port and split its traffic).
When a bind fails, the owner is looked up best-effort: /proc/net/tcp{,6} gives the inode of the
listening socket, /proc/<pid>/fd the process that holds it (only ours, unless we are root).
"""

from __future__ import annotations

import errno
import os
import socket

_LISTEN = "0A"  # TCP state in /proc/net/tcp


class PortInUse(OSError):
    """A port another live process listens on; the message names the port and, if known, the owner."""


def bind_reusable(sock: socket.socket, host: str, port: int, what: str) -> None:
    """SO_REUSEADDR, then bind; EADDRINUSE becomes PortInUse naming `what`, the port and its owner."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        if exc.errno == errno.EADDRINUSE:
            raise port_in_use_error(host, port, what) from None
        raise


def port_in_use_error(host: str, port: int, what: str) -> PortInUse:
    owner = listener_owner(port)
    by = f" by {owner}" if owner else ""
    error = PortInUse(f"cannot listen for {what} on {host}:{port}: the port is in use{by}")
    error.errno = errno.EADDRINUSE  # set apart from the message, which then reads without "[Errno 98]"
    return error


def listener_owner(port: int) -> str | None:
    """'pid N (command line)' of a process listening on TCP `port`, 'a socket with no visible process'
    when only the socket is found, or None when nothing listens there."""
    inodes = _listening_inodes(port)
    if not inodes:
        return None
    targets = {f"socket:[{inode}]" for inode in inodes}
    for pid in (p for p in os.listdir("/proc") if p.isdigit()):
        if _holds_any(pid, targets):
            return f"pid {pid} ({_command_line(pid)})"
    return "a socket with no visible process"


def listens(pid: int, port: int) -> bool:
    """Whether process `pid` holds a socket listening on TCP `port`."""
    inodes = _listening_inodes(port)
    return bool(inodes) and _holds_any(str(pid), {f"socket:[{inode}]" for inode in inodes})


def _listening_inodes(port: int) -> set[str]:
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as f:
                lines = f.readlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if fields[3] == _LISTEN and int(fields[1].rsplit(":", 1)[1], 16) == port:
                inodes.add(fields[9])
    return inodes


def _holds_any(pid: str, targets: set[str]) -> bool:
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:  # gone, or not ours to look at
        return False
    for fd in fds:
        try:
            if os.readlink(f"/proc/{pid}/fd/{fd}") in targets:
                return True
        except OSError:
            continue
    return False


def _command_line(pid: str, limit: int = 160) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            text = " ".join(f.read().decode(errors="replace").replace("\0", " ").split())
    except OSError:
        return "?"
    return text if len(text) <= limit else text[: limit - 1] + "…"
