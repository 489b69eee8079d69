"""The vLLM hooks' C part (`integrations/vllm/_outputs.c`): `output_taken` on a request's handle;
`Taking`, the awaitable the `get` wrapper returns around vLLM's coroutine: the output it returns
taken, everything else (what it yields, a cancellation, an error, `send` / `throw` / `close` driven
by hand) passed through as by the coroutine itself; `Batch`, the output batch in hand: its triples,
its token stamps, its engine step's record against its formulas and the work it leaves to Python;
`BatchHook`, vLLM's `process_outputs` / `update_scheduler_stats` wrapped around it (the tracker's
Python called for what the batch leaves, its failures to `on_error`, vLLM's methods always run)."""

from __future__ import annotations

import asyncio
import sys
from types import SimpleNamespace

import pytest

from phaselens.instrumentation.hotpath.records import StepStats
from phaselens.integrations.vllm._outputs import (
    KV_SCALE,
    OUTPUTS_HOOK,
    STATS_HOOK,
    SWEEP_EVERY_STEPS,
    Batch,
    BatchHook,
    Taking,
    output_taken,
)
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


def batch_of(end_s=1.0, iteration=None, clock=lambda: 900, **state) -> tuple[Batch, Observer]:
    """A Batch that has seen one (empty) output batch stamped `end_s`, its state set from `state`."""
    observer = Observer()
    batch = Batch({}, observer, clock)
    assert batch.before([], end_s, iteration, {}) == []
    for name, value in state.items():
        setattr(batch, name, value)
    return batch, observer


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
    batch, observer = batch_of(end_s, iteration, scheduled_ts=floor_ts, first_tokens=2)
    members = batch.members
    members.append(object())
    assert batch.step(scheduler) is False  # no KV stats, nothing finished, no sweep due
    ((stats, got_members),) = observer.steps
    assert type(stats) is StepStats and tuple(stats) == expected
    assert got_members is members
    # the step's state taken: the next starts empty, its start floored at this one's end
    assert (batch.members, batch.first_tokens, batch.scheduled_ts, batch.prev_end_ts) == ([], 0, 0, stats.end_ts)


def test_a_step_starts_at_the_later_of_the_previous_end_and_a_new_requests_scheduling():
    batch, observer = batch_of(1.0)
    batch.members.append(object())
    batch.step(None)
    for scheduled_ts, end_s in ((500_000_000, 2.0), (2_500_000_000, 3.0)):
        batch.before([], end_s, None, {})
        batch.members.append(object())
        batch.scheduled_ts = scheduled_ts
        batch.step(None)
    assert [(s.start_ts, s.end_ts) for s, _ in observer.steps] == [
        (1_000_000_000, 1_000_000_000),
        (1_000_000_000, 2_000_000_000),  # busy since the previous batch
        (2_500_000_000, 3_000_000_000),  # idle until it scheduled the new request
    ]


def test_a_step_without_members_or_while_idle_records_nothing_and_says_what_python_has_to_do():
    batch, observer = batch_of()
    assert batch.step(SimpleNamespace(kv_connector_stats=None)) is False
    assert batch.step(SimpleNamespace(kv_connector_stats={"records": 1})) is True  # the KV records
    batch.finished_now["r1"] = object()
    assert batch.step(None) is True  # a request finished in the step
    batch.finished_now.clear()
    batch.idle = True
    batch.members.append(object())
    dues = [batch.step(None) for _ in range(SWEEP_EVERY_STEPS)]
    assert batch.steps_seen == 3 + SWEEP_EVERY_STEPS and batch.members == []
    assert [i for i, due in enumerate(dues, start=4) if due] == [SWEEP_EVERY_STEPS]  # the sweep
    assert observer.steps == [] and batch.before([object()], 1.0, None, {}) == []


def test_a_step_that_cannot_be_read_records_nothing_and_the_next_starts_clean():
    batch, observer = batch_of(1.0, SimpleNamespace(num_prompt_tokens=1))
    batch.members.append(object())
    with pytest.raises(AttributeError):
        batch.step(None)
    batch.before([], "soon", None, {})
    batch.members.append(object())
    with pytest.raises(TypeError):
        batch.step(None)
    assert observer.steps == [] and batch.members == [] and batch.prev_end_ts == 0


def test_before_gives_the_open_requests_triples_and_after_stamps_them(rig):
    known, other = handle_of(rig), handle_of(rig)
    batch = Batch({"a": known, "b": other}, Observer(), lambda: 900)
    outputs = [SimpleNamespace(request_id="a", new_token_ids=[1, 2]), SimpleNamespace(request_id="b", new_token_ids=[])]
    states = {"a": "its state"}
    seen = batch.before(outputs, 1.5, "stats", states)
    assert seen == [known, 2, None, other, 0, None] and batch.states is states
    assert batch.after(seen, 5_000) is True
    assert batch.members == [known, other]
    assert (known.token_ts.tolist(), known.token_n.tolist(), other.token_ts.tolist()) == ([5_000], [2], [])
    # a request seen for the first time: None, for the tracker's Python
    assert batch.before([*outputs, SimpleNamespace(request_id="new", new_token_ids=[1])], 1.6, None, states) is None
    # a first sight's triple (stats) or a handle that is no timeline: False, nothing done
    assert batch.after([known, 1, "stats"], 6_000) is False
    assert batch.after([object(), 1, None], 6_000) is False
    assert known.token_ts.tolist() == [5_000] and len(batch.members) == 2


