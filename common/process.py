"""Child-process and port helpers shared by every part that starts a server or a child."""

from __future__ import annotations

import ctypes
import os
import random
import signal
import socket
import subprocess
from collections.abc import Callable
from typing import TypeVar

LOOPBACK = "127.0.0.1"
# Starts on a port from free_port(): another process may bind it before the child does, so a child
# that then exits is started again on fresh ports, this many times in all.
BIND_ATTEMPTS = 3
_RESTARTABLE_FLOOR = 20000  # restartable_port's lowest pick: above the well-known servers' ports

T = TypeVar("T")


def on_fresh_ports(start: Callable[[], T], lost_port: Callable[[BaseException], bool]) -> T:
    """`start()`, run again (`BIND_ATTEMPTS` runs in all) while its failure says a port picked for it
    was taken before the child bound it (`lost_port`); `start` picks fresh ports each run."""
    attempt = 1
    while True:
        try:
            return start()
        except BaseException as exc:
            if attempt == BIND_ATTEMPTS or not lost_port(exc):
                raise
        attempt += 1


def free_port(host: str = LOOPBACK) -> int:
    """A port the OS just found free on `host` (another process may still take it before we bind:
    a child that can bind port 0 and name its port, like the collector, is better off without it)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def restartable_port(host: str = LOOPBACK) -> int:
    """A free port below the kernel's ephemeral range, for a server that is stopped and started again
    on its ports (a supervisor's restart, a fault scenario). A port from `free_port` lies in that
    range, where the kernel also draws every outgoing connection's local port: between the stop and
    the restart one may take it, and the restart fails. Below the range only an explicit bind can."""
    low = _ephemeral_low()
    if low > _RESTARTABLE_FLOOR + 1024:  # else no room below the range: a port as free_port gives
        for _ in range(64):
            port = random.randrange(_RESTARTABLE_FLOOR, low)
            with socket.socket() as s:
                try:
                    s.bind((host, port))
                except OSError:
                    continue
                return port
    return free_port(host)


def _ephemeral_low() -> int:
    """The lowest port of `net.ipv4.ip_local_port_range` (Linux's default when it cannot be read)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def port_in_use(port: int, host: str = LOOPBACK) -> bool:
    with socket.socket() as s:
        return s.connect_ex((host, port)) == 0


def die_with_parent(parent_pid: int) -> None:
    """`preexec_fn` (Linux): SIGTERM this child when its parent dies, even by SIGKILL, so a crashed
    test or demo leaves no server behind."""
    PR_SET_PDEATHSIG = 1
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    if os.getppid() != parent_pid:  # the parent died before prctl took effect
        os._exit(1)


def terminate(proc: subprocess.Popen, timeout_s: float) -> int:
    """SIGTERM, then SIGKILL after `timeout_s`; returns the exit code."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return proc.returncode
