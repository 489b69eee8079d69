"""One bad request fails alone: hostile bodies (NaN, Infinity, huge integers, booleans, strings…) get a
400 naming the parameter while good streams run, and a request that fails inside the engine (a NaN
that reached the sampler, a token that fails to detokenize, a forward that raises) ends with an
error while its batch finishes with the output it has without that request (greedy)."""

from __future__ import annotations

import asyncio
import json
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from server_fixtures import Collected, LiveServer, greedy, make_engine, reference_greedy, run_until_idle

from phaselens.instrumentation.hotpath.observer import FINISH_ERROR, NULL_REQUEST
from phaselens.reference_server import Engine, EngineConfig, SamplingParams, SeqOutput
from phaselens.reference_server.engine import model_loader
from phaselens.reference_server.engine.detokenizer import decode_bytes
from phaselens.reference_server.engine.model_runner import ModelRunner
from phaselens.reference_server.process.engine_client import EngineClient
from phaselens.reference_server.serving.api import ApiSettings

FAULT_ID = 0  # the pad id: never sampled (suppressed), so only a prompt carries it to the forward
GOOD_TOKENS = 40
GOOD = [
    ("completions", {"prompt": "the first good stream"}),
    ("completions", {"prompt": [60 + i % 40 for i in range(70)]}),
    ("chat/completions", {"messages": [{"role": "user", "content": "a good chat"}]}),
    ("chat/completions", {"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]}),
]
NON_NUMBERS = [float("nan"), float("inf"), float("-inf"), True, False, "0.5", "NaN", [0.5], {"value": 1}]
OUT_OF_RANGE = {
    "temperature": [-0.1, 2.01, 1e308, -1e308, 10**30],
    "top_p": [0, -0.5, 1.01, 1e308],
    "top_k": [-2, 1.5, 2**63, 2**70],
    "seed": [0.5, 2**63, 2**70, -(2**63) - 1],
    "max_tokens": [0, -5, 8.0, 2**64, 10**9],
    "n": [0, 2, 1.0],
    "presence_penalty": [0.5, 2.5, -3, 1e308],
    "frequency_penalty": [1.0, -2.5, 1e308],
    "repetition_penalty": [0, -1, 1.5, 1e308],
    "min_p": [0.2, -0.1, 1.5],
}
BOOLEANS = ("stream", "ignore_eos")
JSON_VALUES = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-10, 10)
    | st.integers()
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
    max_leaves=6,
)


@pytest.fixture(scope="module")
def server():
    engine = make_engine(max_num_seqs=16, kv_cache_tokens=8192, fault_token_id=FAULT_ID)
    with LiveServer(engine, ApiSettings(served_model_names=("tiny",))) as live:
        yield live


@pytest.fixture(scope="module")
def baseline(server) -> list[str]:
    """The good streams' text, run together without anything else."""
    return _good_round(server)


def _post(server, endpoint: str, body) -> httpx.Response:
    """`json.dumps` writes NaN and Infinity as Python's json does, as the issue's client did."""
    content = json.dumps(body).encode()
    return httpx.post(f"{server.url}/v1/{endpoint}", content=content, headers={"content-type": "application/json"})


def _stream(server, endpoint: str, body: dict, started: threading.Event | None = None) -> tuple[str, list[dict], int]:
    """Stream a request: its text, its error events and its output tokens (the usage chunk's)."""
    text, errors, tokens = [], [], 0
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    with httpx.stream("POST", f"{server.url}/v1/{endpoint}", json=body, timeout=120) as response:
        assert response.status_code == 200, response.read()
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                errors.append(event["error"])
                continue
            if event.get("usage"):
                tokens = event["usage"]["completion_tokens"]
                continue
            choice = event["choices"][0]
            text.append(choice.get("text") or choice.get("delta", {}).get("content") or "")
            if started is not None and text[-1]:
                started.set()
    return "".join(text), errors, tokens


def _good_body(body: dict) -> dict:
    return {"model": "tiny", "max_tokens": GOOD_TOKENS, "temperature": 0, "ignore_eos": True, **body}


def _good_round(server, started: list[threading.Event] | None = None) -> list[str]:
    with ThreadPoolExecutor(len(GOOD)) as pool:
        futures = [
            pool.submit(_stream, server, endpoint, _good_body(body), started[i] if started else None)
            for i, (endpoint, body) in enumerate(GOOD)
        ]
        results = [f.result() for f in futures]
    assert all(not errors and tokens == GOOD_TOKENS for _, errors, tokens in results), results
    return [text for text, _, _ in results]


def _valid(endpoint: str) -> dict:
    body: dict = {"model": "tiny", "max_tokens": 4}
    if endpoint == "completions":
        return {**body, "prompt": "hostile"}
    return {**body, "messages": [{"role": "user", "content": "hostile"}]}


