"""Random and broken inputs for the C span encoder (instrumentation/pipeline/_otlp_encode.c), meant
to run under sanitizers (tests/test_collector_render_asan.py builds it so, as fuzz_render.py's
docstring shows for the decoder).

Each iteration makes an engine step (`PackedStep`) and a span description, valid or with one part
broken (a field's type, the tuple's length, links cut mid-entry, times past int64, odd limits),
and encodes them with `encode_step`, `encode_spans` and `encode_request`: a valid step must encode
to the bytes of its `step_span` description and parse with protobuf; a broken one must raise
TypeError or ValueError. Then a request's phases (`phase_case`), valid or with one argument or
stamp broken, through `encode_phases`: valid ones must encode to the bytes of `request_spans`'s
descriptions; broken ones encode (an odd value that is never read) or raise TypeError or
ValueError. Then a request's SERVER span (`root_case`) through `encode_root` alike, against
`root_span`'s description. Prints one JSON object.
"""

from __future__ import annotations

import json
import random
import sys
from array import array
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from opentelemetry.sdk.trace.id_generator import IdGenerator

from tests.fuzz_render import arguments

MODULE = "phaselens.instrumentation.pipeline._otlp_encode"
ODD = (None, 1.5, "x", b"", -1, 2**64, 2**128, (), [1], {"k": object()}, object())


def _step(rng: random.Random) -> list[Any]:
    """A PackedStep's fields: stats, times (ns, sometimes far apart) and 0..70 packed links, or now
    and then 300..700 (past the encoder's 8 KiB stack buffer)."""
    start = rng.randrange(-(2**62), 2**62)
    stats = [rng.choice((0, 1, rng.randrange(2**63), 2**70, -5)) for _ in range(8)]
    links = rng.randbytes(25 * (rng.randrange(71) if rng.random() < 0.9 else rng.randrange(300, 701)))
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


class DrawnIds(IdGenerator):
    """Ids from a seed, one span id in four 0 (which `_Tree.leaf` draws again, or takes the root
    for, as a parent): two made with one seed draw the same."""

    def __init__(self, seed: int) -> None:
        self._random = random.Random(seed)

    def generate_trace_id(self) -> int:
        return self._random.getrandbits(128)

    def generate_span_id(self) -> int:
        drawn = self._random.getrandbits(64)
        return 0 if drawn % 4 == 0 else drawn


def phase_case(rng: random.Random) -> tuple[Any, Any]:
    """(RequestRecord, Phases): each stamp 0 (the phase did not happen) or in [1, 2**40) ns, 0..4
    queue waits, 0..5 prefill chunks (sometimes cut mid-chunk), 0..5 token stamps, any split."""
    from phaselens.instrumentation.hotpath.records import NO_HTTP, NO_OUTCOME, RequestRecord, SpanIds, int64s
    from phaselens.instrumentation.pipeline.phases import Phases

    def stamp() -> int:
        return rng.choice((0, rng.randrange(1, 2**40)))

    chunks = tuple(rng.randrange(2**40) for _ in range(4 * rng.randrange(6) + rng.choice((0, 0, 1, 3))))
    tokens = rng.randrange(6)
    root = SpanIds(rng.getrandbits(128), rng.getrandbits(64), rng.choice((1, 3)), rng.choice(("", "k=v")))
    stamps = [stamp() for _ in range(11)]
    token_ts, token_n = tuple(stamp() for _ in range(tokens)), tuple(rng.randrange(1, 4) for _ in range(tokens))
    record = RequestRecord(
        root, None, *stamps, 0, "length", (), chunks, token_ts, token_n, (), None, NO_OUTCOME, NO_HTTP
    )
    phases = Phases(received_ts=stamps[0], end_ts=stamp(), enqueued_ts=stamp())
    for name in ("scheduled_ts", "prefill_end_ts", "first_token_ts", "last_token_ts", "visible_ts", "first_chunk_ts"):
        setattr(phases, name, stamp())
    for name in ("loop_wait_ns", "encode_ns", "write_ns", "decode_tokens", "decode_steps"):
        setattr(phases, name, rng.randrange(-(2**40), 2**40))
    phases.waits = [(stamp(), stamp()) for _ in range(rng.randrange(5))]
    phases.initial_chunks = rng.randrange(7)
    phases.itl_sorted_ns = int64s(array("q", sorted(rng.randrange(2**30) for _ in range(rng.randrange(5)))).tobytes())
    return record, phases


