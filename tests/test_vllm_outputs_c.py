"""The vLLM hooks' C part (`integrations/vllm/_outputs.c`): `output_taken` on a request's handle;
`Taking`, the awaitable the `get` wrapper returns around vLLM's coroutine: the output it returns
taken, everything else (what it yields, a cancellation, an error, `send` / `throw` / `close` driven
by hand) passed through as by the coroutine itself; `engine_step`'s record against its formulas."""

from __future__ import annotations

import asyncio
import sys
from types import SimpleNamespace

import pytest

from phaselens.instrumentation.hotpath.records import StepStats
from phaselens.integrations.vllm._outputs import KV_SCALE, Taking, engine_step, output_taken
from tests.instrumentation_fixtures import http_scope, make_rig


def output(*texts: str, finished: bool = False) -> SimpleNamespace:
    """A vLLM RequestOutput as the hook reads it."""
    return SimpleNamespace(outputs=[SimpleNamespace(text=t) for t in texts], finished=finished)


@pytest.fixture
def rig():
    return make_rig()


def handle_of(rig, first_token_ns: int | None = 1_000, tokens: tuple[int, ...] = ()):
    handle = rig.telemetry.open_request(http_scope(), managed=True)
    if first_token_ns is not None:
        handle.first_token_ts = first_token_ns
    for n in tokens:
        handle.token_at(2_000, n)
    return handle


def test_the_first_output_with_text_is_output_ready_with_the_tokens_handed_so_far(rig):
    handle = handle_of(rig, tokens=(1, 2))
    rig.clock.now_ns = 5_000
    output_taken(handle, output(""))  # renders nothing yet: not ready
    assert (handle.output_ready_ts, handle.output_pending) == (0, False)
    output_taken(handle, output("", "é"))  # one completion of n with text is enough
    assert (handle.output_ready_ts, handle.visible_tokens, handle.output_pending) == (5_000, 4, True)
    handle.chunk_sent()
    rig.clock.now_ns = 6_000
    output_taken(handle, output("x"))  # later text: pending again, the first stamp kept
    assert (handle.output_ready_ts, handle.visible_tokens, handle.output_pending) == (5_000, 4, True)
    handle.chunk_sent()
    output_taken(handle, output("", finished=True))  # the empty last output carries nothing
    assert handle.output_pending is False


def test_a_finished_output_without_text_is_the_answer_and_nothing_counts_before_the_first_token(rig):
    early = handle_of(rig, first_token_ns=None)
    output_taken(early, output("text"))
    assert (early.output_ready_ts, early.output_pending) == (0, False)
    prefill_half = handle_of(rig)
    rig.clock.now_ns = 7_000
    output_taken(prefill_half, output("", finished=True))
    assert (prefill_half.output_ready_ts, prefill_half.visible_tokens, prefill_half.output_pending) == (7_000, 1, True)
    no_outputs = handle_of(rig)
    output_taken(no_outputs, SimpleNamespace())
    assert no_outputs.output_ready_ts == 0


def test_output_taken_refuses_what_is_not_a_request_output(rig):
    handle = handle_of(rig)
    with pytest.raises(TypeError):
        output_taken(handle, SimpleNamespace(outputs=5))
    with pytest.raises(TypeError):
        output_taken(handle)  # type: ignore[call-arg]
    assert handle.output_ready_ts == 0


class Stream:
    """vLLM's collector, reduced: `get` waits until `put`."""

    def __init__(self) -> None:
        self.output = None
        self.ready = asyncio.Event()

    async def get(self):
        while (out := self.output) is None:
            await self.ready.wait()
        self.output = None
        if isinstance(out, Exception):
            raise out
        return out

    def put(self, out) -> None:
        self.output = out
        self.ready.set()


def test_taking_awaits_the_coroutine_and_takes_what_it_returns(rig):
    handle = handle_of(rig)
    errors: list = []

    async def main():
        stream = Stream()
        task = asyncio.ensure_future(Taking(stream.get(), handle, errors.append))
        for _ in range(3):
            await asyncio.sleep(0)  # it waits: the coroutine's yields pass through
        assert not task.done()
        rig.clock.now_ns = 9_000
        stream.put(out := output("hi"))
        assert await task is out

    asyncio.run(main())
    assert (handle.output_ready_ts, handle.output_pending, errors) == (9_000, True, [])


def test_a_cancelled_or_failing_get_passes_through_untaken(rig):
    handle = handle_of(rig)
    errors: list = []

    async def main():
        stream = Stream()
        waiting = asyncio.ensure_future(Taking(stream.get(), handle, errors.append))
        await asyncio.sleep(0)
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting
        stream.put(RuntimeError("engine died"))
        with pytest.raises(RuntimeError, match="engine died"):
            await Taking(stream.get(), handle, errors.append)

    asyncio.run(main())
    assert (handle.output_ready_ts, errors) == (0, [])


