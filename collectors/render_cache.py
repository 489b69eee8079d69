"""Rows the receiver already rendered, keyed by spool position, so the writer does not decode twice.

Bounded by a span count: past it the receiver keeps nothing and the writer renders from the
spool (as it does after a restart)."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field


@dataclass(slots=True)
class RenderCache:
    max_spans: int = 1_000_000
    _entries: dict = field(default_factory=dict, init=False)
    _spans: int = field(default=0, init=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, init=False)

    def put(self, position: tuple[int, int], rows: list[tuple]) -> None:
        with self._lock:
            if self._spans + len(rows) <= self.max_spans:
                self._entries[position] = rows
                self._spans += len(rows)

    def pop(self, position: tuple[int, int]) -> list[tuple] | None:
        with self._lock:
            rows = self._entries.pop(position, None)
            if rows is not None:
                self._spans -= len(rows)
            return rows
