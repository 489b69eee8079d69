"""Arrival statistics, workloads, run-level formulas and the sweep's search: no network."""

from __future__ import annotations

import asyncio
import itertools
import json
import math

import numpy as np
import pytest

from phaselens.common.slo import parse_slo
from phaselens.instrumentation.client.traced_client import StreamResult, compute_metrics
from phaselens.loadgen import metrics, sweep
from phaselens.loadgen.arrivals import GammaArrivals, TraceArrivals, coefficient_of_variation
from phaselens.loadgen.workloads import DatasetWorkload, LengthDist, RequestSpec, SyntheticWorkload, TraceWorkload


def offsets(process, n):
    return list(itertools.islice(process.offsets_s(), n))


@pytest.mark.parametrize("burstiness, cv", [(1.0, 1.0), (0.25, 2.0), (4.0, 0.5)])
def test_gamma_arrivals_have_the_rate_and_burstiness_asked(burstiness, cv):
    times = offsets(GammaArrivals(rate=50.0, burstiness=burstiness, seed=3), 20000)
    assert times[0] == 0.0 and all(b >= a for a, b in itertools.pairwise(times))
    assert (len(times) - 1) / times[-1] == pytest.approx(50.0, rel=0.05)
    assert coefficient_of_variation(times) == pytest.approx(cv, rel=0.08)


def test_arrivals_are_seeded_and_kinds_named():
    a, b, c = (offsets(GammaArrivals(10.0, 1.0, seed), 50) for seed in (1, 1, 2))
    assert a == b and a != c
    assert GammaArrivals(10.0).kind == "poisson" and GammaArrivals(10.0, 0.5).kind == "gamma"
    assert offsets(GammaArrivals(math.inf), 5) == [0.0] * 5


@pytest.mark.parametrize("rate, burstiness", [(0.0, 1.0), (-1.0, 1.0), (1.0, 0.0), (1.0, math.inf)])
def test_bad_arrival_parameters_raise(rate, burstiness):
    with pytest.raises(ValueError):
        GammaArrivals(rate, burstiness)


def test_trace_replay_offsets_and_shapes(tmp_path):
    path = tmp_path / "trace.jsonl"
    path.write_text(
        '{"timestamp_ms": 1000, "input_length": 5, "output_length": 7}\n\n'
        '{"timestamp_ms": 1250, "prompt": "hello there"}\n{"timestamp_ms": 3000}\n'
    )
    trace = TraceArrivals(str(path))
    assert list(trace.offsets_s()) == [0.0, 0.25, 2.0]
    specs = list(
        TraceWorkload(trace.entries, SyntheticWorkload(LengthDist.parse("3"), LengthDist.parse("9"))).requests()
    )
    assert [len(s.prompt.split()) for s in specs] == [5, 2, 3] and specs[1].prompt == "hello there"
    assert [s.max_tokens for s in specs] == [7, 9, 9]


@pytest.mark.parametrize(
    "text, message",
    [
        ('{"t": 1}\n', "timestamp"),
        ('{"timestamp": 2}\n{"timestamp": 1}\n', "backwards"),
        ("", "no requests"),
        ("nope\n", "timestamp"),
    ],
)
def test_bad_traces_raise_with_the_line(tmp_path, text, message):
    path = tmp_path / "bad.jsonl"
    path.write_text(text)
    with pytest.raises(ValueError, match=message):
        TraceArrivals(str(path))


def test_length_distributions_parse_and_sample():
    rng = np.random.default_rng(0)
    assert [LengthDist.parse(s).sample(rng) for s in ("16", "fixed:16")] == [16, 16]
    uniform = [LengthDist.parse("uniform:32:512").sample(rng) for _ in range(5000)]
    assert min(uniform) == 32 and max(uniform) == 512 and np.mean(uniform) == pytest.approx(272, rel=0.03)
    lognormal = [LengthDist.parse("lognormal:200:0.5").sample(rng) for _ in range(20000)]
    assert np.mean(lognormal) == pytest.approx(200, rel=0.03)
    normal = [LengthDist.parse("normal:100:10").sample(rng) for _ in range(5000)]
    assert np.mean(normal) == pytest.approx(100, rel=0.02) and np.std(normal) == pytest.approx(10, rel=0.1)
    assert str(LengthDist.parse("uniform:32:512")) == "uniform:32:512"


@pytest.mark.parametrize("spec", ["", "zipf:1:2", "uniform:9:3", "0", "normal:10", "fixed:abc", "uniform:1:2:3"])
def test_bad_length_distributions_raise(spec):
    with pytest.raises(ValueError, match="length distribution"):
        LengthDist.parse(spec)


def test_synthetic_prompts_lengths_and_shared_prefix():
    work = SyntheticWorkload(LengthDist.parse("uniform:10:20"), LengthDist.parse("8"), shared_prefix=6, seed=1)
    specs = list(itertools.islice(work.requests(), 50))
    prefixes = {" ".join(s.prompt.split()[:6]) for s in specs}
    assert len(prefixes) == 1 and len({s.prompt for s in specs}) == 50
    assert all(16 <= len(s.prompt.split()) <= 26 and s.max_tokens == 8 for s in specs)
    again = list(itertools.islice(work.requests(), 50))
    assert [s.prompt for s in again] == [s.prompt for s in specs]  # seeded


