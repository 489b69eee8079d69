"""The span-builder process over real pipes: its FrameReader (whole frames from each read, a frame
cut across reads kept for the next, a frame longer than a read, EOF), and its report lines around
exports (a checkpoint's exports reported by its report alone; a full batch between checkpoints at
once), its timed checkpoint, and its idleness (no wake-up)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from phaselens.instrumentation import names
from phaselens.instrumentation.hotpath.records import RequestRecord
from phaselens.instrumentation.pipeline.spans import PackedStep
from phaselens.instrumentation.process import _wire_pack, builder_child, wire
from tests.instrumentation_fixtures import WALL_BASE_NS, OtlpReceiver, make_rig, process_env, script_request


def test_frames_cut_across_reads_come_whole_and_in_order(monkeypatch):
    monkeypatch.setattr(builder_child, "READ_BYTES", 64)  # a small buffer: most frames straddle reads
    fields = [(i, b"x" * (i * 7 % 50), f"s{i}", [i, -i]) for i in range(200)]
    stream = b"".join(wire.frame(wire.KIND_FLUSH, f) for f in fields)
    read_fd, write_fd = os.pipe()
    reader = builder_child.FrameReader(read_fd)
    got: list[tuple[int, tuple]] = []
    for start in range(0, len(stream), 37):  # 37-byte writes: each read ends inside a frame or header
        os.write(write_fd, stream[start : start + 37])
        got += reader.read() or []
    os.close(write_fd)
    assert reader.read() is None  # EOF
    os.close(read_fd)
    assert got == [(wire.KIND_FLUSH, f) for f in fields]


def test_a_frame_longer_than_a_read_comes_whole(monkeypatch):
    monkeypatch.setattr(builder_child, "READ_BYTES", 16)
    big = (b"y" * 1000, "z" * 300)
    stream = wire.frame(wire.KIND_HELLO, big) + wire.frame(wire.KIND_FLUSH, (1,))
    read_fd, write_fd = os.pipe()
    os.write(write_fd, stream)
    os.close(write_fd)
    reader = builder_child.FrameReader(read_fd)
    got: list[tuple[int, tuple]] = []
    while (frames := reader.read()) is not None:
        got += frames
    os.close(read_fd)
    assert got == [(wire.KIND_HELLO, big), (wire.KIND_FLUSH, (1,))]


def start_child(env: dict[str, str]) -> tuple[subprocess.Popen, int]:
    """A span-builder process on the fast backend (its stdin a pipe), and the fd of its reports."""
    read_fd, write_fd = os.pipe()
    child = subprocess.Popen(
        [sys.executable, "-m", "phaselens.instrumentation.process.builder_child", str(write_fd), str(os.getpid())],
        stdin=subprocess.PIPE,
        pass_fds=(write_fd,),
        env={**os.environ, **env, names.ENV_SPAN_BACKEND: "fast"},
    )
    os.close(write_fd)
    assert child.stdin is not None
    return child, read_fd


def child_report_lines(records: list, batch_size: int) -> list[dict]:
    """The report lines of a span-builder process sent the hello and a FLUSH (ack 1), then, once it
    acknowledged it, `records` in two writes 0.5 s apart (two reads: it waits in poll), the second
    closed by a FLUSH (ack 2), then EOF."""
    child, read_fd = start_child({"OTEL_BSP_MAX_EXPORT_BATCH_SIZE": str(batch_size)})
    child.stdin.write(wire.hello("test", 0, WALL_BASE_NS, False, 2.0) + wire.frame(wire.KIND_FLUSH, (1,)))
    child.stdin.flush()
    with os.fdopen(read_fd) as reports:
        lines = [json.loads(reports.readline())]
        assert lines[0]["ack"] == 1
        half = len(records) // 2
        child.stdin.write(b"".join(wire.encode_request(r) for r in records[:half]))
        child.stdin.flush()
        time.sleep(0.5)
        child.stdin.write(b"".join(wire.encode_request(r) for r in records[half:]) + wire.frame(wire.KIND_FLUSH, (2,)))
        child.stdin.close()
        lines += [json.loads(line) for line in reports]
    assert child.wait(30) == 0
    return lines


@pytest.fixture()
def records(monkeypatch):
    """Six scripted requests' records, as the serving process hands them to the span-builder process."""
    receiver = OtlpReceiver()
    process_env(monkeypatch, receiver)
    rig = make_rig(poll_interval_s=3600)  # the thread builder sleeps: the records stay queued
    for _ in range(6):
        script_request(rig)
    rig.telemetry._closer.expire(force=True)
    yield [r for r in rig.telemetry._sink._handoffs.take() if isinstance(r, RequestRecord)]
    receiver.close()