def test_a_failure_to_take_goes_to_on_error_and_the_output_on(rig):
    handle = handle_of(rig)
    errors: list = []
    bad = SimpleNamespace(outputs=5)

    async def main():
        stream = Stream()
        stream.put(bad)
        return await Taking(stream.get(), handle, errors.append)

    assert asyncio.run(main()) is bad
    assert [type(e) for e in errors] == [TypeError]


def test_any_awaitable_and_the_generator_protocol_by_hand(rig):
    handle = handle_of(rig)

    async def main():
        future = asyncio.get_running_loop().create_future()
        future.set_result(output("a"))
        return await Taking(future, handle, print)

    assert asyncio.run(main()).outputs[0].text == "a"
    assert handle.output_pending is True
    with pytest.raises(TypeError, match="not awaitable"):
        Taking(5, handle, print)
    coroutine = Stream().get()
    with pytest.raises(TypeError, match="callable"):
        Taking(coroutine, handle, None)  # type: ignore[arg-type]
    coroutine.close()

    async def two_steps():
        await asyncio.sleep(0)
        return output("b")

    handle.chunk_sent()
    taking = Taking(two_steps(), handle, print)
    assert taking.send(None) is None  # asyncio.sleep(0)'s bare yield
    with pytest.raises(StopIteration) as stop:
        taking.send(None)
    assert stop.value.value.outputs[0].text == "b" and handle.output_pending is True
    thrown = Taking(two_steps(), handle, print)
    next(iter(thrown.__await__()))
    with pytest.raises(KeyError):
        thrown.throw(KeyError("x"))
    closed = Taking(two_steps(), handle, print)
    closed.send(None)
    closed.close()


def test_taking_under_a_tracer_goes_through_send_and_throw(rig):
    """With a trace function set (a debugger, coverage) the interpreter drives an awaited object
    through its `send` method rather than `am_send`."""
    handle = handle_of(rig)
    sys.settrace(lambda *args: None)
    try:

        async def main():
            stream = Stream()
            task = asyncio.ensure_future(Taking(stream.get(), handle, print))
            await asyncio.sleep(0)
            stream.put(output("t"))
            return await task

        assert asyncio.run(main()).outputs[0].text == "t"
    finally:
        sys.settrace(None)
    assert handle.output_pending is True


class Observer:
    def __init__(self) -> None:
        self.steps: list = []

    def step(self, stats, members) -> None:
        self.steps.append((stats, members))


@pytest.mark.parametrize(
    ("end_s", "floor_ts", "iteration", "scheduler", "expected"),
    [
        # the batch's stamp, a floor, vLLM's stats: decode = generated − first tokens
        (
            1.5,
            7,
            SimpleNamespace(num_prompt_tokens=16, num_generation_tokens=5, num_preempted_reqs=1),
            SimpleNamespace(kv_cache_usage=0.0000025, num_waiting_reqs=3),
            (7, 1_500_000_000, 16, 3, 2, KV_SCALE, 1, 3),
        ),
        # no stamp: now; no floor: start = end; more first tokens than generated: decode 0; 2.5 rounds to even
        (
            None,
            0,
            SimpleNamespace(num_prompt_tokens=0, num_generation_tokens=1, num_preempted_reqs=0),
            SimpleNamespace(kv_cache_usage=0.0000035),
            (900, 900, 0, 0, 4, KV_SCALE, 0, 0),
        ),
        # no iteration stats, no scheduler stats (a test's None)
        (0.0, 0, None, None, (900, 900, 0, 0, 0, 0, 0, 0)),
        # an int usage (a whole cache)
        (
            2.0,
            0,
            None,
            SimpleNamespace(kv_cache_usage=1, num_waiting_reqs=0),
            (2 * 10**9,) * 2 + (0, 0, KV_SCALE, KV_SCALE, 0, 0),
        ),
    ],
)
def test_an_engine_step_is_recorded_by_its_formulas(end_s, floor_ts, iteration, scheduler, expected):
    observer, members = Observer(), [object()]
    end = engine_step(observer, members, scheduler, iteration, end_s, floor_ts, 2, lambda: 900)
    ((stats, got_members),) = observer.steps
    assert type(stats) is StepStats and tuple(stats) == expected
    assert got_members is members and end == stats.end_ts


def test_an_engine_step_that_cannot_be_read_records_nothing():
    observer = Observer()
    with pytest.raises(AttributeError):
        engine_step(observer, [], None, SimpleNamespace(num_prompt_tokens=1), 1.0, 0, 0, lambda: 1)
    with pytest.raises(TypeError):
        engine_step(observer, [], None, None, "soon", 0, 0, lambda: 1)
    with pytest.raises(ValueError):
        engine_step(observer, [], None, None, 1.0, -1, 0, lambda: 1)
    assert observer.steps == []
