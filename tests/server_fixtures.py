"""Private helpers for the reference-server tests: a tiny engine, the HF reference, a live server."""

from __future__ import annotations

import asyncio
import functools
import threading
import time
from dataclasses import dataclass, field
from typing import Self

import torch
import uvicorn

from phaselens.reference_server import Engine, EngineConfig, SamplingParams, SeqOutput
from phaselens.reference_server.engine.model_loader import TINY_EOS, build_tiny, tiny_suppressed_ids
from phaselens.reference_server.serve import bind
from phaselens.reference_server.serving.api import ApiSettings, create_app


def make_engine(**overrides) -> Engine:
    return Engine(EngineConfig(**overrides))


@functools.cache
def _reference_model():
    return build_tiny().model


def reference_greedy(prompt_ids: list[int], max_tokens: int, ignore_eos: bool = False) -> list[int]:
    """What Hugging Face `generate()` outputs greedily for the same tiny model (a separate instance)."""
    out = _reference_model().generate(
        torch.tensor([prompt_ids]),
        max_new_tokens=max_tokens,
        do_sample=False,
        suppress_tokens=list(tiny_suppressed_ids()),
        pad_token_id=0,
        eos_token_id=None if ignore_eos else TINY_EOS,
        min_new_tokens=0,
    )
    return out[0, len(prompt_ids) :].tolist()


@dataclass
class Collected:
    """A sink that records every output of one sequence."""

    outputs: list[SeqOutput] = field(default_factory=list)

    def __call__(self, out: SeqOutput) -> None:
        self.outputs.append(out)

    @property
    def final(self) -> SeqOutput | None:
        return self.outputs[-1] if self.outputs and self.outputs[-1].finish_reason else None

    @property
    def content(self) -> str:
        return "".join(o.content for o in self.outputs)

    @property
    def reasoning(self) -> str:
        return "".join(o.reasoning for o in self.outputs)


class Recorder:
    """A RequestObserver that logs the calls it gets, in order."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def enqueued(self):
        self.calls.append(("enqueued",))

    def scheduled(self):
        self.calls.append(("scheduled",))

    def prefill_chunk(self, start_ns, end_ns, tokens, cached_tokens):
        self.calls.append(("prefill_chunk", tokens, cached_tokens, end_ns >= start_ns))

    def first_token(self):
        self.calls.append(("first_token",))

    def token(self, n=1):
        self.calls.append(("token", n))

    def preempted(self):
        self.calls.append(("preempted",))

    def finished(self, reason):
        self.calls.append(("finished", reason))

    def names(self) -> list[str]:
        return [c[0] for c in self.calls]


def run_until_idle(engine: Engine, max_steps: int = 5000) -> int:
    steps = 0
    while (engine.scheduler.has_work() or engine.num_waiting) and steps < max_steps:
        engine.step()
        steps += 1
    assert steps < max_steps, "engine did not drain"
    return steps


def greedy(max_tokens: int, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, **kw)


class LiveServer:
    """The real app under uvicorn on a free loopback port, in a background thread."""

    def __init__(self, engine: Engine, settings: ApiSettings, telemetry=None) -> None:
        self.engine = engine
        self.sock = bind("127.0.0.1", 0)
        self.port = self.sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(create_app(engine, settings, telemetry), log_level="warning", access_log=False)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=lambda: asyncio.run(self.server.serve(sockets=[self.sock])), daemon=True)

    def __enter__(self) -> Self:
        self.engine.start()
        self.thread.start()
        deadline = time.monotonic() + 10
        while not self.server.started and time.monotonic() < deadline:
            time.sleep(0.01)
        assert self.server.started
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(10)
        self.engine.stop()
        self.sock.close()
