"""Server side of Server-Sent Events: the bytes an OpenAI-compatible server streams. (The client's
parser is `phaselens.instrumentation.client.sse`; the end-of-stream sentinel is defined there, once.)"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass

from phaselens.instrumentation.client import DONE

DONE_EVENT = f"data: {DONE}\n\n".encode()
_MARK = "\x00"  # stands in for the text while the frame is encoded once


def encode_event(obj) -> bytes:
    """One `data:` event carrying `obj` as compact JSON (what OpenAI-compatible servers stream)."""
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


@dataclass(slots=True)
class TextEvent:
    """`encode_event(body(text))` for bodies that differ only in one string, the last string of the
    body: its fixed bytes are encoded once, the text per event, byte for byte the same

        event = prefix + json.dumps(text) + suffix
    """

    prefix: bytes
    suffix: bytes

    @classmethod
    def of(cls, body: Callable[[str], dict]) -> TextEvent:
        # rpartition: the text is the body's last string, so a marker inside an earlier field
        # (a model name sent by the client) cannot be taken for it
        prefix, _, suffix = encode_event(body(_MARK)).rpartition(json.dumps(_MARK).encode())
        return cls(prefix, suffix)

    def __call__(self, text: str) -> bytes:
        return b"".join((self.prefix, json.dumps(text).encode(), self.suffix))
