"""Incremental detokenization, the reasoning/content split and stop strings, per request.

Token ids arrive one at a time; text goes out only once it is final:
- a multi-byte character split over tokens is held until complete (the windowed decode of vLLM:
  decode `ids[prefix:]` and `ids[prefix:read]`, emit the difference unless it ends in U+FFFD);
- with stop strings, the last `max(len(stop)) − 1` characters are held back, because they may be
  the start of a stop string that the next token completes; a stop string is never emitted.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

REPLACEMENT_CHAR = "\ufffd"
BYTE_OFFSET = 3  # ByT5: ids 0-2 are pad, eos, unk; byte b is id b + 3

Decode = Callable[[list[int]], str]


def decode_bytes(ids: list[int]) -> str:
    """ByT5 ids → text, ~50× faster than `ByT5Tokenizer.decode` (which rebuilds its special-token
    list on every call); special and extra ids are skipped, invalid UTF-8 becomes U+FFFD."""
    return bytes(i - BYTE_OFFSET for i in ids if BYTE_OFFSET <= i < BYTE_OFFSET + 256).decode("utf-8", "replace")


def tokenizer_decoder(tokenizer: object) -> Decode:
    """The generic decode: the tokenizer's own, without special tokens."""
    return lambda ids: tokenizer.decode(ids, skip_special_tokens=True)


@dataclass(slots=True)
class IncrementalDecoder:
    decode: Decode
    ids: list[int] = field(default_factory=list)
    prefix_offset: int = 0
    read_offset: int = 0

    def push(self, token_id: int) -> str:
        self.ids.append(token_id)
        return self._advance(final=False)

    def flush(self) -> str:
        return self._advance(final=True)

    def _advance(self, final: bool) -> str:
        prefix = self.decode(self.ids[self.prefix_offset : self.read_offset])
        full = self.decode(self.ids[self.prefix_offset :])
        if len(full) <= len(prefix) or (full.endswith(REPLACEMENT_CHAR) and not final):
            return ""
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        return full[len(prefix) :]


@dataclass(slots=True)
class TextDelta:
    reasoning: str = ""
    content: str = ""
    stopped: bool = False


@dataclass(slots=True)
class TextTracker:
    """Turns output ids into reasoning and content deltas; detects stop strings in the content."""

    decode: Decode
    reasoning_tokens: int = 0
    stop: tuple[str, ...] = ()
    reasoning_decoder: IncrementalDecoder = field(init=False)  # both made by __post_init__
    content_decoder: IncrementalDecoder = field(init=False)
    content: str = ""
    emitted: int = 0
    pushed: int = 0
    stopped: bool = False

    def __post_init__(self) -> None:
        self.reasoning_decoder = IncrementalDecoder(self.decode)
        self.content_decoder = IncrementalDecoder(self.decode)

    def push(self, token_id: int) -> TextDelta:
        if self.stopped:
            return TextDelta(stopped=True)
        index, self.pushed = self.pushed, self.pushed + 1
        if index < self.reasoning_tokens:
            text = self.reasoning_decoder.push(token_id)
            if index == self.reasoning_tokens - 1:
                text += self.reasoning_decoder.flush()
            return TextDelta(reasoning=text)
        self.content += self.content_decoder.push(token_id)
        return self._release(final=False)

    def finish(self) -> TextDelta:
        """The sequence ended: release everything held (nothing after a stop string)."""
        if self.stopped:
            return TextDelta(stopped=True)
        delta = TextDelta(reasoning=self.reasoning_decoder.flush() if self.pushed < self.reasoning_tokens else "")
        self.content += self.content_decoder.flush()
        released = self._release(final=True)
        delta.content, delta.stopped = released.content, released.stopped
        return delta

    def _release(self, final: bool) -> TextDelta:
        if self.stop:
            hit = self._find_stop()
            if hit >= 0:
                self.content, self.stopped = self.content[:hit], True
                return TextDelta(content=self._emit(len(self.content)), stopped=True)
        hold = 0 if final or not self.stop else max(map(len, self.stop)) - 1
        return TextDelta(content=self._emit(len(self.content) - hold))

    def _find_stop(self) -> int:
        start = max(0, self.emitted - max(map(len, self.stop)))
        hits = [i for i in (self.content.find(s, start) for s in self.stop) if i >= 0]
        return min(hits) if hits else -1

    def _emit(self, upto: int) -> str:
        if upto <= self.emitted:
            return ""
        text, self.emitted = self.content[self.emitted : upto], upto
        return text
