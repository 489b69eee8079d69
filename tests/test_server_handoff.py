"""The engine thread's hand-off to the event loop (reference_server.serving.handoff): in order,
and what one step hands out while the loop is busy costs the loop one wake-up."""

from __future__ import annotations

import asyncio
import threading

import pytest

from phaselens.reference_server.serving.handoff import Mailbox


class CountingLoop:
    """The loop as the mailbox sees it, counting its cross-thread wake-ups."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop, self.wakeups = loop, 0

    def call_soon_threadsafe(self, callback) -> None:
        self.wakeups += 1
        self.loop.call_soon_threadsafe(callback)


def test_a_burst_posted_while_the_loop_is_busy_arrives_in_order_with_one_wakeup():
    async def main() -> tuple[list[int], int, list[int], int]:
        loop = asyncio.get_running_loop()
        box = Mailbox.of(loop)
        assert Mailbox.of(loop) is box
        counting = box.loop = CountingLoop(loop)  # type: ignore[assignment]
        got: list[int] = []
        burst = threading.Thread(target=lambda: [box.post(got.append, i) for i in range(100)])
        burst.start()
        burst.join()  # the loop ran nothing meanwhile: one delivery carries the whole burst
        while len(got) < 100:
            await asyncio.sleep(0.001)
        first = (list(got), counting.wakeups)
        box.post(got.append, 100)  # after the delivery ran: a new one
        while len(got) < 101:
            await asyncio.sleep(0.001)
        return (*first, got[100:], counting.wakeups)

    got, wakeups, later, total = asyncio.run(main())
    assert got == list(range(100)) and wakeups == 1
    assert later == [100] and total == 2


def test_a_closed_loop_raises_and_leaves_no_delivery_pending():
    loop = asyncio.new_event_loop()
    box = Mailbox(loop)
    loop.close()
    for _ in range(2):  # the second post must try again (and raise), not ride on a dead delivery
        with pytest.raises(RuntimeError):
            box.post(print, "x")
