"""Server side of Server-Sent Events: the bytes an OpenAI-compatible server streams. (The client's
parser is `phaselens.instrumentation.client.sse`; the end-of-stream sentinel is defined there, once.)"""

from __future__ import annotations

import json

from phaselens.instrumentation.client import DONE

DONE_EVENT = f"data: {DONE}\n\n".encode()


def encode_event(obj) -> bytes:
    """One `data:` event carrying `obj` as compact JSON (what OpenAI-compatible servers stream)."""
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"
