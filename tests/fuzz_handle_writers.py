"""Random and broken calls on the C modules that write a request's handle on the event loop, meant to
run under sanitizers (tests/test_collector_render_asan.py builds them so): the vLLM plugin's
`integrations/vllm/_outputs.c` (`output_taken`, `Batch`'s `before` / `after` / `step`, `BatchHook`,
`Taking`, `CollectorHook`) or the ingress middleware's `instrumentation/server/_send_guard.c`
(`BodySender`, `SendGuard`), whichever `--module` is (a build of the one named by its file's stem).

Each iteration makes one call with values that fit or odd ones (wrong types, a clock that raises,
members that are not timelines, outputs without the attributes, awaitables that yield, return,
raise or are cancelled, driven by `await` or by hand); a call either works or raises one of the
expected errors. The handles are `RequestTimeline`s, so every write lands in the C struct the module
shares with `_stamps.c`. Prints one JSON object.
"""

from __future__ import annotations

import asyncio
import contextvars
import importlib
import json
import random
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.fuzz_render import arguments

MODULES = {
    "_outputs": "phaselens.integrations.vllm._outputs",
    "_send_guard": "phaselens.instrumentation.server._send_guard",
}
ODD = (None, 1.5, "x", b"", -1, 2**63, (), [1], object())
REJECTED = (
    OverflowError,
    TypeError,
    ValueError,
    LookupError,
    AttributeError,
    RuntimeError,
    OSError,
    asyncio.CancelledError,
)
CURRENT: contextvars.ContextVar[Any] = contextvars.ContextVar("fuzz_handle", default=None)
LOOP = asyncio.new_event_loop()


def _value(rng: random.Random) -> Any:
    return rng.choice(ODD) if rng.random() < 0.2 else rng.choice((0, 1, 3, rng.randrange(2**40)))


def _timeline(rng: random.Random) -> Any:
    from phaselens.instrumentation.hotpath.timeline import RequestTimeline

    choice = rng.random()
    clock = time.monotonic_ns if choice < 0.6 else (lambda: 5) if choice < 0.9 else {}.__getitem__
    timeline = RequestTimeline(clock, received_ts=1)
    if rng.random() < 0.7:
        timeline.first_token_ts = rng.randrange(1, 2**40)
    for _ in range(rng.randrange(3)):
        timeline.token_at(rng.randrange(2**40), rng.randrange(4))
    return timeline


def _output(rng: random.Random) -> Any:
    choice = rng.random()
    if choice < 0.1:
        return rng.choice(ODD)
    texts = [SimpleNamespace(text=rng.choice(("", "a", None, 0))) for _ in range(rng.randrange(3))]
    outputs = texts if choice < 0.9 else rng.choice(ODD)
    return SimpleNamespace(outputs=outputs, finished=rng.choice((True, False, None)))


async def _steps(rng: random.Random, result: Any) -> Any:
    for _ in range(rng.randrange(3)):
        await asyncio.sleep(0)
    if rng.random() < 0.2:
        raise rng.choice((OSError("write"), KeyError("k")))
    return result


def _drive(rng: random.Random, awaitable: Any) -> Any:
    """`await` it on a loop (sometimes cancelled), or by hand: send / throw / close."""
    choice = rng.random()
    if choice < 0.6:

        async def main() -> Any:
            task = asyncio.ensure_future(_await(awaitable))
            if rng.random() < 0.2:
                await asyncio.sleep(0)
                task.cancel()
            return await task

        return LOOP.run_until_complete(main())
    iterator = awaitable.__await__()
    try:
        iterator.send(None)
        if choice < 0.8:
            return iterator.send(None)
        if choice < 0.9:
            return iterator.throw(KeyError("thrown"))
        return iterator.close()
    except StopIteration as stop:
        return stop.value


async def _await(awaitable: Any) -> Any:
    return await awaitable