def test_a_checkpoints_exports_are_reported_by_its_report_alone(records):
    lines = child_report_lines(records, batch_size=512)  # no full batch: every export at a checkpoint
    assert [line["records_safe"] for line in lines if "ack" in line] == [0, 6]
    assert [line for line in lines if set(line) == {"records_safe"}] == []  # no line of their own


def test_a_full_batch_between_checkpoints_still_reports_at_once(records):
    lines = child_report_lines(records, batch_size=2)  # ~13 spans a request: full batches as it builds
    alone = [line["records_safe"] for line in lines if set(line) == {"records_safe"}]
    assert alone and alone == sorted(alone) and alone[0] >= 3  # the first read's records, at once
    assert [line["records_safe"] for line in lines if "ack" in line] == [0, 6]


def test_a_long_read_reports_its_records_safe_as_its_full_batches_go(monkeypatch):
    """A read holds up to a second of the shipper's records: they are marked every MARK_RECORDS, so a
    full batch exported mid-read reports the records before it safe at once (one mark a read made
    them wait for the read's last spans, exported at the next checkpoint: a kill in between repeated
    every one of them)."""
    receiver = OtlpReceiver()
    process_env(monkeypatch, receiver)  # it also restores OTEL_BSP_SCHEDULE_DELAY, which SpanProcess sets
    monkeypatch.setenv("OTEL_BSP_MAX_EXPORT_BATCH_SIZE", "32")  # ~13 spans a request: full batches as it builds
    monkeypatch.setenv(names.ENV_SPAN_BACKEND, "fast")
    rig = make_rig(poll_interval_s=3600)
    for _ in range(3 * builder_child.MARK_RECORDS):
        script_request(rig)
    rig.telemetry._closer.expire(force=True)
    records = [r for r in rig.telemetry._sink._handoffs.take() if isinstance(r, RequestRecord)]
    frames, _ = wire.split_frames(b"".join(wire.encode_request(r) for r in records))
    read_fd, write_fd = os.pipe()
    process = builder_child.SpanProcess(("test", 0, WALL_BASE_NS, False, 2.0), write_fd)
    try:
        process.handle(frames)  # one read, no checkpoint
        process.stop()
    finally:
        process.report_out.close()
        receiver.close()
    with os.fdopen(read_fd) as reports:
        lines = [json.loads(line) for line in reports]
    alone = [line["records_safe"] for line in lines if set(line) == {"records_safe"}]
    assert alone and alone[0] == builder_child.MARK_RECORDS, lines  # before the read ended
    assert alone == sorted(alone) and alone[-1] < len(records)  # the read's last spans wait for a checkpoint
    assert all(n % builder_child.MARK_RECORDS == 0 for n in alone), alone
    assert lines[-1]["final"] and lines[-1]["records_safe"] == len(records) == 48


def _wakeups(pid: int) -> int:
    """How many times any thread of `pid` was scheduled in (schedstat's third field, summed)."""
    tasks = os.listdir(f"/proc/{pid}/task")
    return sum(int(open(f"/proc/{pid}/task/{tid}/schedstat").read().split()[2]) for tid in tasks)


@pytest.mark.skipif(not os.path.exists("/proc/self/schedstat"), reason="needs Linux's schedstat")
def test_records_without_a_flush_are_exported_by_a_timed_checkpoint_then_the_idle_child_never_wakes(records):
    child, read_fd = start_child({})
    interval_s = 0.3
    hello = wire.hello("test", 0, WALL_BASE_NS, False, interval_s)
    child.stdin.write(hello + b"".join(wire.encode_request(r) for r in records))  # no FLUSH
    child.stdin.flush()
    with os.fdopen(read_fd) as reports:
        report = json.loads(reports.readline())  # the checkpoint's, an interval after the read
        assert report["records_safe"] == len(records) == 6 and report["export_exported"] > 0
        time.sleep(0.5)  # past the report's write: the child back in its poll
        before = _wakeups(child.pid)
        time.sleep(10 * interval_s)
        idle = _wakeups(child.pid) - before  # a timer (checkpoints, a look at the parent) would wake it
        child.stdin.close()
        lines = [json.loads(line) for line in reports]
    assert child.wait(30) == 0
    assert idle == 0
    assert len(lines) == 1 and lines[0]["final"]  # idle, it wrote nothing until its exit