def test_payloads_hold_output_length():
    spec = RequestSpec(prompt="hi there", max_tokens=12)
    assert spec.payload("completions", "m", ignore_eos=True) == {
        "model": "m",
        "prompt": "hi there",
        "max_tokens": 12,
        "ignore_eos": True,
        "min_tokens": 12,
    }
    assert spec.payload("chat", "m") == {
        "model": "m",
        "messages": [{"role": "user", "content": "hi there"}],
        "max_tokens": 12,
    }
    chat = RequestSpec(messages=[{"role": "user", "content": "q"}], max_tokens=3)
    assert chat.payload("completions", "m")["prompt"] == "user: q"


def test_dataset_rows_prompt_messages_and_sharegpt(tmp_path):
    path = tmp_path / "data.jsonl"
    rows = [
        {"prompt": "one two", "output_len": 4},
        {"messages": [{"role": "user", "content": "m"}]},
        {"conversations": [{"from": "human", "value": "q q"}, {"from": "gpt", "value": "a b c d e"}]},
    ]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    specs = list(itertools.islice(DatasetWorkload(str(path)).requests(), 4))
    assert [s.max_tokens for s in specs] == [4, 128, 5, 4]  # cycled; ShareGPT reply length
    assert specs[1].messages == [{"role": "user", "content": "m"}] and specs[2].prompt == "q q"
    fixed = list(itertools.islice(DatasetWorkload(str(path), LengthDist.parse("9"), shared_prefix=2).requests(), 3))
    assert [s.max_tokens for s in fixed] == [9, 9, 9] and fixed[1].messages[0]["role"] == "system"
    path.write_text('{"text": "no prompt"}\n')
    with pytest.raises(ValueError, match=":1: a row needs"):
        DatasetWorkload(str(path))


def result(ttft=None, e2e=None, tokens=(), lag=0.0, error=None, usage=None, input_tokens=None, start=0) -> StreamResult:
    """A result with stamps built from ms offsets: content chunks at ttft … e2e."""
    ms = 1_000_000
    r = StreamResult("completions", "m", intended_ts=start, sent_ts=start + int(lag * ms), error_type=error)
    if ttft is not None:
        n = len(tokens)
        r.chunk_ts = [r.sent_ts + int((ttft + (e2e - ttft) * i / max(n - 1, 1)) * ms) for i in range(n)]
        r.chunk_tokens = list(tokens)
        r.first_chunk_ts = r.first_output_ts = r.chunk_ts[0]
        r.last_chunk_ts = r.chunk_ts[-1]
    r.output_tokens, r.input_tokens = usage, input_tokens
    r.done_ts = r.sent_ts + int((e2e or 50) * ms)
    compute_metrics(r)
    return r


def test_run_summary_formulas_by_hand():
    results = [
        result(10, 110, [1] * 11, lag=2, usage=11, input_tokens=5),  # TPOT 10
        result(20, 60, [1, 1, 3], lag=0, usage=5, input_tokens=5),  # TPOT 10, ITL 20, 20
        result(30, 30, [1], lag=1, usage=1, input_tokens=5),  # one token: no TPOT
        result(error="timeout", lag=0),
    ]
    s = metrics.summarize(results, duration_s=2.0, percentiles=(50, 99), slo=parse_slo("ttft:25,tpot:12"))
    assert s["requests"] == {
        "total": 4,
        "completed": 3,
        "failed": 1,
        "no_output": 0,
        "error_rate": 0.25,
        "errors": {"timeout": 1},
    }
    assert s["throughput"] == {"requests_per_s": 1.5, "output_tokens_per_s": 8.5, "total_tokens_per_s": 16.0}
    ttft = s["latency_ms"]["ttft"]
    assert (ttft["count"], ttft["mean"], ttft["min"], ttft["max"]) == (3, 20.0, 10.0, 30.0)
    assert ttft["std"] == pytest.approx(math.sqrt(200 / 3)) and ttft["percentiles"]["p50"] == 20.0
    assert ttft["percentiles"]["p99"] == pytest.approx(20 + 10 * 0.98)  # linear: position 0.99 × 2
    assert s["latency_ms"]["tpot"]["mean"] == pytest.approx(10.0)
    assert s["latency_ms"]["itl"]["count"] == 12 and s["latency_ms"]["itl"]["mean"] == pytest.approx(
        10.0 * 10 / 12 + 40 / 12
    )
    assert s["latency_ms"]["itl_per_token"]["min"] == pytest.approx(20 / 3)
    assert s["latency_ms"]["ttft_from_intended"]["mean"] == pytest.approx((12 + 20 + 31) / 3)
    assert s["latency_ms"]["schedule_lag"]["max"] == 2.0
    # failure-adjusted: the timeout is +inf, so p99 of 4 values is infinite, p50 is finite
    assert s["failure_adjusted_ms"]["ttft"] == {"p50": 25.0, "p99": math.inf}
    # SLO ttft ≤ 25 from intended, tpot ≤ 12: requests 1 (12 ms) and 2 (20 ms) meet, 3 (31) and the failure miss
    assert s["goodput"] == {
        "slo_ms": {"ttft_ms": 25.0, "tpot_ms": 12.0},
        "met": 2,
        "attainment": 0.5,
        "requests_per_s": 1.0,
    }
    assert (s["tokens"]["usage_mismatch_requests"], s["tokens"]["input"], s["tokens"]["output"]) == (0, 15, 17)