def _outputs_call(rng: random.Random, module: Any, handles: list) -> None:
    choice = rng.random()
    handle = rng.choice(handles)
    if choice < 0.2:
        module.output_taken(handle if rng.random() < 0.9 else rng.choice(ODD), _output(rng))
    elif choice < 0.4:
        outputs = [
            SimpleNamespace(request_id=rng.choice(("a", "b", "c")), new_token_ids=[1] * rng.randrange(3))
            for _ in range(rng.randrange(4))
        ]
        batch = module.Batch({"a": handles[0], "b": handles[1]}, None, time.monotonic_ns)
        seen = batch.before(outputs if rng.random() < 0.9 else _value(rng), 1.5, None, {})
        if seen is not None:
            batch.after(seen, _value(rng) if rng.random() < 0.1 else 10)
    elif choice < 0.5:
        seen = [rng.choice((*handles, None)), _value(rng), rng.choice((None, 1))] * rng.randrange(3)
        module.Batch({}, None, time.monotonic_ns).after(seen if rng.random() < 0.9 else _value(rng), 10)
    elif choice < 0.65:
        observer = SimpleNamespace(step=lambda stats, members: None) if rng.random() < 0.9 else object()
        iteration = SimpleNamespace(
            num_prompt_tokens=_value(rng), num_generation_tokens=_value(rng), num_preempted_reqs=1
        )
        scheduler = SimpleNamespace(kv_cache_usage=rng.choice((0.25, 1, None, "x")), num_waiting_reqs=_value(rng),
                                    kv_connector_stats=rng.choice((None, {})))  # fmt: skip
        batch = module.Batch({}, observer, rng.choice((time.monotonic_ns, {}.__getitem__)))
        batch.before([], rng.choice((1.5, None, 0.0, "x")), rng.choice((iteration, None)), {})
        batch.members.extend(handles)
        batch.scheduled_ts, batch.first_tokens = _value(rng), _value(rng)
        batch.step(rng.choice((scheduler, None)))
    elif choice < 0.75:
        _batch_hook_call(rng, module, handles)
    elif choice < 0.85:
        _drive(rng, module.Taking(_steps(rng, _output(rng)), handle, lambda exc: None))
    else:
        hook = module.CollectorHook(lambda self: _steps(rng, _output(rng)), CURRENT, lambda exc: None, True)
        nowait = module.CollectorHook(lambda self: _output(rng), CURRENT, lambda exc: None, False)
        token = CURRENT.set(handle if rng.random() < 0.8 else None)
        try:
            nowait(None)
            _drive(rng, hook(None))
        finally:
            CURRENT.reset(token)


def _batch_hook_call(rng: random.Random, module: Any, handles: list) -> None:
    """A BatchHook of either kind around a stand-in of vLLM's method, on a tracker whose Python parts
    may raise, called with fitting or odd arguments."""
    batch = module.Batch(
        {"a": handles[0], "b": handles[1]}, SimpleNamespace(step=lambda stats, members: None), time.monotonic_ns
    )

    def python_part(*args: Any) -> Any:
        if rng.random() < 0.2:
            raise RuntimeError("tracker")
        if rng.random() < 0.2:  # the batch the hook holds, replaced under it
            tracker.batch = module.Batch({}, None, time.monotonic_ns)
        return [handles[2], 1, None] if rng.random() < 0.5 else []

    tracker = SimpleNamespace(batch=batch if rng.random() < 0.9 else _value(rng), first_sights=python_part,
                              after_first_sights=python_part, step_work=python_part)  # fmt: skip
    namespace = {"tracker": lambda: tracker} if rng.random() < 0.95 else {}
    kind = rng.choice((module.OUTPUTS_HOOK, module.STATS_HOOK))
    hook = module.BatchHook(kind, lambda *args, **kwargs: "vllm", namespace, lambda: None, lambda exc: None)
    processor = SimpleNamespace(tracing_enabled=rng.random() < 0.9, request_states={})
    outputs = [
        SimpleNamespace(request_id=rng.choice(("a", "b", "c")), new_token_ids=[1] * rng.randrange(3))
        for _ in range(rng.randrange(4))
    ]
    args = (processor, outputs if rng.random() < 0.9 else _value(rng), rng.choice((1.5, None, "x")), None)
    hook(*args[: rng.randrange(5)])
    if rng.random() < 0.3:
        hook(processor, outputs, engine_core_timestamp=1.5, iteration_stats=None)


def _send_guard_call(rng: random.Random, module: Any, handles: list) -> None:
    handle = rng.choice(handles)
    if rng.random() < 0.8:
        handle.first_chunk_sent_ts = rng.choice((0, 5))
        handle.output_pending = rng.random() < 0.5

        def send(message: Any) -> Any:
            return _steps(rng, None) if rng.random() < 0.95 else rng.choice(ODD)

        sender = module.BodySender(handle, send, lambda message: _steps(rng, None), lambda: None)
        body = rng.choice((b"x" * rng.randrange(9), None, 5, "text"))
        message = rng.choice(
            (
                {"type": "http.response.body", "body": body, "more_body": rng.choice((True, False, 1))},
                {"type": "http.response.start"},
                [("type", "x")],
            )
        )
        _drive(rng, sender(message))
    else:
        _drive(rng, module.SendGuard(_steps(rng, None) if rng.random() < 0.9 else _value(rng), lambda: None))


def main() -> None:
    given = Path(sys.argv[sys.argv.index("--module") + 1]).name if "--module" in sys.argv else "_outputs"
    stem = given.split(".")[0].removesuffix("_asan")
    name = MODULES[stem]
    args = arguments(__doc__, name, 5_000)
    module = importlib.import_module(name)
    call = _outputs_call if stem == "_outputs" else _send_guard_call
    rng, accepted = random.Random(args.seed), 0
    handles = [_timeline(rng) for _ in range(4)]
    for _ in range(args.iterations):
        if rng.random() < 0.05:
            handles[rng.randrange(4)] = _timeline(rng)
        try:
            call(rng, module, handles)
            accepted += 1
        except REJECTED:
            pass
    print(json.dumps({"iterations": args.iterations, "accepted": accepted, "module": module.__file__}))


if __name__ == "__main__":
    main()