def _step_fields(index: int, links: bytes = b"l" * 25) -> tuple:
    return (index, 1_000 + index, 2_000 + index, 0, 4, 10, 100, 0, 0, 4, links)


# the frames a read may hold: steps (a run, broken by other kinds), steps decode_step refuses (a
# short tuple, links not bytes, a list, not a sequence), a list of 11 it takes, requests' stand-ins
FRAMES = [
    wire.hello("s", 1, 2, True, 2.0),
    wire.frame(wire.KIND_STEP, _step_fields(0)),
    wire.frame(wire.KIND_STEP, _step_fields(1, b"")),
    wire.frame(wire.KIND_STEP, _step_fields(2)[:10]),
    wire.frame(wire.KIND_STEP, (*_step_fields(3)[:10], "links")),
    wire.frame(wire.KIND_STEP, _step_fields(4)),
    wire.frame(wire.KIND_REQUEST, (1, 2, 3)),
    wire.frame(wire.KIND_STEP, 7),
    wire.frame(wire.KIND_STEP, list(_step_fields(5))),
    wire.frame(wire.KIND_FLUSH, (1,)),
    wire.frame(wire.KIND_STEP, (2**70, -(2**40), 2**62, None, 1.5, "x", b"", (), 0, -1, b"m" * 50)),
    wire.frame(9, ("another kind",)),
]


def runs_of(frames: list[tuple[int, Any]]) -> list[tuple[int, Any]]:
    """`split_frames`'s frames with each run of step frames as one item: (KIND_STEP, (the
    decode_step of each, how many it refused)), what `split_runs` reads."""
    items: list[tuple[int, Any]] = []
    for kind, fields in frames:
        if kind != wire.KIND_STEP:
            items.append((kind, fields))
            continue
        if not items or items[-1][0] != wire.KIND_STEP:
            items.append((wire.KIND_STEP, ([], 0)))
        steps, undecoded = items[-1][1]
        try:
            steps.append(wire.decode_step(fields))
        except Exception:  # noqa: BLE001 — refused: counted
            items[-1] = (wire.KIND_STEP, (steps, undecoded + 1))
    return items


def test_split_runs_reads_the_frames_split_frames_reads_with_step_runs_as_one_item():
    data = b"".join(FRAMES)
    for cut in range(len(data) + 1):
        got, used = wire.split_runs(data[:cut])
        frames, expected_used = wire.split_frames(data[:cut])
        assert (got, used) == (runs_of(frames), expected_used)
        assert all(type(step) is PackedStep for kind, fields in got if kind == wire.KIND_STEP for step in fields[0])
    got, _ = wire.split_runs(data)
    assert [(kind, len(fields[0]), fields[1]) for kind, fields in got if kind == wire.KIND_STEP] == [
        (wire.KIND_STEP, 3, 2),  # 0, 1 (no links: still a step) and 4; two refused
        (wire.KIND_STEP, 1, 1),  # the list of 11; the int refused
        (wire.KIND_STEP, 1, 0),
    ]


def test_split_runs_fails_on_a_broken_frame_as_split_frames_fails():
    broken = wire.HEADER.pack(3, wire.KIND_STEP) + b"\xff\x00\x01"  # not marshal data
    for data in (broken, FRAMES[1] + broken, FRAMES[0] + broken + FRAMES[1]):
        with pytest.raises(ValueError) as expected:
            wire.split_frames(data)
        with pytest.raises(ValueError) as got:
            wire.split_runs(data)
        assert str(got.value) == str(expected.value)
    with pytest.raises(TypeError, match="split_runs"):
        _wire_pack.split_runs(bytearray(FRAMES[1]), PackedStep, wire.decode_step)


