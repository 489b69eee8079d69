"""benchmarks/builder_child_rate.py's frames: each write carries its own requests after the step
records they ran in, as the shipper's writes do, not every step in one burst."""

from __future__ import annotations

from benchmarks.builder_child_rate import BATCH, LIFE, seconds_of_frames
from phaselens.instrumentation.process import wire


def test_each_write_carries_its_requests_after_the_step_records_they_ran_in():
    hello, chunks = seconds_of_frames(5, 3, 2)
    ((kind, fields),), _ = wire.split_frames(hello)
    assert kind == wire.KIND_HELLO and fields[-1] == 2.0  # the child's checkpoint interval: the writes'
    assert len(chunks) == 3
    starts = []
    for data in chunks:
        frames, used = wire.split_runs(data)
        assert used == len(data)
        (step_kind, (steps, undecoded)), *requests = frames
        assert step_kind == wire.KIND_STEP and undecoded == 0 and len(steps) == 5 * LIFE // BATCH
        assert [kind for kind, _ in requests] == [wire.KIND_REQUEST] * 5
        starts.append(steps[0][1])
    assert starts == sorted(starts) and len(set(starts)) == 3  # the engine's steps in order, none repeated
