"""The incremental SSE parser: any chunking gives the same events; malformed streams raise."""

from __future__ import annotations

import pytest

from instrumentation.sse import SSEError, SSEParser

STREAM = (
    b"\xef\xbb\xbf: a comment line\r\n"
    b"data: {\"a\": 1}\r\n\r\n"
    b"event: error\ndata: first line\ndata:second line\nid: 7\n\n"
    b"retry: 1000\rdata: cr only\r\r"
    b"event: ignored-without-data\n\n"
    b"data: \xc3\xa9t\xc3\xa9\n\n"
    b"data: [DONE]\n\n"
)
EXPECTED = [("{\"a\": 1}", "message", None), ("first line\nsecond line", "error", "7"),
            ("cr only", "message", "7"), ("été", "message", "7"), ("[DONE]", "message", "7")]


def _events(chunks) -> list[tuple]:
    parser = SSEParser()
    out = [(e.data, e.event, e.id) for c in chunks for e in parser.feed(c)]
    parser.close()
    return out


def test_whole_stream_gives_every_event():
    assert _events([STREAM]) == EXPECTED


@pytest.mark.parametrize("size", [1, 2, 3, 7, 13])
def test_any_chunking_gives_the_same_events(size):
    assert _events([STREAM[i:i + size] for i in range(0, len(STREAM), size)]) == EXPECTED


def test_every_two_way_split_gives_the_same_events():
    for cut in range(len(STREAM) + 1):
        assert _events([STREAM[:cut], STREAM[cut:]]) == EXPECTED, cut


def test_crlf_split_between_chunks_is_one_line_end():
    parser = SSEParser()
    assert parser.feed(b"data: x\r") == []
    assert [e.data for e in parser.feed(b"\n\r\n")] == ["x"]


def test_event_is_returned_by_the_chunk_that_completes_it():
    parser = SSEParser()
    assert parser.feed(b"data: {\"tok") == []
    assert parser.feed(b"en\": 1}\n") == []
    assert [e.data for e in parser.feed(b"\n")] == ['{"token": 1}']


@pytest.mark.parametrize("bad, message", [
    (b"dta: x\n\n", "unknown field"),
    (b"retry: soon\n\n", "retry"),
    (b"data: \xff\xfe\n\n", "UTF-8"),
    (b"<html>oops</html>\n\n", "unknown field"),
])
def test_malformed_lines_raise(bad, message):
    with pytest.raises(SSEError, match=message):
        SSEParser().feed(bad)


@pytest.mark.parametrize("tail", [b"data: cut", b"data: no blank line\n"])
def test_stream_ending_inside_an_event_raises_at_close(tail):
    parser = SSEParser()
    parser.feed(tail)
    with pytest.raises(SSEError, match="ended inside"):
        parser.close()


def test_over_long_line_raises():
    with pytest.raises(SSEError, match="longer"):
        SSEParser(max_line_bytes=16).feed(b"data: " + b"x" * 32)