def _carries(value, token_id: int) -> bool:
    """Whether a drawn JSON value holds the int `token_id` at any depth (a token-id prompt would carry
    it to the forward: the engine's forced fault, which fails every request new to that step, the
    good streams' too)."""
    if isinstance(value, list):
        return any(_carries(item, token_id) for item in value)
    return type(value) is int and value == token_id


@st.composite
def hostile_bodies(draw) -> tuple[str, dict, str | None]:
    """(endpoint, body, the parameter a 400 must name; None: any answer but a 5xx)."""
    endpoint = draw(st.sampled_from(["completions", "chat/completions"]))
    body = _valid(endpoint)
    kind = draw(st.sampled_from(["number", "boolean", "random"]))
    if kind == "number":
        name = draw(st.sampled_from(sorted(OUT_OF_RANGE)))
        value = draw(st.sampled_from(NON_NUMBERS + OUT_OF_RANGE[name]))
        if name == "max_tokens" and endpoint == "chat/completions":
            name = draw(st.sampled_from(["max_tokens", "max_completion_tokens"]))
        return endpoint, {**body, name: value}, name
    if kind == "boolean":
        name = draw(st.sampled_from(BOOLEANS))
        return endpoint, {**body, name: draw(st.sampled_from([0, 1, "true", "yes", [True], float("nan")]))}, name
    extra = draw(st.dictionaries(st.sampled_from([*OUT_OF_RANGE, *BOOLEANS, "prompt", "stop", "x"]), JSON_VALUES))
    body.update(extra)
    if _carries(body.get("prompt"), FAULT_ID):  # a valid token-id prompt with the test's own poison in it
        body["prompt"] = "hostile"
    tokens = body.get("max_tokens")
    if tokens is None or (type(tokens) is int and 8 < tokens < 10**6):  # a valid random body must stay short
        body["max_tokens"] = 4
    return endpoint, body, None


def test_hostile_bodies_get_400_naming_the_parameter_while_good_streams_finish(server, baseline):
    stats = server.engine.stats
    failed_before = stats.failed_requests, stats.failed_steps
    stop, rounds, in_flight = threading.Event(), [], [0]

    def good_streams() -> None:
        while not stop.is_set() and len(rounds) < 50:
            in_flight[0] += 1
            rounds.append(_good_round(server))
            in_flight[0] -= 1

    overlapped = []

    @settings(max_examples=60, deadline=None, database=None)
    @given(hostile_bodies())
    def send(case) -> None:
        endpoint, body, param = case
        overlapped.append(in_flight[0] > 0)
        response = _post(server, endpoint, body)
        assert response.status_code < 500, (body, response.text)
        if param is None and response.status_code < 400:
            return
        error = response.json()["error"]
        assert response.status_code == 400 and error["message"], (body, error)
        assert param is None or (error["param"] == param and param in error["message"]), (body, error)

    streams = threading.Thread(target=good_streams)
    streams.start()
    try:
        send()
    finally:
        stop.set()
        streams.join(300)
    assert any(overlapped) and rounds and all(texts == baseline for texts in rounds)
    assert httpx.get(f"{server.url}/health").json()["status"] == "ok"
    assert (stats.failed_requests, stats.failed_steps) == failed_before


@pytest.mark.parametrize(
    "endpoint,field,value",
    [
        ("completions", "temperature", float("nan")),
        ("chat/completions", "temperature", float("nan")),
        ("completions", "top_p", float("nan")),
        ("completions", "presence_penalty", float("nan")),
        ("chat/completions", "frequency_penalty", 1e308),
        ("completions", "seed", 2**70),
        ("completions", "top_k", float("inf")),
        ("chat/completions", "max_completion_tokens", float("-inf")),
    ],
)
def test_the_issues_bodies_get_400_naming_the_parameter(server, endpoint, field, value):
    response = _post(server, endpoint, {**_valid(endpoint), field: value, "stream": True})
    error = response.json()["error"]
    assert response.status_code == 400 and error["param"] == field and field in error["message"], error


def test_a_request_failing_in_the_forward_fails_alone_over_http(server, baseline):
    stats = server.engine.stats
    failed_before = stats.failed_requests
    started = [threading.Event() for _ in GOOD]
    with ThreadPoolExecutor(1) as pool:
        good = pool.submit(_good_round, server, started)
        assert all(event.wait(60) for event in started)  # every good stream is decoding
        bad = {"model": "tiny", "prompt": [50, FAULT_ID, 51], "max_tokens": 4}
        text, errors, _ = _stream(server, "completions", bad)
        whole = _post(server, "completions", bad)
        assert good.result() == baseline
    assert text == "" and [e["code"] for e in errors] == ["engine_error"] and "forward" in errors[0]["message"]
    assert whole.status_code == 500 and whole.json()["error"]["code"] == "engine_error"
    assert stats.failed_requests == failed_before + 2
    assert httpx.get(f"{server.url}/health").json()["status"] == "ok"


