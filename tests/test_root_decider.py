"""A request's ids and sampling decision at receipt (`hotpath/ids.py`): the SDK's parent-based samplers
decided by their rule (no `should_sample` call) give what the sampler itself gives, for every kind
of incoming parent, and any other sampler is asked."""

from __future__ import annotations

import random

import pytest
from opentelemetry import propagate
from opentelemetry.context import Context
from opentelemetry.sdk.trace.id_generator import IdGenerator
from opentelemetry.sdk.trace.sampling import (
    ALWAYS_OFF,
    ALWAYS_ON,
    DEFAULT_OFF,
    DEFAULT_ON,
    ParentBased,
    ParentBasedTraceIdRatio,
    Sampler,
    TraceIdRatioBased,
)

from phaselens.instrumentation.hotpath.ids import RootDecider, parent_based_rule


class SeededIds(IdGenerator):
    """The same ids for two deciders: a seeded generator."""

    def __init__(self, seed: int) -> None:
        self._rng = random.Random(seed)

    def generate_span_id(self) -> int:
        return self._rng.getrandbits(64) or 1

    def generate_trace_id(self) -> int:
        return self._rng.getrandbits(128) or 1


class Asked(Sampler):
    """The same sampler behind a type the rule does not know: its `should_sample` is called."""

    def __init__(self, inner: Sampler) -> None:
        self.inner = inner

    def should_sample(self, *args, **kwargs):
        return self.inner.should_sample(*args, **kwargs)

    def get_description(self) -> str:
        return self.inner.get_description()


class OwnDecision(ParentBased):
    """A parent-based sampler that decides for itself."""

    def should_sample(self, *args, **kwargs):
        return ALWAYS_OFF.should_sample(*args, **kwargs)


def incoming(traceparent: str | None, tracestate: str | None = None) -> Context:
    carrier = {k: v for k, v in (("traceparent", traceparent), ("tracestate", tracestate)) if v}
    return propagate.extract(carrier)


PARENTS = {
    "none": lambda rng: incoming(None),
    "sampled": lambda rng: incoming(f"00-{rng.getrandbits(128):032x}-{rng.getrandbits(64) or 1:016x}-01", "a=1,b=2"),
    "unsampled": lambda rng: incoming(f"00-{rng.getrandbits(128):032x}-{rng.getrandbits(64) or 1:016x}-00"),
    "random-flag": lambda rng: incoming(f"00-{rng.getrandbits(128):032x}-{rng.getrandbits(64) or 1:016x}-03"),
    "malformed": lambda rng: incoming("00-zz-yy-01"),
}
RULED = {
    "parentbased_always_on": DEFAULT_ON,
    "parentbased_always_off": DEFAULT_OFF,
    "parentbased_traceidratio_0.5": ParentBasedTraceIdRatio(0.5),
    "parentbased_traceidratio_0": ParentBasedTraceIdRatio(0.0),
    "parentbased_traceidratio_1": ParentBasedTraceIdRatio(1.0),
}


@pytest.mark.parametrize("parent", PARENTS)
@pytest.mark.parametrize("sampler", RULED)
def test_a_ruled_sampler_decides_as_the_sdks_sampler(sampler, parent):
    assert parent_based_rule(RULED[sampler]) is not None
    ruled, asked = RootDecider(RULED[sampler], SeededIds(7)), RootDecider(Asked(RULED[sampler]), SeededIds(7))
    rng, decisions = random.Random(3), set()
    for _ in range(200):
        context = PARENTS[parent](rng)
        got = ruled.decide(context, "POST")
        assert got == asked.decide(context, "POST")
        decisions.add(got[0].sampled)
    if sampler == "parentbased_traceidratio_0.5" and parent in ("none", "malformed"):
        assert decisions == {True, False}  # the ratio rule itself was exercised both ways


@pytest.mark.parametrize(
    "sampler",
    [
        ALWAYS_ON,
        TraceIdRatioBased(0.5),
        ParentBased(ALWAYS_ON, remote_parent_not_sampled=ALWAYS_ON),
        ParentBased(Asked(ALWAYS_ON)),
        OwnDecision(ALWAYS_ON),
        None,
    ],
    ids=["always_on", "traceidratio", "own-delegates", "own-root", "own-should-sample", "none"],
)
def test_any_other_sampler_is_asked(sampler):
    assert parent_based_rule(sampler) is None
