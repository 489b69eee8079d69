"""The sinks' bounded hand-off (`pipeline/_handoff.c`): order, the bound and its counts, close, and
producers on several threads against one draining consumer (nothing lost, nothing counted twice)."""

from __future__ import annotations

import threading

import pytest

from phaselens.instrumentation.pipeline._handoff import BoundedHandOff


def test_items_come_out_oldest_first_and_the_queue_is_left_empty() -> None:
    handoff = BoundedHandOff(8)
    assert [handoff.offer(i) for i in range(5)] == [True] * 5
    assert len(handoff) == 5
    assert handoff.drain() == [0, 1, 2, 3, 4]
    assert len(handoff) == 0 and handoff.drain() == []
    handoff.offer("next")
    assert handoff.drain() == ["next"]
    assert (handoff.offered, handoff.dropped) == (6, 0)


def test_a_full_queue_drops_the_new_item_and_counts_it() -> None:
    handoff = BoundedHandOff(3)
    assert [handoff.offer(i) for i in range(5)] == [True, True, True, False, False]
    assert (handoff.offered, handoff.dropped, len(handoff)) == (5, 2, 3)
    assert handoff.drain() == [0, 1, 2]
    assert handoff.offer(9) and handoff.drain() == [9]


def test_close_counts_what_waited_and_refuses_later_offers() -> None:
    handoff = BoundedHandOff(4)
    handoff.offer("a")
    handoff.offer("b")
    handoff.close()
    assert (handoff.capacity, handoff.dropped, len(handoff)) == (0, 2, 0)
    assert handoff.offer("c") is False
    assert (handoff.offered, handoff.dropped) == (3, 3)


def test_a_bad_capacity_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="capacity must be >= 0"):
        BoundedHandOff(-1)
    with pytest.raises(TypeError):
        BoundedHandOff("8")  # type: ignore[arg-type]


def test_producers_on_threads_lose_nothing_to_a_draining_consumer() -> None:
    handoff, producers, per_producer = BoundedHandOff(64), 4, 20_000
    taken: list[tuple[int, int]] = []
    done = threading.Event()

    def produce(index: int) -> None:
        for n in range(per_producer):
            handoff.offer((index, n))

    def consume() -> None:
        while not done.is_set() or len(handoff):
            taken.extend(handoff.drain())

    consumer = threading.Thread(target=consume)
    consumer.start()
    threads = [threading.Thread(target=produce, args=(i,)) for i in range(producers)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    done.set()
    consumer.join()
    assert handoff.offered == producers * per_producer
    assert len(taken) == handoff.offered - handoff.dropped and len(set(taken)) == len(taken)
    for index in range(producers):  # each producer's items in the order it offered them
        mine = [n for i, n in taken if i == index]
        assert mine == sorted(mine)
