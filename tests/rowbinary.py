"""The collector's RowBinary rows read back into tuples (INSERT_COLUMNS order), and written again."""

from __future__ import annotations

import struct

from phaselens.collectors.schema import INSERT_COLUMN_TYPES


class _Reader:
    def __init__(self, data: bytes):
        self.data, self.i = data, 0

    def uleb(self) -> int:
        value = shift = 0
        while True:
            byte = self.data[self.i]
            self.i += 1
            value |= (byte & 0x7F) << shift
            if byte < 0x80:
                return value
            shift += 7

    def u64(self) -> int:
        self.i += 8
        return struct.unpack_from("<Q", self.data, self.i - 8)[0]

    def string(self) -> str:
        n = self.uleb()
        self.i += n
        return self.data[self.i - n : self.i].decode()

    def map(self) -> dict[str, str]:
        pairs = [(self.string(), self.string()) for _ in range(self.uleb())]
        assert len({k for k, _ in pairs}) == len(pairs), "a Map with a repeated key"
        return dict(pairs)

    def value(self, type_: str):
        if type_.startswith("Array("):
            return [self.value(type_[6:-1]) for _ in range(self.uleb())]
        if type_.startswith("Map("):
            return self.map()
        if type_ in ("DateTime64(9)", "UInt64"):
            return self.u64()
        return self.string()


def read_rows(data: bytes) -> list[tuple]:
    """RowBinary → row tuples; DateTime64(9) as the unsigned nanoseconds it was written from."""
    reader, rows = _Reader(data), []
    while reader.i < len(data):
        rows.append(tuple(reader.value(type_) for _, type_ in INSERT_COLUMN_TYPES))
    return rows


def uleb(n: int) -> bytes:
    """ULEB128: RowBinary's lengths, and protobuf's varints."""
    out = bytearray()
    while n >= 0x80:
        out.append(n & 0x7F | 0x80)
        n >>= 7
    return bytes(out) + bytes([n])


def _write(value, type_: str) -> bytes:
    if type_.startswith("Array("):
        return uleb(len(value)) + b"".join(_write(v, type_[6:-1]) for v in value)
    if type_.startswith("Map("):
        return uleb(len(value)) + b"".join(_write(k, "String") + _write(v, "String") for k, v in value.items())
    if type_ in ("DateTime64(9)", "UInt64"):
        return struct.pack("<Q", value)
    return uleb(len(value.encode())) + value.encode()


def write_rows(rows: list[tuple]) -> bytes:
    """Row tuples (as read_rows gives them) → RowBinary, for inserting hand-made rows."""
    return b"".join(_write(v, type_) for row in rows for v, (_, type_) in zip(row, INSERT_COLUMN_TYPES, strict=False))
