"""Engine thread → event loop, one wake-up per engine step rather than per token.

`call_soon_threadsafe` writes a byte to the loop's self-pipe on every call: per token, 8 streams
cost 8 writes, 8 GIL hand-offs and up to 8 loop wake-ups a step (8 % of the engine thread's samples
under the peers' load). A `Mailbox` collects what arrives while the loop has not yet run its last
delivery and schedules one delivery for the lot, so the tokens of one step reach the loop together,
in the order they were handed out.
"""

from __future__ import annotations

import asyncio
import threading
import weakref
from collections.abc import Callable
from typing import Any

_mailboxes: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, Mailbox] = weakref.WeakKeyDictionary()


class Mailbox:
    """Calls `fn(arg)` on `loop` for each `post(fn, arg)` from other threads, in order."""

    __slots__ = ("__weakref__", "_lock", "_pending", "loop")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self._lock = threading.Lock()
        self._pending: list[tuple[Callable[[Any], object], Any]] | None = None  # None: no delivery scheduled

    @classmethod
    def of(cls, loop: asyncio.AbstractEventLoop) -> Mailbox:
        """The loop's one mailbox (made on first use)."""
        box = _mailboxes.get(loop)
        if box is None:
            box = _mailboxes[loop] = cls(loop)
        return box

    def post(self, fn: Callable[[Any], object], arg: Any) -> None:
        """Raises RuntimeError when the loop is closed (as call_soon_threadsafe does)."""
        with self._lock:
            if self._pending is not None:  # a delivery is scheduled and has not run yet: ride along
                self._pending.append((fn, arg))
                return
            self._pending = [(fn, arg)]
        try:
            self.loop.call_soon_threadsafe(self._deliver)
        except RuntimeError:
            with self._lock:
                self._pending = None
            raise

    def _deliver(self) -> None:
        with self._lock:
            pending, self._pending = self._pending or [], None
        for fn, arg in pending:
            fn(arg)
