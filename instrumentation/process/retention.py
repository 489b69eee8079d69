"""The frames a span-builder child may still lose, kept by the serving process (`shipper.ProcessSink`).

A record's frame stays here from encoding until the child reports it built and exported
(`records_safe`, see span_process): a child that dies takes nothing the serving process cannot
re-send to its replacement. Oldest first; the first `sent` frames were written to the current child,
the rest wait for one (a dead child within its restart backoff). Bounded by bytes: past
`limit_bytes` the oldest go — a frame never written is then dropped, one written is only no longer
replayable (lost if that child dies before reporting it). Used by the shipper thread only.

Frames are kept as the shipper packed them, a drain's in one bytes with their end offsets
(`wire.pack`): no bytes object per frame to make, keep, count and join.
"""

from __future__ import annotations

from bisect import bisect_left
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

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
class _Chunk:
    """Frames end to end in `data`, frame i ending at `ends[i]`; those before `first` are gone."""

    data: bytes
    ends: Sequence[int]
    first: int = 0

    def start(self, index: int) -> int:
        """Where frame `index` starts in `data`."""
        return self.ends[index - 1] if index else 0

    def left(self) -> int:
        return len(self.ends) - self.first


@dataclass(slots=True)
class Retained:
    limit_bytes: int = RETAIN_BYTES
    chunks: deque[_Chunk] = field(default_factory=deque)
    frames: int = 0  # kept
    size_bytes: int = 0
    sent: int = 0  # the first `sent` frames were written to the current child

    def add(self, data: bytes, ends: Sequence[int]) -> Evicted:
        """Keep the frames in `data` (frame i ends at `ends[i]`) after the others; evict the oldest
        while over the bound."""
        if ends:
            self.chunks.append(_Chunk(data, ends))
            self.frames += len(ends)
            self.size_bytes += ends[-1]
        evicted = Evicted()
        while self.size_bytes > self.limit_bytes:
            head = self.chunks[0]
            # the fewest oldest frames of the head chunk that bring the size within the bound
            over = head.start(head.first) + self.size_bytes - self.limit_bytes
            count = min(bisect_left(head.ends, over, head.first) + 1 - head.first, head.left())
            sent = min(count, self.sent)
            self.sent -= sent
            evicted.sent += sent
            evicted.unsent += count - sent
            self._forget(count)
        return evicted

    def release(self, count: int) -> int:
        """Forget the oldest `count` sent frames (the child reported them safe); how many went."""
        count = max(0, min(count, self.sent))
        self._forget(count)
        self.sent -= count
        return count

    def _forget(self, count: int) -> None:
        while count:
            head = self.chunks[0]
            gone = min(count, head.left())
            start = head.start(head.first)
            head.first += gone
            self.size_bytes -= head.start(head.first) - start
            self.frames -= gone
            count -= gone
            if not head.left():
                self.chunks.popleft()

    def unsent(self) -> list[bytes | memoryview]:
        """The frames not yet written, as (parts of) the chunks that hold them."""
        skip, parts = self.sent, []
        for chunk in self.chunks:
            if skip >= chunk.left():
                skip -= chunk.left()
                continue
            offset = chunk.start(chunk.first + skip)
            parts.append(memoryview(chunk.data)[offset:] if offset else chunk.data)
            skip = 0
        return parts
