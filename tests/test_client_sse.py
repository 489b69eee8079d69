"""The incremental SSE parser: any chunking gives the same events; malformed streams raise."""

from __future__ import annotations

import pytest

from phaselens.instrumentation.client.sse import SSEError, SSEParser

STREAM = (
    b"\xef\xbb\xbf: a comment line\r\n"
    b'data: {"a": 1}\r\n\r\n'
    b"event: error\ndata: first line\ndata:second line\nid: 7\n\n"
    b"retry: 1000\rdata: cr only\r\r"
    b"event: ignored-without-data\n\n"
    b"data: \xc3\xa9t\xc3\xa9\n\n"
    b"data: [DONE]\n\n"
)
EXPECTED = [
    ('{"a": 1}', "message", None),
    ("first line\nsecond line", "error", "7"),
    ("cr only", "message", "7"),
    ("été", "message", "7"),
    ("[DONE]", "message", "7"),
]

LF_STREAM = (  # LF line ends only: after the first event, whole events take the split-on-blank-line path
    b'data: {"a": 1}\n\n'
    b"data: plain\n\n\n"
    b": comment\ndata: after comment\n\n"
    b"event: error\ndata: one\ndata: two\nid: 9\n\n"
    b"data:no space\n\n"
    b"data: \xc3\xa9t\xc3\xa9\n\n"
    b"\n\ndata: [DONE]\n\n"
)
LF_EXPECTED = [
    ('{"a": 1}', "message", None),
    ("plain", "message", None),
    ("after comment", "message", None),
    ("one\ntwo", "error", "9"),
    ("no space", "message", "9"),
    ("été", "message", "9"),
    ("[DONE]", "message", "9"),
]
STREAMS = [(STREAM, EXPECTED), (LF_STREAM, LF_EXPECTED)]


def _events(chunks) -> list[tuple]:
    parser = SSEParser()
    out = [(e.data, e.event, e.id) for c in chunks for e in parser.feed(c)]
    parser.close()
    return out


@pytest.mark.parametrize("stream, expected", STREAMS)
def test_whole_stream_gives_every_event(stream, expected):
    assert _events([stream]) == expected


@pytest.mark.parametrize("stream, expected", STREAMS)
@pytest.mark.parametrize("size", [1, 2, 3, 7, 13, 40])
def test_any_chunking_gives_the_same_events(stream, expected, size):
    assert _events([stream[i : i + size] for i in range(0, len(stream), size)]) == expected


@pytest.mark.parametrize("stream, expected", STREAMS)
def test_every_two_way_split_gives_the_same_events(stream, expected):
    for cut in range(len(stream) + 1):
        assert _events([stream[:cut], stream[cut:]]) == expected, cut


def test_crlf_split_between_chunks_is_one_line_end():
    parser = SSEParser()
    assert parser.feed(b"data: x\r") == []
    assert [e.data for e in parser.feed(b"\n\r\n")] == ["x"]


def test_event_is_returned_by_the_chunk_that_completes_it():
    parser = SSEParser()
    assert parser.feed(b'data: {"tok') == []
    assert parser.feed(b'en": 1}\n') == []
    assert [e.data for e in parser.feed(b"\n")] == ['{"token": 1}']


@pytest.mark.parametrize(
    "bad, message",
    [
        (b"dta: x\n\n", "unknown field"),
        (b"retry: soon\n\n", "retry"),
        (b"data: \xff\xfe\n\n", "UTF-8"),
        (b"<html>oops</html>\n\n", "unknown field"),
    ],
)
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


def test_invalid_utf8_in_a_whole_event_raises():
    parser = SSEParser()
    parser.feed(b"data: ok\n\n")
    with pytest.raises(SSEError, match="UTF-8"):
        parser.feed(b"data: \xff\n\ndata: next\n\n")
