"""Incremental Server-Sent Events parser: bytes in (any chunking), events out.

Follows the WHATWG event-stream grammar: lines end in CRLF, LF or CR (a CRLF split across two
network chunks is one line end); `:` starts a comment; `field: value` strips one space after the
colon; `data` lines of one event join with "\\n"; a blank line dispatches the event; an event with no
`data` line is not dispatched. Where the specification says "ignore", this parser is strict,
because a benchmark that silently skips garbage reports wrong numbers: unknown field names, a
non-integer `retry`, invalid UTF-8, an over-long line and a stream that ends inside an event raise
`SSEError`.
"""

from __future__ import annotations

from dataclasses import dataclass

DONE = "[DONE]"  # OpenAI's end-of-stream sentinel, sent as `data: [DONE]`
MAX_LINE_BYTES = 4 * 1024 * 1024
_LINE_ENDS = (b"\n", b"\r")


class SSEError(ValueError):
    """The byte stream is not a well-formed event stream."""


@dataclass(slots=True)
class SSEEvent:
    data: str
    event: str = "message"
    id: str | None = None


@dataclass(slots=True)
class SSEParser:
    """Feed bytes with `feed()`; it returns the events completed by them. Call `close()` at EOF."""

    max_line_bytes: int = MAX_LINE_BYTES
    _tail: bytes = b""  # an unterminated line from the previous chunk
    _skip_lf: bool = False  # the previous chunk ended in CR: a leading LF belongs to it
    _started: bool = False
    _data: list[str] | None = None
    _event: str = ""
    _id: str | None = None

    def feed(self, chunk: bytes) -> list[SSEEvent]:
        if not chunk:
            return []
        if self._skip_lf and chunk[:1] == b"\n":
            chunk = chunk[1:]
        self._skip_lf = False
        buf = self._tail + chunk if self._tail else chunk
        self._tail = b""
        if self._started and self._data is None and not self._event and b"\r" not in buf:
            return self._blocks(buf)
        return self._lines(buf)

    def _blocks(self, buf: bytes) -> list[SSEEvent]:
        """Fast path, at an event boundary with LF-only line ends: split whole events on a blank line;
        a lone `data: …` line is the event, anything else goes through the line grammar."""
        blocks = buf.split(b"\n\n")
        rest = blocks.pop()
        events: list[SSEEvent] = []
        for block in blocks:
            if block[:6] == b"data: " and b"\n" not in block:
                try:
                    events.append(SSEEvent(block[6:].decode("utf-8"), "message", self._id))
                except UnicodeDecodeError as exc:
                    raise SSEError(f"invalid UTF-8 in event stream: {exc}") from None
            else:
                events += self._lines(block + b"\n\n")
        if rest:
            events += self._lines(rest)
        return events

    def _lines(self, buf: bytes) -> list[SSEEvent]:
        """The line grammar: complete lines are parsed, an unterminated last line waits in `_tail`."""
        lines = buf.splitlines(keepends=True)
        if lines and not lines[-1].endswith(_LINE_ENDS):
            self._tail = lines.pop()
            if len(self._tail) > self.max_line_bytes:
                raise SSEError(f"line longer than {self.max_line_bytes} bytes")
        if buf.endswith(b"\r"):
            self._skip_lf = True
        events: list[SSEEvent] = []
        for raw in lines:
            event = self._line(raw.rstrip(b"\r\n"))
            if event is not None:
                events.append(event)
        return events

    def close(self) -> None:
        """End of stream: raise if it stopped inside a line or an undispatched event."""
        if self._tail or self._data is not None:
            raise SSEError("stream ended inside an event (no terminating blank line)")

    def _line(self, raw: bytes) -> SSEEvent | None:
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise SSEError(f"invalid UTF-8 in event stream: {exc}") from None
        if not self._started:
            self._started = True
            line = line.removeprefix("\ufeff")
        if not line:
            return self._dispatch()
        if line[0] == ":":
            return None
        name, sep, value = line.partition(":")
        if sep and value[:1] == " ":
            value = value[1:]
        if name == "data":
            if self._data is None:
                self._data = []
            self._data.append(value)
        elif name == "event":
            self._event = value
        elif name == "id":
            self._id = value if "\0" not in value else self._id
        elif name == "retry":
            if not value.isdigit():
                raise SSEError(f"retry field is not an integer: {value!r}")
        else:
            raise SSEError(f"unknown field {name!r} in line {line[:80]!r}")
        return None

    def _dispatch(self) -> SSEEvent | None:
        data, event = self._data, self._event or "message"
        self._data, self._event = None, ""
        if data is None:
            return None
        return SSEEvent(data="\n".join(data), event=event, id=self._id)
