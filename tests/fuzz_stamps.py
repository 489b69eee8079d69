"""Random and broken calls on the timeline's per-token stamp log (instrumentation/hotpath/_stamps.c),
meant to run under sanitizers (tests/test_collector_render_asan.py builds it so).

Each iteration makes one call on a log that grows over the run, mirrored on `array('q')`, its
reference: an append or a `stamp` of a value that fits int64 or an odd one (past int64, not an int,
a clock that gives no int, counts that are no log), maybe while a view is held; or a read (an index,
in range or not, `tolist`, `tobytes`, iteration, a view). A call that raises must leave both logs as
they were; after every call the logs read as their references. Prints one JSON object.
"""

from __future__ import annotations

import importlib
import json
import random
import sys
import time
from array import array
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.fuzz_render import arguments

MODULE = "phaselens.instrumentation.hotpath._stamps"
ODD = (None, 1.5, "x", b"", 2**63, -(2**63) - 1, 2**128, (), [1], object())


def _value(rng: random.Random) -> Any:
    if rng.random() < 0.2:
        return rng.choice(ODD)
    return rng.choice((0, 1, -1, rng.randrange(2**31), rng.randrange(2**63), -rng.randrange(2**63), 2**63 - 1))


def _call(rng: random.Random, stamps: Any, counts: Any, ref: tuple[array, array]) -> None:
    """One write, mirrored on the references when it does not raise."""
    choice = rng.random()
    if choice < 0.4:
        value = _value(rng)
        stamps.append(value)
        ref[0].append(value)
        return
    n = _value(rng)
    if choice < 0.6:
        t = time.monotonic_ns()
        stamps.stamp(counts, n, time.monotonic_ns)
        assert t <= stamps[-1] <= time.monotonic_ns()
        ref[0].append(stamps[-1])
    else:
        clock_value = _value(rng)
        stamps.stamp(rng.choice((counts, counts, array("q"), None)), n, lambda: clock_value)
        ref[0].append(clock_value)
    ref[1].append(n)


def _read(rng: random.Random, stamps: Any, reference: array) -> None:
    index = rng.randrange(-len(reference) - 2, len(reference) + 2)
    try:
        assert stamps[index] == reference[index]
    except IndexError:
        assert not -len(reference) <= index < len(reference)
    with memoryview(stamps) as view:
        assert view.tobytes() == reference.tobytes() and view.format == "q"
    assert stamps.tolist() == list(stamps) == reference.tolist() and stamps.tobytes() == reference.tobytes()


def main() -> None:
    args = arguments(__doc__, MODULE, 20_000)
    module = importlib.import_module(MODULE)
    rng, accepted = random.Random(args.seed), 0
    stamps, counts, reference = module.Int64Log(), module.Int64Log(), (array("q"), array("q"))
    for _ in range(args.iterations):
        view = memoryview(stamps) if rng.random() < 0.05 else None  # appends must refuse meanwhile
        try:
            _call(rng, stamps, counts, reference)
            assert view is None, "an append while a view was held"
            accepted += 1
        except (OverflowError, TypeError, BufferError):
            pass
        if view is not None:
            view.release()
        _read(rng, stamps, reference[0])
        _read(rng, counts, reference[1])
    print(json.dumps({"iterations": args.iterations, "accepted": accepted, "module": module.__file__}))


if __name__ == "__main__":
    main()
