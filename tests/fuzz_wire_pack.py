"""Random and broken records for the shipper's packer (instrumentation/process/_wire_pack.c), meant to
run under sanitizers (tests/test_collector_render_asan.py builds it so).

Each iteration packs a few records, valid or with one part broken (a field's value of an odd type,
the record cut short, a link of another type, an object that is no record): the valid ones must
pack to the frames of the reference encoders (`wire.encode_request` / `encode_step`); with broken
ones in the list, every record must be written (a frame marshal reads back), skipped as an unsampled
step or counted as an error, and nothing else. Prints one JSON object.
"""

from __future__ import annotations

import json
import marshal
import random
import sys
from array import array
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.fuzz_render import arguments

MODULE = "phaselens.instrumentation.process._wire_pack"
ODD = (None, 1.5, "x", "é\ud800", b"", -1, 2**31, 2**64, 2**128, (), (1, (2,)), [1], {"k": "v"}, object(), True)


def _int(rng: random.Random) -> int:
    return rng.choice((0, 1, -1, rng.randrange(2**31), rng.randrange(2**63), -rng.randrange(2**63), 2**70, -(2**65)))


def _request(rng: random.Random, records: Any) -> Any:
    ids = records.SpanIds(rng.getrandbits(128), rng.getrandbits(64), rng.randrange(4), rng.choice(("", "a=b")))
    stamps = records.int64s(array("q", [_int(rng) % 2**63 for _ in range(rng.randrange(5))]).tobytes())
    info = rng.choice((None, records.RequestInfo("chat", "tiny", "r", 3, 4, 0.5, None, 7, 1, True, "hi")))
    return records.RequestRecord(
        ids, rng.choice((None, ids)), *[_int(rng) for _ in range(12)], "length", *[stamps] * 5,
        info, records.RequestOutcome(2, "stop"), records.HttpFacts("POST", "/v1", "h", 80),
    )  # fmt: skip


def _step(rng: random.Random, records: Any) -> Any:
    members = rng.randrange(70)
    links = b"".join(rng.randbytes(25) for _ in range(members) if rng.random() < 0.5)  # as the loop packs them
    return records.StepRecord(*[_int(rng) for _ in range(9)], members, links)


def _broken(rng: random.Random, record: Any) -> Any:
    fields, choice = list(record), rng.random()
    if choice < 0.5:
        fields[rng.randrange(len(fields))] = rng.choice(ODD)
    elif choice < 0.7:
        fields = fields[: rng.randrange(len(fields))]
    elif choice < 0.9 and fields and isinstance(fields[-1], tuple):
        fields[-1] = (*fields[-1], rng.choice(ODD))
    else:
        return rng.choice(ODD)
    return tuple.__new__(type(record), fields)


def main() -> None:
    args = arguments(__doc__, MODULE, 20_000)
    from phaselens.instrumentation.hotpath import records
    from phaselens.instrumentation.process import wire

    rng, accepted = random.Random(args.seed), 0
    for _ in range(args.iterations):
        batch = [rng.choice((_request, _step))(rng, records) for _ in range(rng.randrange(1, 5))]
        broken = rng.random() < 0.5
        if broken:
            index = rng.randrange(len(batch))
            batch[index] = _broken(rng, batch[index])
        packed = wire.pack(batch)
        starts = [0, *packed.ends][: len(packed.ends)]
        for start, end in zip(starts, packed.ends, strict=True):  # every frame reads back
            length, kind = wire.HEADER.unpack_from(packed.data, start)
            assert length == end - start - wire.HEADER.size and kind in (wire.KIND_REQUEST, wire.KIND_STEP)
            marshal.loads(packed.data[start + wire.HEADER.size : end])
        assert len(packed.ends) + packed.unsampled + packed.errors == len(batch)
        if not broken:
            frames = [
                wire.encode_request(r) if isinstance(r, records.RequestRecord) else wire.encode_step(r)
                for r in batch
                if isinstance(r, records.RequestRecord) or r.links
            ]
            assert (packed.data, packed.errors) == (b"".join(frames), 0)
            accepted += 1
    module = wire._wire_pack.__file__  # the build wire.pack called
    print(json.dumps({"iterations": args.iterations, "accepted": accepted, "module": module}))


if __name__ == "__main__":
    main()
