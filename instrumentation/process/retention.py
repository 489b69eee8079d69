"""The frames a span-builder child may still lose, kept by the serving process (`shipper.ProcessSink`).

A record's frame stays here from encoding until the child reports it built and exported
(`records_safe`, see span_process): a child that dies takes nothing the serving process cannot
re-send to its replacement. Oldest first; the first `sent` frames were written to the current child,
the rest wait for one (a dead child within its restart backoff). Bounded by bytes: past
`limit_bytes` the oldest go — a frame never written is then dropped, one written is only no longer
replayable (lost if that child dies before reporting it). Used by the shipper thread only.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from itertools import islice

# ~64k requests at ~1 KiB a frame: minutes of records at a few hundred requests/s, enough to ride out
# the longest restart backoff (30 s); memory a serving process can spare, and a replay the child
# builds in about a minute
RETAIN_BYTES = 64 << 20


@dataclass(slots=True)
class Evicted:
    """Frames that went past the bound: `sent` were written to the current child, `unsent` never were."""

    sent: int = 0
    unsent: int = 0


@dataclass(slots=True)
class Retained:
    limit_bytes: int = RETAIN_BYTES
    frames: deque[bytes] = field(default_factory=deque)
    size_bytes: int = 0
    sent: int = 0  # the first `sent` frames were written to the current child

    def add(self, frames: list[bytes]) -> Evicted:
        """Keep `frames` (after the others); evict the oldest while over the bound."""
        self.frames.extend(frames)
        self.size_bytes += sum(map(len, frames))
        evicted = Evicted()
        while self.size_bytes > self.limit_bytes and self.frames:
            self.size_bytes -= len(self.frames.popleft())
            if self.sent:
                self.sent -= 1
                evicted.sent += 1
            else:
                evicted.unsent += 1
        return evicted

    def release(self, count: int) -> int:
        """Forget the oldest `count` sent frames (the child reported them safe); how many went."""
        count = max(0, min(count, self.sent))
        for _ in range(count):
            self.size_bytes -= len(self.frames.popleft())
        self.sent -= count
        return count

    def unsent(self) -> list[bytes]:
        return list(islice(self.frames, self.sent, None))
