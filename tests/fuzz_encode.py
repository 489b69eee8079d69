"""Random and broken inputs for the C span encoder (instrumentation/pipeline/_otlp_encode.c), meant
to run under sanitizers (tests/test_collector_render_asan.py builds it so, as fuzz_render.py's
docstring shows for the decoder).

Each iteration makes an engine step (`PackedStep`) and a span description, valid or with one part
broken (a field's type, the tuple's length, links cut mid-entry, times past int64, odd limits),
and encodes them with `encode_step`, `encode_spans` and `encode_request`: a valid step must encode
to the bytes of its `step_span` description and parse with protobuf; a broken one must raise
TypeError or ValueError. Prints one JSON object.
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from opentelemetry.sdk.trace.id_generator import IdGenerator

from tests.fuzz_render import arguments

MODULE = "phaselens.instrumentation.pipeline._otlp_encode"
ODD = (None, 1.5, "x", b"", -1, 2**64, 2**128, (), [1], {"k": object()}, object())


def _step(rng: random.Random) -> list[Any]:
    """A PackedStep's fields: stats, times (ns, sometimes far apart) and 0..70 packed links."""
    start = rng.randrange(-(2**62), 2**62)
    stats = [rng.choice((0, 1, rng.randrange(2**63), 2**70, -5)) for _ in range(8)]
    links = rng.randbytes(25 * rng.randrange(71))
    return [stats[0], start, start + rng.randrange(-(2**40), 2**40), *stats[1:], links]


def _break(rng: random.Random, fields: list[Any]) -> tuple[Any, ...]:
    """One part of the fields broken: a field's value, the length, or the links cut mid-entry."""
    choice = rng.random()
    if choice < 0.6:
        fields[rng.randrange(len(fields))] = rng.choice(ODD)
    elif choice < 0.8:
        fields = fields[: rng.randrange(len(fields))] + ([None] if rng.random() < 0.5 else [])
    else:
        fields[-1] = fields[-1][: max(0, len(fields[-1]) - rng.randint(1, 24))] or b"x"
    return tuple(fields)


class FixedIds(IdGenerator):
    """The same ids every time: those `encode_step` was given, for `step_span` to draw."""

    def __init__(self, trace_id: int, span_id: int) -> None:
        self.trace_id, self.span_id = trace_id, span_id

    def generate_trace_id(self) -> int:
        return self.trace_id

    def generate_span_id(self) -> int:
        return self.span_id


def _limits(rng: random.Random) -> tuple[int, ...]:
    return tuple(rng.choice((-1, 0, 1, 2, 5, 64, 200)) for _ in range(7))


def main() -> None:
    args = arguments(__doc__, MODULE, 20_000)
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
    from opentelemetry.sdk.trace import TracerProvider

    from phaselens.instrumentation import names
    from phaselens.instrumentation.hotpath.clock import ClockAnchor
    from phaselens.instrumentation.pipeline._otlp_encode import encode_request, encode_spans, encode_step
    from phaselens.instrumentation.pipeline.spans import STEP_KEYS, PackedStep, step_span

    rng, accepted, sampler = random.Random(args.seed), 0, TracerProvider().sampler
    anchor = ClockAnchor(mono_ns=0, wall_ns=2**62)
    for _ in range(args.iterations):
        fields, limits, broken = _step(rng), _limits(rng), rng.random() < 0.5
        step = _break(rng, fields) if broken else PackedStep(*fields)
        trace_id, span_id = rng.getrandbits(128), rng.getrandbits(64)
        ids = FixedIds(trace_id, span_id)
        try:
            encoded = encode_step(
                step, trace_id, span_id, 2**62 + step[1], 2**62 + step[2], names.SPAN_ENGINE_STEP, STEP_KEYS, limits
            )
        except (TypeError, ValueError, IndexError):
            assert broken, step  # IndexError: the wall times of a tuple too short to hold them
            continue
        if not broken:
            span = step_span(ids, sampler, anchor, step)
            if span is not None:
                assert [encoded] == encode_spans([span], limits)
        request = encode_request({"service.name": "fuzz"}, names.SERVER_SCOPE, "", [encoded])
        ExportTraceServiceRequest.FromString(request)
        accepted += 1
    print(json.dumps({"iterations": args.iterations, "accepted": accepted, "module": sys.modules[MODULE].__file__}))


if __name__ == "__main__":
    main()
