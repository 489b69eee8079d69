"""The span-builder process's FrameReader over a real pipe: whole frames from each read, a frame cut
across reads kept for the next, a frame longer than a read, EOF."""

from __future__ import annotations

import os

from phaselens.instrumentation.process import builder_child, wire


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
