"""Helpers for the report tests: headless Chromium and a stdlib PNG decoder (no Pillow)."""

from __future__ import annotations

import shutil
import struct
import subprocess
import zlib
from pathlib import Path

import numpy as np

CHROMIUM_FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
    "--hide-scrollbars",
)


def chromium() -> str:
    """Path of the Debian `chromium` binary (setup.sh installs it)."""
    path = shutil.which("chromium") or shutil.which("chromium-browser")
    assert path, "chromium is not installed: apt-get install -y chromium (setup.sh does)"
    return path


def run_chromium(html: Path, work: Path, *flags: str, timeout_s: float = 60) -> subprocess.CompletedProcess:
    argv = [
        chromium(),
        *CHROMIUM_FLAGS,
        f"--user-data-dir={work / 'profile'}",
        "--enable-logging=stderr",
        "--v=0",
        *flags,
        html.resolve().as_uri(),
    ]
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s, cwd=work, check=False)


def console_messages(stderr: str) -> list[str]:
    """Page console output and script errors as Chromium logs them with --enable-logging=stderr."""
    return [line for line in stderr.splitlines() if ":CONSOLE" in line or "Uncaught" in line]


def decode_png(data: bytes) -> tuple[int, int, list[bytes]]:
    """(width, height, rows of RGB(A) bytes) of an 8-bit RGB/RGBA, non-interlaced PNG."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    pos, idat, header = 8, [], None
    while pos < len(data):
        (length,), kind = struct.unpack(">I", data[pos : pos + 4]), data[pos + 4 : pos + 8]
        body = data[pos + 8 : pos + 8 + length]
        if kind == b"IHDR":
            header = struct.unpack(">IIBBBBB", body)
        elif kind == b"IDAT":
            idat.append(body)
        pos += 12 + length
    width, height, depth, color_type, _, _, interlace = header
    assert depth == 8 and color_type in (2, 6) and interlace == 0, f"unsupported PNG {header}"
    bpp = 3 if color_type == 2 else 4
    raw, stride = zlib.decompress(b"".join(idat)), width * bpp
    rows, prev = [], bytes(stride)
    for y in range(height):
        start = y * (stride + 1)
        row = _unfilter(raw[start], bytearray(raw[start + 1 : start + 1 + stride]), prev, bpp)
        rows.append(bytes(row))
        prev = row
    return width, height, [r if bpp == 3 else _drop_alpha(r) for r in rows]


def _unfilter(ftype: int, row: bytearray, prev: bytes, bpp: int) -> bytearray:
    """PNG filter types 0-4 (RFC 2083 §6); None/Sub/Up vectorised, Average/Paeth byte by byte."""
    if ftype in (0, 1, 2):
        cur = np.frombuffer(bytes(row), dtype=np.uint8).astype(np.uint32)
        if ftype == 1:
            cur = np.cumsum(cur.reshape(-1, bpp), axis=0).ravel()
        elif ftype == 2:
            cur = cur + np.frombuffer(prev, dtype=np.uint8)
        return bytearray((cur & 0xFF).astype(np.uint8).tobytes())
    for i in range(len(row)):
        left = row[i - bpp] if i >= bpp else 0
        up, up_left = prev[i], prev[i - bpp] if i >= bpp else 0
        if ftype == 3:
            row[i] = (row[i] + (left + up) // 2) & 0xFF
        elif ftype == 4:
            p = left + up - up_left
            pa, pb, pc = abs(p - left), abs(p - up), abs(p - up_left)
            pred = left if pa <= pb and pa <= pc else up if pb <= pc else up_left
            row[i] = (row[i] + pred) & 0xFF
    return row


def _drop_alpha(row: bytes) -> bytes:
    return bytes(b for i, b in enumerate(row) if i % 4 != 3)


def colour_stats(rows: list[bytes], step: int = 3) -> tuple[int, float]:
    """(distinct colours, fraction of non-background pixels) on a sub-sampled grid."""
    colours, painted, total = set(), 0, 0
    background = rows[-1][:3]
    for row in rows[::step]:
        for x in range(0, len(row) - 2, 3 * step):
            px = row[x : x + 3]
            colours.add(px)
            painted += px != background
            total += 1
    return len(colours), painted / max(total, 1)
