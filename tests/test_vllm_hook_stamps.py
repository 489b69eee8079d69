"""The vLLM plugin's API-server hooks, stamp by stamp, on a scripted clock: what `process_outputs`,
the collector's `get` / `get_nowait`, `update_scheduler_stats`, `do_tracing` and the delivery
middleware's `send` write into a request's handle and the step records, for a request the
middleware claimed and one opened at its first output (no middleware). Every stamp, count and step
field is asserted against the instant the test made it happen (vLLM is not importable here: its
output processor and collector are stand-ins with vLLM 0.32's shape; the live run is tests/test_vllm.py)."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import pytest

from phaselens.instrumentation.hotpath.records import LINK, StepRecord, pack_link
from phaselens.instrumentation.server.asgi import IngressMiddleware
from phaselens.instrumentation.server.telemetry import SCOPE_KEY
from phaselens.integrations.vllm import hooks
from phaselens.integrations.vllm._outputs import KV_SCALE
from phaselens.integrations.vllm.delivery import sse_carries_content
from phaselens.integrations.vllm.http_request import HTTP_REQUEST
from phaselens.integrations.vllm.tracker import VllmTracker
from tests.instrumentation_fixtures import http_scope, make_rig
from tests.test_vllm_delivery import TRACEPARENT, request_state

STEP_NS = 1_000_000  # the EngineCore's steps, 1 ms apart on the scripted clock
TAKE_NS = 30_000  # a request's task takes its output this long after the batch was processed
SEND_NS = 20_000  # and hands its SSE chunk to `send` this long after taking it


class Collector:
    """vLLM 0.32's RequestOutputCollector (DELTA): `put` merges, `get` waits for output."""

    def __init__(self) -> None:
        self.output = None
        self.ready = asyncio.Event()

    def put(self, output) -> None:
        if self.output is None:
            self.output = output
            self.ready.set()
        else:  # the producer got ahead: the deltas merged
            self.output.outputs[0].text += output.outputs[0].text
            self.output.finished = output.finished

    async def get(self):
        while (output := self.output) is None:
            await self.ready.wait()
        self.output = None
        self.ready.clear()
        return output

    def get_nowait(self):
        output = self.output
        if output is not None:
            self.output = None
            self.ready.clear()
        return output


class Processor:
    """vLLM 0.32's OutputProcessor as the wrappers see it: each output's text into its request's
    collector, a finished request's state dropped and traced."""

    tracing_enabled = True

    def __init__(self, texts: dict[str, list[str]]) -> None:
        self.request_states: dict = {}
        self.texts = texts  # request id → the text each of its outputs renders

    def add_request(self, request, queue=None):
        state = request_state(request.request_id, queued_s=0.5)
        state.stats.scheduled_ts = 0.75
        state.queue, state.outputs = queue, 0
        self.request_states[request.request_id] = state

    def process_outputs(self, outputs, timestamp=None, iteration_stats=None):
        for output in outputs:
            state = self.request_states[output.request_id]
            text = self.texts[output.request_id][state.outputs]
            state.outputs += 1
            state.stats.num_generation_tokens += len(output.new_token_ids)
            if state.stats.first_token_ts == 0.0:
                state.stats.first_token_ts = timestamp
            finished = output.finish_reason is not None
            state.queue.put(SimpleNamespace(outputs=[SimpleNamespace(text=text)], finished=finished))
            if finished:
                del self.request_states[output.request_id]
                self.do_tracing(output, state, iteration_stats)

    def do_tracing(self, output, state, iteration_stats):
        raise AssertionError("the plugin's do_tracing replaces vLLM's")

    def update_scheduler_stats(self, scheduler_stats):
        pass


for _name, _wrap in hooks.WRAPPERS.items():
    setattr(Processor, _name, _wrap(getattr(Processor, _name)))
for _name, _wrap in hooks.COLLECTOR_WRAPPERS.items():
    setattr(Collector, _name, _wrap(getattr(Collector, _name)))

