"""The ingress middleware's `send` in C (`instrumentation/server/_send_guard.c`): which messages
`BodySender` stamps itself and which it hands to the middleware's own coroutine, and `SendGuard`
noting a failed write before the error goes on (the whole middleware: tests/test_instrumentation_asgi.py)."""

from __future__ import annotations

import asyncio

import pytest

from phaselens.instrumentation.hotpath.timeline import RequestTimeline
from phaselens.instrumentation.server._send_guard import BodySender, SendGuard


def body(data: bytes = b"data: x\n\n", more_body=True) -> dict:
    return {"type": "http.response.body", "body": data, "more_body": more_body}


class Rig:
    def __init__(self) -> None:
        self.now = 100
        self.handle = RequestTimeline(lambda: self.now, received_ts=1)
        self.sent: list = []
        self.tracked: list = []
        self.gone = 0
        self.sender = BodySender(self.handle, self.send, self.track, self.client_gone)

    async def send(self, message) -> None:
        if "raise" in message:
            raise message["raise"]
        self.sent.append(message)

    async def track(self, message) -> None:
        self.tracked.append(message)

    def client_gone(self) -> None:
        self.gone += 1


def test_until_the_first_content_chunks_send_returned_every_message_is_tracked():
    rig = Rig()
    rig.handle.output_ready()
    messages = [{"type": "http.response.start", "status": 200}, body(), body(b"", more_body=False)]
    for message in messages:
        asyncio.run(rig.sender(message))
    assert rig.tracked == messages and rig.sent == []
    assert (rig.handle.body_bytes, rig.handle.first_chunk_ts) == (0, 0)


def test_later_body_chunks_are_stamped_here_and_sent_the_last_one_is_tracked():
    rig = Rig()
    rig.handle.body_sending(5, True)
    rig.handle.chunk_sent()  # the first content chunk went through the middleware's own path
    rig.handle.output_ready()
    rig.now = 200
    asyncio.run(rig.sender(body(b"abc")))  # carries the output taken
    rig.now = 300
    asyncio.run(rig.sender(body(b"de")))  # carries nothing new
    asyncio.run(rig.sender(body(None)))
    done = body(b"", more_body=False)
    asyncio.run(rig.sender(done))
    assert [m["body"] for m in rig.sent] == [b"abc", b"de", None] and rig.tracked == [done]
    handle = rig.handle
    assert (handle.last_chunk_ts, handle.body_bytes, handle.output_pending) == (200, 10, False)
    assert handle.sends.tolist() == [100, 5, 200, 8, 300, 10]
    for odd in ({"type": "http.response.body", "body": b"x", "more_body": 1}, [("type", "x")], {"type": b"x"}):
        asyncio.run(rig.sender(odd))  # not ASGI's plain shape: the middleware's own path decides
    assert len(rig.tracked) == 4 and handle.body_bytes == 10


def test_a_failed_write_notes_the_client_gone_a_cancellation_does_not():
    rig = Rig()
    rig.handle.body_sending(5, True)
    rig.handle.chunk_sent()
    with pytest.raises(ConnectionResetError):
        asyncio.run(rig.sender({**body(), "raise": ConnectionResetError()}))
    with pytest.raises(asyncio.CancelledError):
        asyncio.run(rig.sender({**body(), "raise": asyncio.CancelledError()}))
    assert rig.gone == 1


def test_the_guard_by_hand_and_its_arguments():
    gone: list = []

    async def two_steps():
        await asyncio.sleep(0)
        raise OSError("reset")

    guard = SendGuard(two_steps(), lambda: gone.append(1))
    assert guard.send(None) is None
    with pytest.raises(OSError):
        guard.send(None)
    thrown = SendGuard(two_steps(), lambda: gone.append(2))
    thrown.send(None)
    with pytest.raises(KeyError):
        thrown.throw(KeyError("k"))
    closed = SendGuard(two_steps(), lambda: gone.append(3))
    closed.send(None)
    closed.close()
    assert gone == [1, 2]
    with pytest.raises(TypeError, match="not awaitable"):
        SendGuard(5, print)
    with pytest.raises(TypeError, match="request timeline"):
        BodySender(object(), print, print, print)
