"""Blocks the receiver already rendered and encoded, keyed by spool position, so the writer does
not decode twice.

Bounded by a span count (a block is ~600 bytes a span: the default bound is ~150 MB, five writer
batches): past it the receiver keeps nothing and the writer renders from the spool (as it does
after a restart)."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field


@dataclass(slots=True)
class RenderCache:
    max_spans: int = 250_000
    _entries: dict = field(default_factory=dict, init=False)
    _spans: int = field(default=0, init=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, init=False)

    def put(self, position: tuple[int, int], block: bytes, spans: int) -> None:
        with self._lock:
            if self._spans + spans <= self.max_spans:
                self._entries[position] = (block, spans)
                self._spans += spans

    def pop(self, position: tuple[int, int]) -> bytes | None:
        with self._lock:
            entry = self._entries.pop(position, None)
            if entry is None:
                return None
            self._spans -= entry[1]
            return entry[0]
