"""Random calls on the sinks' bounded hand-off (`instrumentation/pipeline/_handoff.c`), meant to run
under sanitizers (tests/test_collector_render_asan.py builds it so): capacities from 0 up, offers,
drains, closes and lengths in random order, and `on_half_full` callbacks that count, raise, drain,
offer again, close or drop the last reference to the hand-off while it runs. After each call the
counts must agree: every item offered and not counted dropped (a close counts what waited) was
drained or is waiting. Prints one JSON object.
"""

from __future__ import annotations

import importlib
import json
import random
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.fuzz_render import arguments

NAME = "phaselens.instrumentation.pipeline._handoff"


class Rig:
    """One hand-off, what came out of it, and the callback it was made with."""

    fired = 0  # callbacks run, every rig

    def __init__(self, module: Any, rng: random.Random) -> None:
        self.rng, self.drained = rng, 0
        kind = rng.choice(("none", "count", "raise", "drain", "offer", "close", "forget", "odd"))
        self.kind = kind
        callback = None if kind == "none" else getattr(self, f"_{kind}", None)
        capacity = rng.choice((0, 1, 2, 3, 7, 64))
        # an odd callback: the TypeError goes to the caller
        self.handoff = module.BoundedHandOff(capacity, callback if kind != "odd" else rng.choice((5, "x", b"")))

    def _count(self) -> None:
        Rig.fired += 1

    def _raise(self) -> None:
        Rig.fired += 1
        raise RuntimeError("a wake-up already pending")

    def _drain(self) -> None:
        Rig.fired += 1
        self.drained += len(self.handoff.drain())

    def _offer(self) -> None:
        Rig.fired += 1
        self.handoff.offer(("again", Rig.fired))

    def _close(self) -> None:
        Rig.fired += 1
        self.handoff.close()

    def _forget(self) -> None:
        """The rig's reference replaced: the offer's own call holds the old hand-off."""
        Rig.fired += 1
        self.handoff = type(self.handoff)(1)

    def step(self) -> None:
        handoff, choice = self.handoff, self.rng.random()
        if choice < 0.7:
            handoff.offer(self.rng.choice((1, None, "x", b"", (), object())))
        elif choice < 0.85:
            self.drained += len(handoff.drain())
        elif choice < 0.9:
            handoff.close()
        else:
            len(handoff)
        self.check(handoff)

    def check(self, handoff: Any) -> None:
        if handoff is not self.handoff:  # replaced by `_forget` mid-call: the old one is gone
            self.drained = 0
            return
        # close counts what waited as dropped: every item kept is drained or still waiting
        kept = handoff.offered - handoff.dropped
        assert kept == self.drained + len(handoff), (self.kind, kept, self.drained, len(handoff))
        assert len(handoff) <= handoff.capacity  # 0 once closed


def main() -> None:
    args = arguments(__doc__, NAME, 20_000)
    module = importlib.import_module(NAME)
    rng = random.Random(args.seed)
    rig, accepted = None, 0
    for _ in range(args.iterations):
        try:
            if rig is None or rng.random() < 0.02:
                rig = Rig(module, rng)
            else:
                rig.step()
        except TypeError as error:
            assert "on_half_full" in str(error), error
        else:
            accepted += 1
    result = {"module": module.__file__, "iterations": args.iterations, "accepted": accepted, "callbacks": Rig.fired}
    print(json.dumps(result))


if __name__ == "__main__":
    main()
