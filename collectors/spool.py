"""Append-only, fsync'd spool of accepted OTLP payloads: what makes an acknowledged export durable.

Layout: `DIR/seg-<n>.log` segments of records `header | payload`, header = magic, payload length,
span count, crc32 (little endian u32 each). A restart always appends to a new segment, so a torn
tail (crash mid-write, never acknowledged) only ends the reading of its own segment.
`DIR/pending` names the batch the writer is inserting (segment, start, end): on restart that exact
range is replayed first with the same deduplication token (which includes the random spool id in
`DIR/id`), so nothing is inserted twice. `DIR/quarantine/` keeps, as received, the requests that the
writer could not render (spooled by an older, looser version): set aside, never silently lost.

Group commit: appenders write under a lock, then one of them fsyncs for all that wrote before it.

Crash window: a request spooled just before a crash was never acknowledged, so its client retries
it, byte for byte, after the restart. The previous run's newest segment keeps the digests of its
last RETRY_WINDOW_BYTES of records; the same bytes again are acknowledged without a second copy.
Out of space (ENOSPC, EDQUOT, EFBIG): the partial record is cut off again and the export refused as
retryable, as at the byte cap; appends resume when space returns.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import os
import re
import struct
import threading
import uuid
import zlib
from dataclasses import dataclass, field
from pathlib import Path

_HEADER = struct.Struct("<IIII")
_MAGIC = 0x4F544C50  # "OTLP"
_SEGMENT = re.compile(r"^seg-(\d{12})\.log$")
RETRY_WINDOW_BYTES = 16 << 20  # the previous run's last records whose acknowledgement may have died
_OUT_OF_SPACE = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)


class SpoolLocked(OSError):
    """Another process (collector) owns this spool directory."""


class SpoolFull(RuntimeError):
    """Backlog at its byte cap: the receiver answers with a retryable code."""


@dataclass(slots=True)
class Record:
    segment: int
    start: int
    end: int
    span_count: int
    payload: bytes


@dataclass(slots=True)
class Pending:
    segment: int
    start: int
    end: int


@dataclass(slots=True)
class Spool:
    directory: str
    max_bytes: int = 1 << 30
    segment_bytes: int = 64 << 20
    _lock: threading.Lock = field(default_factory=threading.Lock, init=False)
    _sync_lock: threading.Lock = field(default_factory=threading.Lock, init=False)
    _data_ready: threading.Condition = field(init=False)
    _fd: int = field(default=-1, init=False)
    _segment: int = field(default=0, init=False)
    _size: int = field(default=0, init=False)
    _written_seq: int = field(default=0, init=False)
    _synced_seq: int = field(default=0, init=False)
    _durable: tuple[int, int] = field(default=(0, 0), init=False)
    backlog_bytes: int = field(default=0, init=False)
    spool_id: str = field(default="", init=False)
    _lock_fd: int = field(default=-1, init=False)
    _retried: frozenset[bytes] = field(default=frozenset(), init=False)

    def __post_init__(self) -> None:
        self._data_ready = threading.Condition(threading.Lock())
        path = Path(self.directory)
        path.mkdir(parents=True, exist_ok=True)
        self._lock_fd = os.open(path / "lock", os.O_RDWR | os.O_CREAT, 0o600)
        try:  # two writers appending to one spool would corrupt each other's replay
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self._lock_fd)
            raise SpoolLocked(f"spool {self.directory} is in use by another collector") from None
        existing = self.segments()
        pending = self.pending()
        if pending and pending.segment in existing:
            # Older segments were fully inserted before the pending batch was marked (a crash
            # may have kept one from being unlinked): only the pending one onwards is backlog.
            for segment in [s for s in existing if s < pending.segment]:
                self.drop_segment(segment)
            existing = [s for s in existing if s >= pending.segment]
        self.backlog_bytes = sum(self._path(s).stat().st_size for s in existing)
        if pending and existing and pending.segment == existing[0]:
            self.backlog_bytes -= pending.start
        # the last two: the crash may have come just after a roll, with the newest one still empty
        self._retried = frozenset(d for s in existing[-2:] for d in _digests(self._path(s), RETRY_WINDOW_BYTES))
        # Segment numbers are never reused: they are part of the deduplication tokens.
        self._open_segment(max([*existing, pending.segment if pending else 0]) + 1)
        self.spool_id = _spool_id(path)

    def _path(self, segment: int) -> Path:
        return Path(self.directory) / f"seg-{segment:012d}.log"

    def _open_segment(self, segment: int) -> None:
        self._fd = os.open(self._path(segment), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        self._segment, self._size = segment, 0
        self._durable = (segment, 0)
        _fsync_dir(self.directory)

    def segments(self) -> list[int]:
        return sorted(int(m[1]) for p in os.listdir(self.directory) if (m := _SEGMENT.match(p)))

    def append(self, payload: bytes, span_count: int) -> bool:
        """Returns once the record is on disk (fsync'd); False when these exact bytes were spooled by
        the previous run (a retry: nothing written). Raises SpoolFull at the byte cap or out of space."""
        if self._retried and _digest(payload) in self._retried:
            return False
        record = _HEADER.pack(_MAGIC, len(payload), span_count, zlib.crc32(payload)) + payload
        with self._lock:
            if self.backlog_bytes + len(record) > self.max_bytes:
                raise SpoolFull(f"spool backlog at its cap of {self.max_bytes} bytes")
            if self._size >= self.segment_bytes:
                self._roll()
            self._write_whole(record)
            self.backlog_bytes += len(record)
            self._written_seq += 1
            mine = self._written_seq
        self._sync_through(mine)
        return True

    def _write_whole(self, record: bytes) -> None:
        """Under _lock: the record, or nothing (a partial one is cut off: it would end the segment's replay)."""
        written = 0
        try:
            while written < len(record):  # a regular file writes short only when out of space
                if not (n := os.write(self._fd, record[written:])):  # no progress, no error: do not spin
                    raise OSError(errno.ENOSPC, "no byte written")
                written += n
        except OSError as exc:
            if written:
                os.ftruncate(self._fd, self._size)
            if exc.errno in _OUT_OF_SPACE:
                raise SpoolFull(f"spool directory {self.directory} is out of space: {exc.strerror}") from None
            raise
        self._size += len(record)

    def _roll(self) -> None:
        """Under _lock: seal the current segment (durable) and open the next."""
        os.fsync(self._fd)
        os.close(self._fd)
        self._synced_seq = self._written_seq
        self._open_segment(self._segment + 1)

    def _sync_through(self, seq: int) -> None:
        with self._sync_lock:
            if self._synced_seq >= seq:
                return
            with self._lock:
                # A duplicate: another thread's append may roll (and close) the segment meanwhile.
                target, fd, durable = self._written_seq, os.dup(self._fd), (self._segment, self._size)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
            with self._lock:
                self._synced_seq = max(self._synced_seq, target)
                self._durable = max(self._durable, durable)
        with self._data_ready:
            self._data_ready.notify_all()

    def wait_for_data(self, timeout_s: float) -> None:
        with self._data_ready:
            self._data_ready.wait(timeout_s)

    def durable_end(self, segment: int) -> int | None:
        """How far `segment` may be read; None when it is sealed (read to its end)."""
        with self._lock:
            seg, offset = self._durable
        return offset if segment == seg else None

    def active_segment(self) -> int:
        with self._lock:
            return self._segment

    def read(self, segment: int, start: int, max_spans: int, stop: int | None = None) -> list[Record]:
        """Valid records from `start`, up to ~max_spans spans, the durable end, or `stop`."""
        limit = self.durable_end(segment)
        if stop is not None:
            limit = stop if limit is None else min(limit, stop)
        out, spans, offset = [], 0, start
        with open(self._path(segment), "rb") as f:
            f.seek(start)
            while spans < max_spans and (limit is None or offset < limit):
                header = f.read(_HEADER.size)
                if len(header) < _HEADER.size:
                    break
                magic, length, count, crc = _HEADER.unpack(header)
                payload = f.read(length) if magic == _MAGIC else b""
                if magic != _MAGIC or len(payload) < length or zlib.crc32(payload) != crc:
                    break  # torn tail of a crashed run: never acknowledged
                end = offset + _HEADER.size + length
                out.append(Record(segment, offset, end, count, payload))
                spans, offset = spans + count, end
        return out

    def token(self, pending: Pending) -> str:
        """insert_deduplication_token of a batch: the same on every replay, and unique to this
        spool directory (its random id), so two spools or a recreated one never collide."""
        return f"phaselens-{self.spool_id}-{pending.segment}-{pending.start}-{pending.end}"

    def pending(self) -> Pending | None:
        try:
            seg, start, end = (Path(self.directory) / "pending").read_text().split()
        except (FileNotFoundError, ValueError):
            return None
        return Pending(int(seg), int(start), int(end))

    def mark_pending(self, pending: Pending) -> None:
        """Durably records the batch about to be inserted (write, fsync, rename)."""
        tmp = Path(self.directory) / "pending.tmp"
        with open(tmp, "w") as f:
            f.write(f"{pending.segment} {pending.start} {pending.end}\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, Path(self.directory) / "pending")

    def quarantine(self, record: Record, why: str) -> Path:
        """Keeps `record`'s payload (fsync'd) in DIR/quarantine/, with why it was not inserted."""
        directory = Path(self.directory) / "quarantine"
        directory.mkdir(exist_ok=True)
        path = directory / f"seg-{record.segment:012d}-{record.start:012d}.pb"
        for target, data in ((path, record.payload), (path.with_suffix(".why"), f"{why}\n".encode())):
            with open(target, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
        _fsync_dir(str(directory))
        return path

    def inserted(self, nbytes: int) -> None:
        with self._lock:
            self.backlog_bytes -= nbytes

    def drop_segment(self, segment: int) -> None:
        """A sealed segment whose every record is in ClickHouse."""
        self._path(segment).unlink(missing_ok=True)

    def close(self) -> None:
        with self._lock:
            if self._fd >= 0:
                os.fsync(self._fd)
                os.close(self._fd)
                self._fd = -1
            if self._lock_fd >= 0:
                os.close(self._lock_fd)  # releases the flock
                self._lock_fd = -1


def _digest(payload: bytes) -> bytes:
    return hashlib.blake2b(payload, digest_size=16).digest()


def _digests(path: Path, window_bytes: int) -> set[bytes]:
    """Digests of the valid records that end within the last `window_bytes` of segment `path`."""
    size, records, offset = path.stat().st_size, [], 0
    with open(path, "rb") as f:
        while len(header := f.read(_HEADER.size)) == _HEADER.size:  # headers only: seek over payloads
            magic, length, _, crc = _HEADER.unpack(header)
            end = offset + _HEADER.size + length
            if magic != _MAGIC or end > size:
                break
            if end > size - window_bytes:
                records.append((offset + _HEADER.size, length, crc))
            f.seek(end)
            offset = end
        out = set()
        for start, length, crc in records:
            f.seek(start)
            payload = f.read(length)
            if zlib.crc32(payload) != crc:
                break  # torn tail of a crashed run
            out.add(_digest(payload))
    return out


def _spool_id(path: Path) -> str:
    id_file = path / "id"
    if not id_file.exists():
        tmp = path / "id.tmp"
        with open(tmp, "w") as f:
            f.write(uuid.uuid4().hex)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, id_file)
        _fsync_dir(str(path))
    return id_file.read_text().strip()


def _fsync_dir(directory: str) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
