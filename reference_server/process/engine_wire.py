"""The messages between the API process and the engine process (`phaselens serve --engine process`).

One Unix socket pair, both ways; a frame is a 4-byte little-endian length and a `marshal` payload
(plain tuples, lists, ints and strings: ~1 µs per request per step to encode here, and both ends
are this package on this host, so nothing foreign is ever unmarshalled). Messages are tuples whose
first item names them:

    API → engine   (CONFIG, EngineConfig fields, observe_steps)   first, once
                   (ADD, req_id, prompt_ids, params)      a request; `params` = SamplingParams' fields
                   (ABORT, req_id)                       the client went away
                   (STOP,)                               end: the engine process exits
    engine → API   (READY, max_model_len, vocab_size, kv_blocks_total, pid)     once, after the load
                   (FAILED, message)                     the model did not load: the process exits
                   (OUTPUTS, entries, steps, health)     once per loop turn that had anything

`entries` are (req_id, events, output | None) in the order the engine produced them; `events` a
flat list of the engine's stamps for that request since its last entry (`EV_*`, below), each with
its CLOCK_MONOTONIC ns where the API process keeps the engine's time; `output` a SeqOutput's
fields. `steps` are (StepStats fields, [req_id…]) of the steps run; `health` is (running, waiting,
kv_blocks_used).
"""

from __future__ import annotations

import marshal
import struct
from dataclasses import fields
from typing import Any

from phaselens.instrumentation import FINISH_ABORT, FINISH_ERROR, FINISH_LENGTH, FINISH_STOP
from phaselens.reference_server.engine.sequence import FINISH_TRANSFERRED, SamplingParams, SeqOutput

CONFIG, ADD, ABORT, STOP = "config", "add", "abort", "stop"
READY, FAILED, OUTPUTS = "ready", "failed", "outputs"

# events: a kind, then its arguments
EV_SCHEDULED = 1  # t: the API process stamps the queue wait's end at the engine's t
EV_PREEMPTED = 2  # t
EV_CHUNK = 3  # start, end, tokens, cached: a prefill chunk on the engine's clock
EV_FIRST_TOKEN = 4  # (none): the API process stamps it as it reads the entry (the engine → API hop)
EV_TOKEN = 5  # n: likewise
EV_FINISHED = 6  # reason index in REASONS: likewise
EVENT_ARGS = {EV_SCHEDULED: 1, EV_PREEMPTED: 1, EV_CHUNK: 4, EV_FIRST_TOKEN: 0, EV_TOKEN: 1, EV_FINISHED: 1}
REASONS = (FINISH_STOP, FINISH_LENGTH, FINISH_ABORT, FINISH_ERROR, FINISH_TRANSFERRED)
REASON_INDEX = {reason: i for i, reason in enumerate(REASONS)}

_PARAM_FIELDS = tuple(f.name for f in fields(SamplingParams))
_LENGTH = struct.Struct("<I")
MAX_FRAME_BYTES = 1 << 30


def frame(message: tuple[Any, ...]) -> bytes:
    payload = marshal.dumps(message)
    return _LENGTH.pack(len(payload)) + payload


class FrameReader:
    """Bytes in, whole messages out (frames may arrive split or several per read)."""

    __slots__ = ("_buffer",)

    def __init__(self) -> None:
        self._buffer = bytearray()

    def feed(self, data: bytes) -> list[tuple[Any, ...]]:
        buffer = self._buffer
        buffer += data
        messages, at = [], 0
        while len(buffer) - at >= _LENGTH.size:
            (size,) = _LENGTH.unpack_from(buffer, at)
            if size > MAX_FRAME_BYTES:
                raise ValueError(f"engine frame of {size} bytes: the stream is corrupt")
            end = at + _LENGTH.size + size
            if end > len(buffer):
                break
            messages.append(marshal.loads(memoryview(buffer)[at + _LENGTH.size : end]))
            at = end
        del buffer[:at]
        return messages


def encode_params(params: SamplingParams) -> tuple[Any, ...]:
    return tuple([getattr(params, name) for name in _PARAM_FIELDS])


def decode_params(fields: tuple[Any, ...]) -> SamplingParams:
    return SamplingParams(*fields)


def encode_output(out: SeqOutput) -> tuple[Any, ...]:
    return (
        out.content,
        out.reasoning,
        out.new_tokens,
        out.finish_reason,
        out.output_tokens,
        out.reasoning_tokens,
        out.cached_tokens,
        out.error,
    )


def decode_output(fields: tuple[Any, ...]) -> SeqOutput:
    return SeqOutput(*fields)