def test_a_reads_step_runs_are_counted_as_their_frames_would_be(monkeypatch):
    """Refused step frames are decode errors, every step frame received and, once stopped, safe."""
    receiver = OtlpReceiver()
    process_env(monkeypatch, receiver)
    monkeypatch.setenv(names.ENV_SPAN_BACKEND, "fast")
    read_fd, write_fd = os.pipe()
    process = builder_child.SpanProcess(("test", 0, WALL_BASE_NS, False, 2.0), write_fd)
    try:
        frames, _ = wire.split_runs(b"".join(FRAMES[1:9]))  # the flush left out: no checkpoint
        process.handle(frames)
        counters = process.counters()
        process.stop()
    finally:
        process.report_out.close()
        receiver.close()
    with os.fdopen(read_fd) as reports:
        final = [json.loads(line) for line in reports][-1]
    step_frames = sum(1 for frame in FRAMES[1:9] if frame[4] == wire.KIND_STEP)
    assert (counters["records_received"], counters["decode_errors"]) == (step_frames + 1, 3 + 1)  # + the request
    assert (counters["steps_built"], counters["steps_unsampled"]) == (3, 1)
    assert final["records_safe"] == final["records_received"] == step_frames + 1


VALUE = st.one_of(
    st.integers(-(2**31), 2**31 - 1),
    st.integers(-(2**63), 2**63),  # past int32: marshal's long form, up to 4 digits read here, more by marshal
    st.sampled_from([2**31, -(2**31) - 1, 2**60 - 1, -(2**60) + 1, 2**60, 2**45]),
    st.none(),
    st.floats(allow_nan=False),
    st.binary(max_size=8),
    st.text(max_size=4),
)


@settings(max_examples=300, deadline=None)
@given(
    steps=st.lists(
        st.one_of(
            st.tuples(*[VALUE] * 10, st.binary(max_size=60)),  # the usual shape
            st.lists(VALUE, min_size=9, max_size=12).map(tuple),
        ),
        max_size=5,
    ),
    cut=st.integers(0, 2**16),
)
def test_split_runs_reads_any_step_frame_as_marshal_and_decode_step_do(steps, cut):
    """Step frames of the usual form (read without marshal) and of any other (ints of every size,
    other types, other lengths): `split_runs` equals `split_frames` then `decode_step`, wherever the
    read ends."""
    data = b"".join(wire.frame(wire.KIND_STEP, fields) for fields in steps) + FRAMES[6]
    data = data[: cut % (len(data) + 1)]
    got, used = wire.split_runs(data)
    frames, expected_used = wire.split_frames(data)
    assert (typed(got), used) == (typed(runs_of(frames)), expected_used)


def typed(items: list[tuple[int, Any]]) -> list:
    """Each step's fields with their types (1 == 1.0 == True: the types are compared too)."""
    return [
        (kind, [[(type(v), v) for v in step] for step in fields[0]], fields[1])
        if kind == wire.KIND_STEP
        else (kind, fields)
        for kind, fields in items
    ]


def _long_frame(digits: list[int], negative: bool = False) -> bytes:
    """A step frame whose start_ts is marshal's long form with these 15-bit digits, as given."""
    good = wire.frame(wire.KIND_STEP, _step_fields(0))[wire.HEADER.size :]
    head = good[:10]  # '(' and the count, then step_index as TYPE_INT
    rest = good[15:]  # past start_ts's TYPE_INT
    count = -len(digits) if negative else len(digits)
    long = b"l" + count.to_bytes(4, "little", signed=True) + b"".join(d.to_bytes(2, "little") for d in digits)
    payload = head + long + rest
    return wire.HEADER.pack(len(payload), wire.KIND_STEP) + payload


@pytest.mark.parametrize(
    "digits, negative",
    [
        ([1, 2, 3], False),
        ([1, 2, 3], True),
        ([0x7FFF, 0x7FFF, 0x7FFF, 0x7FFF], False),
        ([5], False),  # a long form for a small value: marshal reads it too
        ([1, 0x8000], False),  # a digit marshal takes (its bound is inclusive)
        ([1, 0], False),  # unnormalised: marshal refuses it
        ([0xFFFF], False),  # a negative digit: refused
        ([1, 2, 3, 4, 5], False),  # more digits than read here
    ],
)
def test_a_step_frames_long_ints_read_as_marshal_reads_them(digits, negative):
    data = _long_frame(digits, negative)
    try:
        expected = runs_of(wire.split_frames(data)[0])
    except ValueError as error:
        with pytest.raises(ValueError, match=re.escape(str(error))):
            wire.split_runs(data)
        return
    got, _ = wire.split_runs(data)
    assert typed(got) == typed(expected) and got[0][1][0]