def root_case(rng: random.Random) -> tuple[Any, Any, str, Any]:
    """(RequestRecord, Phases, full, summary) for a SERVER span: `phase_case`'s, with any of the
    record's optional facts (info, captured content, errors, status codes, a remote parent, sends, an
    inbound edge, a first chunk, held-back tokens), odd values among them (long, non-ASCII or
    unencodable strings, ints past int64), and a compact record's summary or none."""
    from phaselens.instrumentation import names
    from phaselens.instrumentation.hotpath.records import HttpFacts, RequestInfo, RequestOutcome, SpanIds, int64s
    from phaselens.instrumentation.pipeline.spans import compact_summary

    def pick(*values: Any) -> Any:
        return rng.choice(values)

    def text() -> Any:
        return pick(None, "", "stop", "x" * rng.randrange(1, 40), "ünï\u20ac", "\ud800")

    def ints(n: int) -> Any:
        return int64s(array("q", (rng.randrange(2**40) for _ in range(n))).tobytes())

    record, phases = phase_case(rng)
    info = None
    if rng.random() < 0.7:
        prompt = pick(None, "hi", [{"role": "user", "content": "hi"}, {"content": "x"}])
        optional = [pick(None, rng.randrange(2**20), 1.5, True, 2**70, text()) for _ in range(8)]
        info = RequestInfo(pick("text_completion", "chat"), pick("tiny", "m\u00fc"), *optional, prompt=prompt)
    outcome = RequestOutcome(
        pick(None, 0, 1, 2, rng.randrange(2**20)),
        pick(None, "", "stop", "length"),
        pick(0, rng.randrange(2**20)),
        pick(0, rng.randrange(2**20), None),
        pick(None, "done"),
        pick(None, "", "Boom"),
        pick(None, 0, 200, 400, 503),
    )
    http = HttpFacts(
        pick("", "POST"), pick("", "/v1/completions"), pick(None, "127.0.0.1"), pick(None, 8000, 2**70),
        pick(None, 0, 200, 404, 599), pick(False, True), pick(None, "", "TimeoutError"), text(),
    )  # fmt: skip
    parent = pick(None, SpanIds(rng.getrandbits(128), rng.getrandbits(64), 1, pick("", "k=v")))
    record = record._replace(
        parent=parent, finish_reason=pick("", "length", "error"), chunks=ints(4 * rng.randrange(4)),
        sends=ints(rng.randrange(6)), info=info, outcome=outcome, http=http,
    )  # fmt: skip
    for name in ("arrived_ts", "read_ts", "last_chunk_ts"):
        setattr(phases, name, pick(0, rng.randrange(1, 2**40)))
    for name in ("kernel_wait_ns", "dispatch_ns", "ingress_ns", "queue_ns", "prefill_ns", "first_token_phase_ns",
                 "first_chunk_phase_ns", "held_back_ns", "delivery_ns", "decode_ns"):  # fmt: skip
        setattr(phases, name, rng.randrange(-(2**40), 2**40))
    phases.held_back_known, phases.held_back_tokens = pick(False, True), rng.randrange(5)
    full = pick(names.TRACE_FULL_HEAD, names.TRACE_FULL_TAIL_SLO, names.TRACE_FULL_NONE)
    return record, phases, full, compact_summary(record, phases) if full == names.TRACE_FULL_NONE else None


def root_arguments(anchor: Any, record: Any, phases: Any, full: str, summary: Any, limits: Any) -> list[Any]:
    """`encode_root`'s arguments, as `otlp_fast.FastEmitter` makes them."""
    from phaselens.instrumentation.pipeline.spans import ROOT_SPAN_CONSTANTS, ROOT_SPAN_KEYS, root_texts

    texts = root_texts(record, full)
    return [record, phases, anchor.wall_offset_ns, texts, summary, ROOT_SPAN_KEYS, ROOT_SPAN_CONSTANTS, limits]


def root_reference(anchor: Any, record: Any, phases: Any, full: str, summary: Any, limits: Any) -> bytes:
    """The SERVER span `root_span` describes, encoded by `encode_spans`."""
    from phaselens.instrumentation.pipeline._otlp_encode import encode_spans
    from phaselens.instrumentation.pipeline.spans import root_span

    return encode_spans([root_span(anchor, record, phases, full, summary)], limits)[0]


def word_stream(seed: int) -> Any:
    """64-bit words from a seed, one in four 0 (INVALID_SPAN_ID)."""
    rng = random.Random(seed)
    while True:
        word = rng.getrandbits(64)
        yield 0 if word % 4 == 0 else word


class WordIds(IdGenerator):
    """The SDK's RandomIdGenerator over `word_stream`: a 0 is drawn again."""

    def __init__(self, seed: int) -> None:
        self.words = word_stream(seed)

    def generate_span_id(self) -> int:
        return next(word for word in self.words if word)

    def generate_trace_id(self) -> int:
        raise AssertionError("phase spans take the root's trace id")