PROMPTS = [[40 + i + j % 50 for j in range(8 + 17 * i)] for i in range(4)]


def _run_with(engine: Engine, bad_prompt: list[int] | None, bad_params: SamplingParams) -> tuple[list[str], SeqOutput]:
    """The good prompts decode a few steps, then the bad request joins; everything runs to the end."""
    good = [Collected() for _ in PROMPTS]
    for prompt, sink in zip(PROMPTS, good, strict=True):
        engine.submit(prompt, greedy(GOOD_TOKENS, ignore_eos=True), sink=sink)
    for _ in range(3):
        engine.step()
    bad = Collected()
    if bad_prompt is not None:
        engine.submit(bad_prompt, bad_params, sink=bad)
    run_until_idle(engine)
    assert [c.final.output_tokens if c.final else None for c in good] == [GOOD_TOKENS] * len(PROMPTS)
    return [c.content for c in good], bad.final or SeqOutput()


@pytest.fixture(scope="module")
def engine_baseline() -> list[str]:
    texts, _ = _run_with(make_engine(), None, greedy(1))
    return texts


def test_a_nan_that_reaches_the_sampler_fails_its_request_alone(engine_baseline):
    engine = make_engine()
    texts, bad = _run_with(engine, [50, 51, 52], SamplingParams(max_tokens=8, temperature=float("nan")))
    assert texts == engine_baseline
    assert bad.finish_reason == FINISH_ERROR and "sampling" in bad.error
    assert (engine.stats.failed_requests, engine.stats.failed_steps, engine.stats.finished) == (1, 0, 5)


def test_a_forward_that_raises_fails_the_new_request_and_reruns_the_rest(engine_baseline):
    engine = make_engine(fault_token_id=FAULT_ID)
    texts, bad = _run_with(engine, [50, FAULT_ID, 51], greedy(8))
    assert texts == engine_baseline
    assert bad.finish_reason == FINISH_ERROR and "forward" in bad.error
    assert (engine.stats.failed_requests, engine.stats.failed_steps) == (1, 1)
    assert engine.scheduler.blocks.num_used == 0


def test_a_token_that_fails_to_detokenize_fails_its_request_alone(engine_baseline):
    """The bad prompt's first greedy token is one no good output holds; decoding it raises."""
    used = {ord(c) + 3 for text in engine_baseline for c in text}  # ByT5: byte b is id b + 3
    bad_prompt = next(p for p in ([70 + k, 71 + k] for k in range(40)) if reference_greedy(p, 1)[0] not in used)
    poison = reference_greedy(bad_prompt, 1)[0]

    def decode(ids: list[int]) -> str:
        if poison in ids:
            raise ValueError("undecodable")
        return decode_bytes(ids)

    config = EngineConfig()
    loaded = model_loader.load(config.model, config.dtype, config.device, config.seed)
    engine = Engine(config, ModelRunner(config, replace(loaded, decode=decode)))
    texts, bad = _run_with(engine, bad_prompt, greedy(8))
    assert texts == engine_baseline
    assert bad.finish_reason == FINISH_ERROR and f"detokenizing token {poison}" in bad.error
    assert engine.stats.failed_requests == 1


async def _process_run(client: EngineClient) -> tuple[list[str], SeqOutput]:
    client.attach()
    good = [Collected() for _ in PROMPTS]
    bad = Collected()
    done = asyncio.Semaphore(0)

    def sink(out: SeqOutput, into: Collected) -> None:
        into(out)
        if out.finish_reason:
            done.release()

    for prompt, collected in zip(PROMPTS, good, strict=True):
        client.submit(prompt, greedy(GOOD_TOKENS, ignore_eos=True), NULL_REQUEST, lambda o, c=collected: sink(o, c))
    for _ in range(200):  # until every good request has its first token: they are decoding
        if all(c.outputs for c in good):
            break
        await asyncio.sleep(0.05)
    client.submit([50, FAULT_ID, 51], greedy(8), NULL_REQUEST, lambda o: sink(o, bad))
    for _ in range(len(PROMPTS) + 1):
        await asyncio.wait_for(done.acquire(), 120)
    return [c.content for c in good], bad.final or SeqOutput()


def test_in_the_engine_process_a_forward_fault_fails_its_request_alone(engine_baseline):
    client = EngineClient(EngineConfig(fault_token_id=FAULT_ID))
    try:
        texts, bad = asyncio.run(_process_run(client))
        assert client.health()["status"] == "ok"
    finally:
        client.stop()
    assert texts == engine_baseline
    assert bad.finish_reason == FINISH_ERROR and "forward" in bad.error