class Tracker:
    """What a BatchHook calls of the tracker: its batch, and the Python for what the batch leaves."""

    def __init__(self, batch: Batch, fail: str = "") -> None:
        self.batch, self.fail, self.calls = batch, fail, []

    def _called(self, name: str, *args):
        self.calls.append((name, *args))
        if name == self.fail:
            raise RuntimeError(name)

    def first_sights(self, outputs):
        self._called("first_sights", len(outputs))
        if self.fail == "replace":  # the tracker's Python replaces its batch while the hook holds it
            self.batch = Batch({}, None, lambda: 1)
            return [self.handle, 1, None]
        return []

    def after_first_sights(self, seen, now):
        self._called("after_first_sights", now)

    def step_work(self, scheduler_stats):
        self._called("step_work", scheduler_stats)


def hooked(rig, fail: str = "") -> SimpleNamespace:
    """vLLM's two methods (recording their calls) wrapped by BatchHooks on a tracker of `rig`'s handle."""
    observer, handle = Observer(), handle_of(rig)
    tracker = Tracker(Batch({"a": handle}, observer, lambda: 5_000), fail)
    tracker.handle = handle
    errors, untraced, vllm = [], [], []

    def process_outputs(self, outputs, engine_core_timestamp=None, iteration_stats=None):
        vllm.append(("process_outputs", engine_core_timestamp))
        return "processed"

    def update_scheduler_stats(self, scheduler_stats):
        vllm.append(("update_scheduler_stats", scheduler_stats))
        return "updated"

    namespace = {"tracker": lambda: tracker}
    outputs_hook, stats_hook = (
        BatchHook(kind, original, namespace, lambda: untraced.append(1), errors.append)
        for kind, original in ((OUTPUTS_HOOK, process_outputs), (STATS_HOOK, update_scheduler_stats))
    )
    return SimpleNamespace(
        handle=handle, tracker=tracker, observer=observer, errors=errors, untraced=untraced, vllm=vllm,
        process_outputs=outputs_hook, update_scheduler_stats=stats_hook,
    )  # fmt: skip


def processor(tracing: bool = True) -> SimpleNamespace:
    return SimpleNamespace(tracing_enabled=tracing, request_states={"a": "state"})


def known(*request_ids: str) -> list:
    return [SimpleNamespace(request_id=r, new_token_ids=[1, 2]) for r in request_ids]


def test_the_hooks_note_stamp_and_record_around_vllms_own_methods(rig):
    h = hooked(rig)
    stats = SimpleNamespace(kv_connector_stats=None)
    assert h.process_outputs(processor(), known("a"), engine_core_timestamp=1.5) == "processed"
    assert h.update_scheduler_stats(processor(), stats) == "updated"
    assert h.vllm == [("process_outputs", 1.5), ("update_scheduler_stats", stats)]
    assert (h.handle.token_ts.tolist(), h.handle.token_n.tolist()) == ([5_000], [2])
    ((step, members),) = h.observer.steps
    assert (step.end_ts, members) == (1_500_000_000, [h.handle])
    assert h.tracker.calls == [] and h.errors == [] and h.untraced == []
    assert h.tracker.batch.states == {"a": "state"}


def test_the_hooks_leave_a_first_sight_and_a_steps_work_to_the_trackers_python(rig):
    h = hooked(rig)
    h.process_outputs(processor(), known("a", "new"), 1.0, None)
    h.tracker.batch.finished_now["a"] = h.handle
    stats = SimpleNamespace(kv_connector_stats=None)
    h.update_scheduler_stats(processor(), stats)
    assert h.tracker.calls == [("first_sights", 2), ("step_work", stats)]
    assert h.handle.token_ts.tolist() == []  # first_sights gave nothing to stamp


@pytest.mark.parametrize("fail", ["first_sights", "step_work"])
def test_a_failure_in_the_trackers_part_goes_to_on_error_and_vllm_serves_on(rig, fail):
    h = hooked(rig, fail)
    h.tracker.batch.finished_now["a"] = h.handle
    assert h.process_outputs(processor(), known("new"), 1.0, None) == "processed"
    assert h.update_scheduler_stats(processor(), None) == "updated"
    assert [str(e) for e in h.errors] == [fail] and len(h.vllm) == 2


def test_a_processor_that_does_not_trace_warns_and_is_only_vllms(rig):
    h = hooked(rig)
    assert h.process_outputs(processor(tracing=False), known("a"), 1.0, None) == "processed"
    assert h.update_scheduler_stats(processor(tracing=False), None) == "updated"
    assert h.untraced == [1] and h.observer.steps == [] and h.handle.token_ts.tolist() == []


def test_a_broken_tracker_or_batch_goes_to_on_error(rig):
    h = hooked(rig)
    h.tracker.batch = "not a batch"
    assert h.process_outputs(processor(), known("a"), 1.0, None) == "processed"
    assert h.update_scheduler_stats(processor(), None) == "updated"
    assert [type(e) for e in h.errors] == [TypeError, TypeError]
    with pytest.raises(TypeError, match="namespace: dict"):
        BatchHook(OUTPUTS_HOOK, print, [], print, print)


def test_a_batch_the_tracker_replaces_during_the_call_stays_the_calls(rig):
    h = hooked(rig, "replace")
    held = h.tracker.batch
    assert h.process_outputs(processor(), known("new"), 1.0, None) == "processed"
    assert h.tracker.batch is not held and held.members == [h.handle]  # stamped into the batch it began with
    assert h.handle.token_ts.tolist() == [5_000] and h.errors == []
