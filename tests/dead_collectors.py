"""Collectors that are down, in the two ways a real one is: refusing, or accepting and never answering."""

from __future__ import annotations

import contextlib
import socket
from collections.abc import Iterator


def closed_port() -> int:
    """A loopback port nothing listens on: a connection to it is refused at once."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextlib.contextmanager
def silent_port() -> Iterator[int]:
    """A loopback port whose connections the kernel completes but nobody reads or answers: an
    exporter sending there waits its whole timeout, as on a hung collector."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen(128)
        yield sock.getsockname()[1]