def word_bits(seed: int) -> Any:
    """`random_bits` over `word_stream`: n bits, the first word the lowest, as getrandbits makes them."""
    words = word_stream(seed)
    return lambda bits: sum(next(words) << (64 * i) for i in range(bits // 64))


def phase_arguments(ids: IdGenerator, anchor: Any, record: Any, phases: Any, limits: tuple[int, ...]) -> list[Any]:
    """`encode_phases`'s arguments for a request, as `otlp_fast.FastEmitter.emit_request` makes them."""
    from phaselens.instrumentation.pipeline import spans

    decode = spans.decode_description(anchor, record, phases, True) if phases.first_token_ts else None
    stamps = spans.phase_stamps(phases)
    return [
        ids.generate_span_id, None, record.root, anchor.wall_offset_ns, stamps, phases.waits, record.chunks, decode,
        spans.PHASE_NAMES, spans.PHASE_KEYS, limits,
    ]  # fmt: skip


def phase_spans(ids: IdGenerator, anchor: Any, record: Any, phases: Any, limits: tuple[int, ...]) -> list[bytes]:
    """The phase spans `request_spans` describes (all but the SERVER span), encoded by `encode_spans`."""
    from phaselens.instrumentation.pipeline._otlp_encode import encode_spans
    from phaselens.instrumentation.pipeline.spans import request_spans

    return encode_spans(request_spans(ids, anchor, record, phases, True)[:-1], limits)


def _break_phases(rng: random.Random, arguments: list[Any]) -> list[Any]:
    """One argument, one stamp, one wait or one chunk value of `encode_phases`'s replaced by an odd one."""
    choice, odd = rng.random(), rng.choice((*ODD, 2**63, -(2**63), lambda: "x"))
    if choice < 0.4:
        arguments[rng.randrange(len(arguments))] = odd
    elif choice < 0.6:
        stamps = list(arguments[4])
        stamps[rng.randrange(len(stamps))] = odd
        arguments[4] = tuple(stamps)
    elif choice < 0.8 and arguments[5]:
        arguments[5] = [*arguments[5][1:], rng.choice((odd, (odd, 1), (1, 2, 3)))]
    elif arguments[6]:
        arguments[6] = (*arguments[6][1:], odd)
    return arguments


def _phases_round(rng: random.Random, limits: tuple[int, ...]) -> bool:
    """One request's phases through `encode_phases`, valid or broken; True when it encoded."""
    from phaselens.instrumentation.hotpath.clock import ClockAnchor
    from phaselens.instrumentation.pipeline._otlp_encode import encode_phases

    record, phases = phase_case(rng)
    anchor, seed, broken = ClockAnchor(mono_ts=0, wall_ts=rng.randrange(2**62)), rng.getrandbits(32), rng.random() < 0.5
    bulk = rng.random() < 0.5  # the SDK default generator's path: ids from `random_bits`
    arguments = phase_arguments(DrawnIds(seed), anchor, record, phases, limits)
    if bulk:
        arguments[1] = word_bits(seed)
    if broken:
        arguments = _break_phases(rng, arguments)
    try:
        encoded = encode_phases(*arguments)
    except (TypeError, ValueError):
        assert broken, arguments
        return False
    if not broken:
        ids = WordIds(seed) if bulk else DrawnIds(seed)
        assert encoded == phase_spans(ids, anchor, record, phases, limits)
    return True


def _root_round(rng: random.Random, limits: tuple[int, ...]) -> bool:
    """One request's SERVER span through `encode_root`, valid or with one argument or record field
    replaced by an odd value; True when it encoded."""
    from phaselens.instrumentation.hotpath.clock import ClockAnchor
    from phaselens.instrumentation.pipeline._otlp_encode import encode_root

    record, phases, full, summary = root_case(rng)
    anchor, broken = ClockAnchor(mono_ts=0, wall_ts=rng.randrange(2**62)), rng.random() < 0.5
    arguments = root_arguments(anchor, record, phases, full, summary, limits)
    if broken:
        odd = rng.choice((*ODD, 2**63, -(2**63)))
        if rng.random() < 0.5:
            arguments[rng.randrange(len(arguments))] = odd
        else:
            arguments[0] = record._replace(**{rng.choice(record._fields): odd})
    try:
        encoded = encode_root(*arguments)
    except (TypeError, ValueError, AttributeError, OverflowError):
        assert broken, arguments
        return False
    if not broken:
        assert encoded == root_reference(anchor, record, phases, full, summary, limits)
    return True


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

    rng, accepted, phases_accepted, roots_accepted = random.Random(args.seed), 0, 0, 0
    sampler = TracerProvider().sampler
    anchor = ClockAnchor(mono_ts=0, wall_ts=2**62)
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
    for _ in range(args.iterations // 4):  # ~4x a step's work each
        phases_accepted += _phases_round(rng, _limits(rng))
        roots_accepted += _root_round(rng, _limits(rng))
    module = sys.modules[MODULE].__file__
    print(
        json.dumps(
            {
                "iterations": args.iterations,
                "accepted": accepted,
                "phases_accepted": phases_accepted,
                "roots_accepted": roots_accepted,
                "module": module,
            }
        )
    )


if __name__ == "__main__":
    main()
