"""The vLLM KV connector's per-request timing without vLLM: a step's records (integrations/vllm/
kv_timing.py), a request handle adding them up, and the llm.kv_save / llm.kv_load spans the span
builder makes of them (both emitters, and across the span-builder process's pipe)."""

from __future__ import annotations

import time

import pytest
from opentelemetry.sdk.trace.id_generator import RandomIdGenerator
from opentelemetry.trace import SpanKind

from phaselens.common.clocks import MonoTs
from phaselens.instrumentation import names
from phaselens.instrumentation.hotpath.records import KvStamps
from phaselens.instrumentation.pipeline.spans import kv_spans
from phaselens.instrumentation.process import wire
from phaselens.integrations.vllm.kv_timing import LOAD, SAVE, StepTiming, records_of, step_requests
from tests.instrumentation_fixtures import http_scope, make_rig


def _timed(step: StepTiming, save: bool, nbytes: int | None) -> None:
    calls = step.save if save else step.load
    with calls.timed():
        time.sleep(0.001)
    if nbytes is not None:
        calls.add_bytes(nbytes)


def test_a_step_records_each_of_its_requests_with_its_calls_time_and_bytes_only_when_alone():
    saves, loads = step_requests(["a", "b", "c"], {"c"})
    assert (saves, loads) == (("a", "b"), ("c",))
    step = StepTiming(saves, loads)
    _timed(step, save=True, nbytes=4096)
    _timed(step, save=True, nbytes=4096)
    _timed(step, save=False, nbytes=2048)
    records = step.records()
    assert [(r[0], r[1], r[5]) for r in records] == [("a", SAVE, None), ("b", SAVE, None), ("c", LOAD, 2048)]
    for _, _, start, end, busy, _ in records:
        assert 0 < busy <= end - start
    assert records_of({"phaselens_kv": records, "inner": None}) == records
    assert records_of({"num_successful_transfers": 3}) == [] and records_of(None) == []


def test_a_step_whose_calls_moved_nothing_or_named_no_request_records_nothing():
    nothing_stored = StepTiming(("a",), ())
    _timed(nothing_stored, save=True, nbytes=0)  # ExampleConnector: the prompt's KV was stored already
    unnamed = StepTiming((), ())
    _timed(unnamed, save=True, nbytes=4096)
    assert nothing_stored.records() == [] and unnamed.records() == []
    assert StepTiming(("a",), ()).records() == []  # no call ran


def test_steps_add_up_in_the_handle_and_become_kv_spans_of_its_server_span():
    rig = make_rig()
    handle = rig.telemetry.open_request(http_scope(), managed=False)
    handle.kv_moved(True, MonoTs(1_000), MonoTs(5_000), 3_000, 4096)  # a chunked prefill: two steps
    handle.kv_moved(True, MonoTs(9_000), MonoTs(12_000), 2_000, None)
    handle.kv_moved(False, MonoTs(20_000), MonoTs(26_000), 6_000, 8192)
    assert handle.kv == KvStamps(
        MonoTs(1_000), MonoTs(12_000), 5_000, None, MonoTs(20_000), MonoTs(26_000), 6_000, 8192
    )
    record = handle.freeze()
    frames, _ = wire.split_frames(wire.encode_request(record))
    assert wire.decode_request(frames[0][1]).kv == record.kv  # as the span-builder process gets it
    handle.complete(output_tokens=0)
    spans = rig.by_name()
    (save,), (load,) = spans[names.SPAN_KV_SAVE], spans[names.SPAN_KV_LOAD]
    (root,) = [s for group in spans.values() for s in group if s.kind == SpanKind.SERVER]
    assert dict(save.attributes) == {names.PL_KV_SAVE_MS: 0.005}
    assert dict(load.attributes) == {names.PL_KV_LOAD_MS: 0.006, names.PL_KV_BYTES: 8192}
    assert (save.end_time - save.start_time, load.end_time - load.start_time) == (11_000, 6_000)
    assert save.parent.span_id == load.parent.span_id == root.context.span_id


@pytest.mark.parametrize("kv", [None, KvStamps()])
def test_a_request_without_kv_moves_has_no_kv_span(kv):
    rig = make_rig()
    record = rig.telemetry.open_request(http_scope(), managed=False).freeze()._replace(kv=kv)
    assert kv_spans(RandomIdGenerator(), rig.anchor, record) == []