# per step: (request id, new tokens, finish reason) of each output; what each output renders. `c`'s
# first token renders no text yet (half a character); `late` is first seen in a batch of known ones
STEPS = [
    [("c", 1, None), ("o", 2, None)],
    [("c", 1, None), ("late", 1, None), ("o", 1, None)],
    [("c", 2, "length"), ("late", 1, "length"), ("o", 1, "length")],
]
TEXTS = {"c": ["", "é", "xy"], "o": ["ab", "c", "d"], "late": ["z", "w"]}


@pytest.fixture
def run(monkeypatch):
    """The two requests through their whole life: `c` in an HTTP request the middleware claimed,
    `o` added without one (its handle opened at its first output, from its traceparent)."""
    rig = make_rig()
    clock = rig.clock
    tracker = VllmTracker(rig.telemetry, "tiny")
    monkeypatch.setattr(hooks, "tracker", lambda: tracker)
    steps: list[StepRecord] = []
    rig.telemetry.step_observer.submit = steps.append
    processor = Processor(TEXTS)
    seen: dict = {"taken": {r: [] for r in TEXTS}, "sent": [], "steps": []}

    async def stream(request_id: str, send) -> None:
        """vLLM's completions handler, its streaming part: take each output, send it as SSE."""
        queue = Collector()
        request = SimpleNamespace(request_id=request_id, trace_headers={"traceparent": TRACEPARENT})
        processor.add_request(request, queue)
        while True:
            output = queue.get_nowait() or await queue.get()
            seen["taken"][request_id].append(clock())
            clock.advance(SEND_NS)
            event = {"choices": [{"index": 0, "text": output.outputs[0].text}]}
            await send(
                {"type": "http.response.body", "body": f"data: {json.dumps(event)}\n\n".encode(), "more_body": True}
            )
            if output.finished:
                return

    async def app(scope, receive, send):
        assert HTTP_REQUEST.get() is scope[SCOPE_KEY]
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await stream("c", send)
        await send({"type": "http.response.body", "body": b"data: [DONE]\n\n", "more_body": False})

    async def receive():
        return {"type": "http.request", "body": b"{}", "more_body": False}

    async def transport_send(message):
        if message["type"] == "http.response.body":
            seen["sent"].append(clock())

    async def no_send(message):
        pass

    async def main():
        scope = http_scope(traceparent=TRACEPARENT)
        assert HTTP_REQUEST.get() is None
        # as FirstChunkMiddleware runs it: the handle in HTTP_REQUEST while the app runs, http_done at its end
        middleware = IngressMiddleware(
            app, rig.telemetry, sse_carries_content, current=HTTP_REQUEST, ended=tracker.http_done
        )
        served = asyncio.ensure_future(middleware(scope, receive, transport_send))
        others = [asyncio.ensure_future(stream("o", no_send))]
        await asyncio.sleep(0)
        seen["handles"] = {"c": scope[SCOPE_KEY]}
        for step, batch in enumerate(STEPS):
            if step == 1:
                others.append(asyncio.ensure_future(stream("late", no_send)))
                await asyncio.sleep(0)
            clock.advance(STEP_NS)
            outputs = [
                SimpleNamespace(request_id=r, new_token_ids=[7] * n, finish_reason=f, trace_headers=None)
                for r, n, f in batch
            ]
            seen["steps"].append(clock())
            processor.process_outputs(
                outputs,
                1.0 + step * 0.001,
                SimpleNamespace(
                    num_generation_tokens=sum(n for _, n, _ in batch),
                    num_prompt_tokens=16 if step < 2 else 0,
                    num_preempted_reqs=0,
                ),
            )
            for request_id, _, _ in batch:
                seen["handles"].setdefault(request_id, tracker._open.get(request_id))
            processor.update_scheduler_stats(SimpleNamespace(kv_cache_usage=0.25, num_waiting_reqs=3))
            clock.advance(TAKE_NS)
            for _ in range(8):  # the tasks take their outputs and send them
                await asyncio.sleep(0)
        await asyncio.gather(served, *others)

    asyncio.run(main())
    seen["records"] = steps
    return seen