def test_a_completed_request_without_output_is_counted_not_dropped():
    """EOS as the first token: the server answered, no content chunk came, so there is no TTFT."""
    silent = result(usage=1)
    assert silent.ok and silent.no_output and silent.ttft_ms is None
    s = metrics.summarize([result(10, 20, [1, 1], usage=2), silent], 1.0, (50, 99))
    assert s["requests"] == {"total": 2, "completed": 2, "failed": 0, "no_output": 1, "error_rate": 0.0, "errors": {}}
    assert s["latency_ms"]["ttft"]["count"] == 1  # its TTFT does not exist ...
    assert s["failure_adjusted_ms"]["ttft"]["p99"] == math.inf  # ... and the tail does not forget it


def test_usage_mismatch_is_counted():
    s = metrics.summarize([result(10, 20, [1, 1], usage=4), result(10, 20, [1, 1])], 1.0, (50,))
    assert (s["tokens"]["usage_mismatch_requests"], s["tokens"]["usage_mismatch_tokens"]) == (1, 2)
    assert (s["tokens"]["usage_missing"], s["tokens"]["output"], s["tokens"]["counted"]) == (1, 6, 4)


@pytest.mark.parametrize("bad", ["ttft", "ttft:0", "speed:3", "ttft:1,ttft:2", "", "tpot:x"])
def test_bad_slos_raise(bad):
    with pytest.raises(ValueError):
        parse_slo(bad)


@pytest.mark.parametrize("capacity, start", [(37.0, 1.0), (37.0, 200.0), (0.3, 1.0)])
def test_sweep_brackets_then_bisects_to_the_capacity(capacity, start):
    async def probe(rate):
        return (1.0 if rate <= capacity else 0.5), {}

    seen = []
    found = asyncio.run(sweep.find_capacity(probe, 0.9, start, 1000.0, rel_tol=0.02, on_probe=seen.append))
    assert found.bounded and capacity * 0.98 <= found.capacity <= capacity
    assert seen == found.probes and len(seen) <= 16
    rates = [p.rate for p in seen]
    assert all(p.passed == (p.rate <= capacity) for p in seen) and rates[0] == start


def test_sweep_reports_unbounded_and_zero_capacity():
    async def always(rate):
        return 1.0, {}

    async def never(rate):
        return 0.0, {}

    high = asyncio.run(sweep.find_capacity(always, 0.9, 1.0, 64.0))
    assert (high.capacity, high.bounded, [p.rate for p in high.probes]) == (64.0, False, [1, 2, 4, 8, 16, 32, 64])
    low = asyncio.run(sweep.find_capacity(never, 0.9, 1.0, 64.0, min_rate=0.25))
    assert (low.capacity, [p.rate for p in low.probes]) == (0.0, [1.0, 0.5, 0.25])


@pytest.fixture()
def tiny_tokens(tmp_path):
    """The tiny vLLM model's byte-level BPE tokenizer (several tokens per English word)."""
    from phaselens.integrations.vllm.tiny_model import _tokenizer
    from phaselens.loadgen.token_prompts import TokenPrompts

    _tokenizer(vocab_size=384).save_pretrained(tmp_path)
    return TokenPrompts.load(str(tmp_path))


def test_token_prompts_have_exactly_n_tokens_of_the_given_tokenizer(tiny_tokens):
    from phaselens.loadgen.workloads import words

    rng = np.random.default_rng(3)
    for n in (1, 2, 7, 50, 300):
        assert tiny_tokens.count(tiny_tokens.prompt(rng, n, words)) == n


def test_synthetic_workload_counts_tokens_with_a_tokenizer_and_words_without(tiny_tokens):
    dist = LengthDist.parse("uniform:16:128")
    with_tokens = SyntheticWorkload(dist, LengthDist("fixed", 4), seed=1, tokens=tiny_tokens)
    plain = SyntheticWorkload(dist, LengthDist("fixed", 4), seed=1)
    counted = [tiny_tokens.count(s.prompt) for s, _ in zip(with_tokens.requests(), range(16), strict=False)]
    assert all(16 <= c <= 128 for c in counted) and len(set(counted)) > 8
    words_only = [tiny_tokens.count(s.prompt) for s, _ in zip(plain.requests(), range(16), strict=False)]
    assert max(words_only) > 128  # ~3 tokens a word here: the word approximation overshoots the range
    assert with_tokens.describe()["input_unit"].startswith("tokens of ")


def test_unknown_tokenizer_is_a_usage_error(tmp_path):
    from phaselens.loadgen.token_prompts import TokenPrompts

    with pytest.raises(ValueError, match="--tokenizer"):
        TokenPrompts.load(str(tmp_path / "missing"))
