"""ClickHouse RowBinary values, written in Python for the logs and metrics rows (spans have the C
renderer). Each function appends one value to a bytearray.

Encodings: String = LEB128 length + UTF-8 bytes (LowCardinality(String) the same); UInt8/UInt32/
UInt64/Int32/Int64/Float64 little endian; Bool one byte; DateTime64(9) = Int64 nanoseconds since the
epoch; Array(T) and Map(K, V) = LEB128 count + items (a Map's items key, value).
"""

from __future__ import annotations

import struct
from collections.abc import Iterable

_U8 = struct.Struct("<B")
_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")
_I32 = struct.Struct("<i")
_I64 = struct.Struct("<q")
_F64 = struct.Struct("<d")


def uleb(out: bytearray, n: int) -> None:
    while n >= 0x80:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)


def string(out: bytearray, s: str) -> None:
    raw = s.encode()
    uleb(out, len(raw))
    out += raw


def u8(out: bytearray, n: int) -> None:
    out += _U8.pack(n)


def u32(out: bytearray, n: int) -> None:
    out += _U32.pack(n)


def u64(out: bytearray, n: int) -> None:
    out += _U64.pack(n)


def i32(out: bytearray, n: int) -> None:
    out += _I32.pack(n)


def datetime64_ns(out: bytearray, unix_ns: int) -> None:
    """DateTime64(9): the ticks are the nanoseconds themselves (clamped into Int64's range)."""
    out += _I64.pack(min(unix_ns, (1 << 63) - 1))


def f64(out: bytearray, x: float) -> None:
    out += _F64.pack(x)


def string_map(out: bytearray, m: dict[str, str]) -> None:
    uleb(out, len(m))
    for key, value in m.items():
        string(out, key)
        string(out, value)


def u64_array(out: bytearray, values: Iterable[int]) -> None:
    items = list(values)
    uleb(out, len(items))
    out += struct.pack(f"<{len(items)}Q", *items)


def f64_array(out: bytearray, values: Iterable[float]) -> None:
    items = list(values)
    uleb(out, len(items))
    out += struct.pack(f"<{len(items)}d", *items)