def test_token_stamps_are_each_batchs_instant_after_vllm_put_it_in_the_streams(run):
    """A request's first batch stamps `first_token` (its tokens past the first: a token stamp),
    every later one a token stamp of its tokens, all at the instant after vLLM processed the batch."""
    for request_id in TEXTS:
        outputs = [(step, n) for step, batch in enumerate(STEPS) for r, n, _ in batch if r == request_id]
        (first_step, first_n), later = outputs[0], outputs[1:]
        handle = run["handles"][request_id]
        assert handle.first_token_ts == run["steps"][first_step]
        expected = ([(run["steps"][first_step], first_n - 1)] if first_n > 1 else []) + [
            (run["steps"][step], n) for step, n in later
        ]
        assert list(zip(handle.token_ts, handle.token_n, strict=True)) == expected


def test_output_ready_is_when_the_task_took_the_first_output_that_renders_text(run):
    """In the middleware's HTTP request; without it (`o`, `late`) the take is not observed."""
    c = run["handles"]["c"]
    assert c.output_ready_ts == run["taken"]["c"][1]  # its first output rendered nothing
    assert c.visible_tokens == 2  # the first token and the one that completed the character
    for request_id in ("o", "late"):
        handle = run["handles"][request_id]
        assert (handle.output_ready_ts, handle.visible_tokens, handle.first_chunk_ts) == (0, 0, 0)


def test_the_middleware_stamps_the_content_chunks_send_and_their_bytes(run):
    c = run["handles"]["c"]
    took = run["taken"]["c"]
    # the empty-text chunk of the first output carries no output; the next two do
    assert c.first_chunk_ts == took[1] + SEND_NS
    assert c.first_chunk_sent_ts == run["sent"][1]
    assert c.last_chunk_ts == took[2] + SEND_NS
    sends = list(c.sends)
    assert sends[0::2] == [took[1] + SEND_NS, took[2] + SEND_NS, run["sent"][-1]]
    bodies = [len(f"data: {json.dumps({'choices': [{'index': 0, 'text': t}]})}\n\n") for t in TEXTS["c"]]
    done = len(b"data: [DONE]\n\n")
    assert sends[1::2] == [sum(bodies[:2]), sum(bodies), sum(bodies) + done]
    assert c.body_bytes == sum(bodies) + done
    assert not c.output_pending


def test_each_batch_is_one_step_linking_its_requests_in_the_batchs_order(run):
    records = run["records"]
    links = {r: pack_link(h.root) for r, h in run["handles"].items()}
    assert [r.step_index for r in records] == [0, 1, 2]
    assert [r.num_seqs for r in records] == [len(batch) for batch in STEPS]
    assert [r.links for r in records] == [b"".join(links[r] for r, _, _ in batch) for batch in STEPS]
    assert all(len(link) == LINK.size for link in links.values())
    ends = [int((1.0 + i * 0.001) * 1e9) for i in range(3)]
    assert [r.end_ts for r in records] == ends
    assert [r.start_ts for r in records] == [int(0.75 * 1e9), ends[0], ends[1]]
    assert [r.prefill_tokens for r in records] == [16, 16, 0]
    assert [r.decode_tokens for r in records] == [1, 2, 4]  # generated less the first tokens
    assert {(r.kv_blocks_used, r.kv_blocks_total, r.queue_depth) for r in records} == {(KV_SCALE // 4, KV_SCALE, 3)}


def test_every_request_finishes_with_its_engine_stamps(run):
    for request_id, handle in run["handles"].items():
        first_s = 1.0 + 0.001 * next(i for i, batch in enumerate(STEPS) if any(r == request_id for r, _, _ in batch))
        assert handle.finish_reason == "length"
        assert handle.enqueued_ts == int(0.5 * 1e9)
        assert list(handle.waits) == [int(0.5 * 1e9), int(0.75 * 1e9)]
        assert list(handle.chunks) == [int(0.75 * 1e9), int(first_s * 1e9), 16, 0]
        assert handle.outcome.output_tokens == sum(n for batch in STEPS for r, n, _ in batch if r == request_id)
