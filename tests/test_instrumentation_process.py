"""builder="process": the same spans as the in-process builder, built by a child process that
exports through the real OTLP/HTTP exporter to a loopback receiver; ids and sampling decided once
in the serving process; a dead child is replaced (with a backoff) and gets again what it had not
reported built and exported, so a SIGKILL loses nothing the bound kept (past it: counted, never
raised); no process left."""

from __future__ import annotations

import errno
import os
import signal
import subprocess
import sys
import time
from collections import Counter

import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace.sampling import ALWAYS_OFF, ParentBased, TraceIdRatioBased

from phaselens.instrumentation import names
from phaselens.instrumentation.hotpath.observer import FINISH_LENGTH, NULL_REQUEST
from phaselens.instrumentation.hotpath.records import StepRecord, StepStats, unpack_link
from phaselens.instrumentation.pipeline.sink import wait_until
from phaselens.instrumentation.process import process_sink as shipper
from phaselens.instrumentation.process import retention
from phaselens.instrumentation.server.telemetry import ServerTelemetry
from tests.instrumentation_fixtures import (
    PARENT_ID,
    TRACE_ID,
    TRACEPARENT,
    OtlpReceiver,
    http_scope,
    make_rig,
    process_env,
    script_request,
    shapes_of_otlp_spans,
    shapes_of_sdk_spans,
)

ROOT = "text_completion tiny"


@pytest.fixture()
def receiver(monkeypatch):
    receiver = OtlpReceiver()
    process_env(monkeypatch, receiver)
    yield receiver
    receiver.close()


def gone(pid: int, timeout_s: float = 10, zombie_ok: bool = False) -> bool:
    """The process has exited (and was reaped, unless `zombie_ok`)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as stat:
                if zombie_ok and stat.read().rsplit(")", 1)[1].split()[0] == "Z":
                    return True
        except FileNotFoundError:
            return True
        time.sleep(0.02)
    return False


def script_mix(rig) -> list:
    """A traced request, a root request, a rejected one, and a step batching them with an observer
    of the loop's own (counted in the batch, not linked)."""
    traced, rooted = (
        script_request(rig),
        script_request(rig, traceparent=None, prompt=[{"role": "user", "content": "hi"}]),
    )
    rejected = rig.telemetry.request(http_scope())
    rig.clock.advance(5_000)
    rejected.fail("invalid_request_error", 400)
    rig.telemetry.step_observer.step(
        StepStats(2_000_000, 2_010_000, 0, 2, 5, 16, 0, 1), [traced, rooted, rejected, NULL_REQUEST]
    )
    return [traced, rooted, rejected]


def test_process_builder_exports_exactly_the_spans_of_the_thread_builder(receiver):
    options = {"capture_content": True, "token_events": True}
    thread_rig = make_rig(**options)
    script_mix(thread_rig)
    expected = shapes_of_sdk_spans(thread_rig.spans())
    process_rig = make_rig(builder="process", **options)
    script_mix(process_rig)
    assert process_rig.telemetry.flush(20), process_rig.telemetry.stats()
    assert shapes_of_otlp_spans(receiver.spans) == expected
    assert len(expected) == 2 * 12 + 2 + 3  # 2 full requests, a rejected one (root + ingress), 3 steps
    stats, thread_stats = process_rig.telemetry.stats(), thread_rig.telemetry.stats()
    for key in ("requests_built", "requests_unsampled", "steps_built", "steps_unsampled", "spans_built"):
        assert getattr(stats, key) == getattr(thread_stats, key), key
    assert stats.export_exported == len(expected) and stats.spans_dropped == 0
    assert stats.records_shipped == 3 + 3 and stats.child_cpu_ns > 0
    process_rig.telemetry.shutdown()
    thread_rig.telemetry.shutdown()


def test_root_ids_are_decided_in_the_serving_process(receiver):
    rig = make_rig(builder="process")
    traced, rooted, rejected = script_mix(rig)
    assert rig.telemetry.flush(20)
    roots = {s.trace_id.hex(): s for s in receiver.spans if s.name == ROOT}
    for handle in (traced, rooted):
        ids = handle.span.get_span_context()
        root = roots[format(ids.trace_id, "032x")]
        assert int.from_bytes(root.span_id, "big") == ids.span_id and handle.sampled
        children = [s for s in receiver.spans if s.parent_span_id == root.span_id]
        assert {s.name for s in children} >= set(names.PHASE_SPANS)
    assert format(traced.span.get_span_context().trace_id, "032x") == TRACE_ID
    assert roots[TRACE_ID].parent_span_id.hex() == PARENT_ID
    assert rooted.span.get_span_context().trace_id != int(TRACE_ID, 16)
    (step,) = [s for s in receiver.spans if s.name == names.SPAN_ENGINE_STEP and len(s.links) == 3]
    linked = {(int.from_bytes(link.trace_id, "big"), int.from_bytes(link.span_id, "big")) for link in step.links}
    assert linked == {
        (h.span.get_span_context().trace_id, h.span.get_span_context().span_id) for h in (traced, rooted, rejected)
    }
    rig.telemetry.shutdown()


def test_sampling_is_decided_once_upstream(receiver):
    rig = make_rig(sampler=ParentBased(ALWAYS_OFF), builder="process")
    for _ in range(3):
        script_request(rig, traceparent=None)
    script_request(rig, traceparent=TRACEPARENT)  # a sampled parent wins: parent-based
    assert rig.telemetry.flush(20)
    per_trace = Counter(s.trace_id.hex() for s in receiver.spans if s.name != names.SPAN_ENGINE_STEP)
    assert per_trace.pop(TRACE_ID) == 12 and sorted(per_trace.values()) == [1, 1, 1]  # compact records
    stats = rig.telemetry.stats()
    assert stats.requests_unsampled == 3 and stats.requests_built == 1
    assert stats.steps_unsampled == 3 and stats.steps_built == 1  # unsampled batches are not shipped
    rig.telemetry.shutdown()


def test_sampling_ratio_keeps_whole_traces(receiver):
    rig = make_rig(sampler=ParentBased(TraceIdRatioBased(0.5)), builder="process")
    handles = [script_request(rig, traceparent=None) for _ in range(60)]
    assert rig.telemetry.flush(20)
    per_trace: dict[bytes, int] = {}
    for span in receiver.spans:
        if span.name != names.SPAN_ENGINE_STEP:
            per_trace[span.trace_id] = per_trace.get(span.trace_id, 0) + 1
    sampled = {h.span.get_span_context().trace_id.to_bytes(16, "big") for h in handles if h.sampled}
    full = {trace_id for trace_id, count in per_trace.items() if count > 1}
    assert 10 < len(sampled) < 50 and full == sampled and set(per_trace.values()) == {1, 12}
    assert len(per_trace) == len(handles)  # every request's compact record
    rig.telemetry.shutdown()


def _root_ids(handles) -> set[bytes]:
    return {h.span.get_span_context().span_id.to_bytes(8, "big") for h in handles}


def _exported_roots(receiver) -> list[bytes]:
    return [span.span_id for span in receiver.spans if span.name == ROOT]


@pytest.mark.parametrize(
    ("delay", "wait_s"),
    [(None, 2.0), ("5000", 2.0), ("60000", 2.0), ("200", 0.1), ("1", 0.01), ("0", 2.0), ("-5", 2.0)],
)
def test_the_shipper_and_checkpoint_waits_follow_the_schedule_delay_up_to_the_ship_interval(delay, wait_s, monkeypatch):
    if delay is None:
        monkeypatch.delenv("OTEL_BSP_SCHEDULE_DELAY", raising=False)
    else:
        monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", delay)
    assert shipper.wait_interval_s() == pytest.approx(wait_s)


@pytest.mark.parametrize("delay", ["nan", "soon", "0.5"])
def test_an_unreadable_schedule_delay_is_refused_naming_it_as_the_batch_processors_do(delay, monkeypatch):
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", delay)
    with pytest.raises(ValueError, match=rf"OTEL_BSP_SCHEDULE_DELAY={delay!r}: expected an integer"):
        shipper.wait_interval_s()


def test_without_a_flush_the_spans_leave_within_the_schedule_delay(receiver):
    """OTEL_BSP_SCHEDULE_DELAY is 50 ms here (process_env): the shipper and the child's checkpoint
    each wait 25 ms. With a fixed 2 s a span waited 3.5-4 s; the bound is far from both."""
    rig = make_rig(builder="process")
    assert rig.telemetry.flush(20)  # the child is up: its start-up is not timed
    handle = script_request(rig)
    started = time.monotonic()
    try:
        assert wait_until(lambda: set(_exported_roots(receiver)) == _root_ids([handle]), 10)
        assert time.monotonic() - started < shipper.SHIP_INTERVAL_S
    finally:
        rig.telemetry.shutdown()


def _kill_child(rig) -> int:
    pid = rig.telemetry.span_builder_pid
    os.kill(pid, signal.SIGKILL)
    assert gone(pid, zombie_ok=True)
    return pid


def _accounted(stats: dict, records: int) -> bool:
    """Every record (a scripted request is two: the request, its step) was reported built and
    exported by a child, or counted lost."""
    return stats.records_safe + stats.channel_lost + stats.channel_dropped == records


def test_a_child_killed_with_records_in_flight_is_replaced_and_they_all_arrive(receiver):
    rig = make_rig(builder="process")
    handles = [script_request(rig)]
    assert rig.telemetry.flush(20)
    first = rig.telemetry.span_builder_pid
    os.kill(first, signal.SIGSTOP)  # it reads nothing more: what follows is shipped, never built
    handles += [script_request(rig) for _ in range(20)]
    assert wait_until(lambda: rig.telemetry.stats().records_shipped == 2 * len(handles), 10)
    _kill_child(rig)
    assert rig.telemetry.flush(20)  # the replacement got the 40 records again, then the flush
    stats = rig.telemetry.stats()
    assert stats.child_restarts == 1 and stats.child_alive == 1 and rig.telemetry.span_builder_pid != first
    assert stats.records_replayed == 40 and stats.records_shipped == 2 + 40 + 40
    assert (stats.channel_lost, stats.channel_dropped, stats.spans_dropped) == (0, 0, 0)
    assert _accounted(stats, 2 * len(handles))
    roots = _exported_roots(receiver)
    assert set(roots) == _root_ids(handles) and len(roots) == len(handles)  # each once: none was built twice
    second = rig.telemetry.span_builder_pid
    rig.telemetry.shutdown()
    assert gone(second)


def test_a_terminated_child_exports_what_it_built_and_exits_0(receiver):
    """SIGTERM is taken between reads: what was built is exported, what was not is replayed to the
    replacement; each request once, the child's exit clean."""
    rig = make_rig(builder="process")
    handles = [script_request(rig)]
    assert rig.telemetry.flush(20)  # the child is up (a SIGTERM while it starts ends it at once)
    handles += [script_request(rig) for _ in range(5)]
    assert wait_until(lambda: rig.telemetry.stats().records_shipped == 2 * len(handles), 10)
    child = rig.telemetry._sink._child.proc
    child.send_signal(signal.SIGTERM)
    assert child.wait(10) == 0
    handles.append(script_request(rig))
    assert rig.telemetry.flush(20)
    stats = rig.telemetry.stats()
    assert stats.child_restarts == 1 and (stats.channel_lost, stats.spans_dropped) == (0, 0)
    roots = _exported_roots(receiver)
    assert set(roots) == _root_ids(handles) and len(roots) == len(handles)
    rig.telemetry.shutdown()


def test_frames_are_split_whole_wherever_a_read_ends():
    from phaselens.instrumentation.process import wire

    frames = [wire.frame(wire.KIND_FLUSH, (n,)) for n in range(3)] + [wire.frame(wire.KIND_HELLO, ("s", 1, 2, True))]
    data = b"".join(frames)
    for cut in range(len(data) + 1):
        head, used = wire.split_frames(data[:cut])
        whole = max(i for i in range(len(frames) + 1) if len(b"".join(frames[:i])) <= cut)
        assert used == len(b"".join(frames[:whole])) and len(head) == whole
        tail, rest_used = wire.split_frames(data[used:])
        assert head + tail == [(wire.KIND_FLUSH, (0,)), (wire.KIND_FLUSH, (1,)), (wire.KIND_FLUSH, (2,)),
                               (wire.KIND_HELLO, ("s", 1, 2, True))][: len(head) + len(tail)]  # fmt: skip
        assert len(head) + len(tail) == len(frames) and used + rest_used == len(data)


def test_counters_read_while_a_dead_child_is_replaced_count_it_once(receiver):
    rig = make_rig(builder="process")
    script_request(rig)
    assert rig.telemetry.flush(20)
    sink = rig.telemetry._sink
    before = sink.counters()["records_safe"]
    seen, spawn = [], sink._spawn

    def spawn_and_read():  # runs while the dead child is being replaced, before the swap
        seen.append(sink.counters()["records_safe"])
        return spawn()

    sink._spawn = spawn_and_read
    _kill_child(rig)
    assert rig.telemetry.flush(20)
    assert before == 2 and seen == [before] and sink.counters()["records_safe"] == before
    rig.telemetry.shutdown()


def test_a_replacement_that_cannot_start_is_tried_again_and_nothing_is_lost(receiver):
    """Fault injection (the OS refusing a process, e.g. EMFILE): the first start of a replacement
    raises; the shipper keeps the records, counts the failure and starts one after the backoff."""
    rig = make_rig(builder="process")
    handles = [script_request(rig)]
    assert rig.telemetry.flush(20)
    sink = rig.telemetry._sink
    failures, spawn = [], sink._spawn

    def spawn_failing_once():
        if not failures:
            failures.append(1)
            raise OSError(errno.EMFILE, "Too many open files")
        return spawn()

    sink._spawn = spawn_failing_once
    _kill_child(rig)
    handles += [script_request(rig) for _ in range(3)]
    assert rig.telemetry.flush(20)  # the second start, after the backoff, gets everything
    stats = rig.telemetry.stats()
    assert (stats.spawn_errors, stats.child_restarts, stats.child_alive) == (1, 1, 1)
    assert (stats.channel_lost, stats.channel_dropped, stats.spans_dropped) == (0, 0, 0)
    assert set(_exported_roots(receiver)) == _root_ids(handles)
    rig.telemetry.shutdown()
    assert rig.telemetry._sink._shipper.is_alive() is False


def test_a_child_is_still_replaced_after_thousands_of_restarts(receiver):
    rig = make_rig(builder="process")
    handles = [script_request(rig)]
    assert rig.telemetry.flush(20)
    rig.telemetry._sink._counts["child_restarts"] = 5_000  # a crash loop of many hours
    _kill_child(rig)
    handles.append(script_request(rig))
    assert rig.telemetry.flush(20)  # replaced: the backoff is capped, not 0.5 s × 2**5000
    assert rig.telemetry.stats().child_restarts == 5_001 and set(_exported_roots(receiver)) == _root_ids(handles)
    rig.telemetry.shutdown()


def test_records_are_kept_through_the_restart_backoff_and_delivered_at_shutdown(receiver, monkeypatch):
    monkeypatch.setattr(shipper, "RESTART_BACKOFF_S", 60.0)
    rig = make_rig(builder="process")
    handles = [script_request(rig)]
    assert rig.telemetry.flush(20)
    _kill_child(rig)
    handles.append(script_request(rig))
    assert rig.telemetry.flush(20)  # the first death is replaced at once
    pid = _kill_child(rig)
    handles += [script_request(rig) for _ in range(3)]
    assert not rig.telemetry.flush(2)  # the second waits out 60 s: kept meanwhile, nothing dropped
    stats = rig.telemetry.stats()
    assert stats.child_restarts == 1 and stats.child_alive == 0 and rig.telemetry.span_builder_pid == pid
    assert (stats.channel_lost, stats.channel_dropped, stats.spans_dropped) == (0, 0, 0)
    started = time.monotonic()
    rig.telemetry.shutdown()  # a last child takes what is kept
    assert time.monotonic() - started < 30
    stats = rig.telemetry.stats()
    assert stats.child_restarts == 2 and stats.spans_dropped == 0 and _accounted(stats, 2 * len(handles))
    assert set(_exported_roots(receiver)) == _root_ids(handles)


def test_past_the_retention_bound_the_oldest_records_are_dropped_and_counted(receiver, monkeypatch):
    monkeypatch.setattr(shipper, "RESTART_BACKOFF_S", 60.0)
    rig = make_rig(builder="process")
    script_request(rig)
    assert rig.telemetry.flush(20)
    pair_bytes = rig.telemetry.stats().bytes_shipped  # one request's two frames
    rig.telemetry._sink._retained.limit_bytes = 3 * pair_bytes  # the bound, as RETAIN_BYTES sets it
    _kill_child(rig)
    assert rig.telemetry.flush(20), rig.telemetry.stats()  # replaced at once; the next death waits out the backoff
    _kill_child(rig)
    handles = []
    for _ in range(10):  # one at a time: oldest first in the retention
        handles.append(script_request(rig))
        assert wait_until(lambda: rig.telemetry.stats().queued == 0, 10)
    rig.telemetry.shutdown()  # a last child takes the newest three
    stats = rig.telemetry.stats()
    delivered = set(_exported_roots(receiver)) & _root_ids(handles)
    kept = len(delivered)
    assert kept == 3 and delivered == _root_ids(handles[-kept:])
    evicted_pairs = 2 * (len(handles) - kept)  # and, frame sizes varying, maybe the oldest kept one's step
    # evicted frames never written count as dropped; frames written to the killed child before its
    # death was seen count as lost: which of the two depends on when the shipper noticed the kill
    evicted = stats.channel_dropped + stats.channel_lost
    assert evicted in (evicted_pairs, evicted_pairs + 1), stats
    assert stats.spans_dropped == evicted and _accounted(stats, 2 + 2 * len(handles))


def test_a_backlog_is_packed_and_written_a_slice_at_a_time_and_all_of_it_arrives(receiver, monkeypatch):
    """The shipper holds the GIL through a wire.pack call: a drain packs at most PACK_RECORDS records
    a call, and writes each slice before the next (the write releases the GIL)."""
    from phaselens.instrumentation.process import wire

    monkeypatch.setattr(shipper, "PACK_RECORDS", 7)
    calls, writes, pack, write = [], [], wire.pack, shipper.ProcessSink._write
    monkeypatch.setattr(wire, "pack", lambda records: calls.append(len(records)) or pack(records))
    monkeypatch.setattr(shipper.ProcessSink, "_write", lambda self, *a: writes.append(1) or write(self, *a))
    rig = make_rig(builder="process", poll_interval_s=3600)  # asleep: the records wait for the flush
    handles = [script_request(rig) for _ in range(20)]  # 40 records: slices of 7, 7, 7, 7, 7, 5
    assert rig.telemetry.flush(20)
    # (the shipper's first wake-up, at its start, may take the first few records alone)
    assert sum(calls) == 40 and max(calls) == 7 and len(calls) >= 6, calls
    assert len(writes) >= 1 + len(calls)  # the hello, then each slice's frames before the next is packed
    stats = rig.telemetry.stats()
    assert stats.records_shipped == 40 and stats.spans_dropped == 0 and _accounted(stats, 40)
    roots = _exported_roots(receiver)
    assert set(roots) == _root_ids(handles) and len(roots) == len(handles)
    rig.telemetry.shutdown()


def test_the_retention_evicts_oldest_first_and_tells_sent_from_unsent():
    kept = retention.Retained(limit_bytes=10)
    assert kept.add(b"aaaabbbb", [4, 8]) == retention.Evicted()
    kept.sent = 2  # written to the child
    assert kept.add(b"cccc", [4]) == retention.Evicted(sent=1) and kept.sent == 1
    assert kept.add(b"dddddddd", [8]) == retention.Evicted(sent=1, unsent=1)
    assert (kept.frames, kept.size_bytes, kept.sent, kept.unsent()) == (1, 8, 0, [b"dddddddd"])
    kept.sent = 1
    assert kept.release(5) == 1 and (kept.frames, kept.size_bytes, kept.sent, kept.unsent()) == (0, 0, 0, [])


def test_the_retention_keeps_packed_frames_and_cuts_them_at_frame_bounds():
    """Frames kept as packed (a drain's in one bytes): released, evicted and re-sent frame by frame."""
    kept = retention.Retained(limit_bytes=100)
    kept.add(b"aabbbcccc", [2, 5, 9])
    kept.add(b"", [])  # a drain with nothing to ship
    kept.add(b"dddddeeeeee", [5, 11])
    assert (kept.frames, kept.size_bytes, [bytes(p) for p in kept.unsent()]) == (5, 20, [b"aabbbcccc", b"dddddeeeeee"])
    kept.sent = 4
    assert [bytes(p) for p in kept.unsent()] == [b"eeeeee"]
    assert kept.release(1) == 1 and (kept.frames, kept.size_bytes, kept.sent) == (4, 18, 3)
    kept.sent = 1
    assert [bytes(p) for p in kept.unsent()] == [b"cccc", b"dddddeeeeee"]
    kept.limit_bytes = 12  # with ff 8 bytes over: bbb and cccc go (the first chunk), then ddddd
    assert kept.add(b"ff", [2]) == retention.Evicted(sent=1, unsent=2)
    assert (kept.frames, kept.size_bytes, kept.sent, [bytes(p) for p in kept.unsent()]) == (2, 8, 0, [b"eeeeee", b"ff"])


def serve_two_tokens(telemetry: ServerTelemetry) -> None:
    """One traced request through every phase, two output tokens: seven spans."""
    req = telemetry.request(http_scope(traceparent=TRACEPARENT))
    req.enqueued()
    req.scheduled()
    req.first_token()
    req.token()
    req.finished(FINISH_LENGTH)
    req.complete(2, FINISH_LENGTH)


def test_shutdown_exports_everything_and_leaves_no_process(receiver, monkeypatch):
    monkeypatch.setenv(names.ENV_SPAN_BUILDER, "process")
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "60000")  # only the shutdown exports
    telemetry = ServerTelemetry.from_env("process-test")
    assert telemetry.builder == "process"
    pid = telemetry.span_builder_pid
    serve_two_tokens(telemetry)
    telemetry.shutdown()
    assert gone(pid, timeout_s=0.5)
    assert sum(s.name == "POST" for s in receiver.spans) == 1 and len(receiver.spans) == 7  # not described
    assert telemetry.stats().export_exported == 7


def test_private_providers_export_only_from_the_child(receiver, monkeypatch):
    """A host that owns the global providers (vLLM): the serving process's providers are private and
    hold no span processor, metric reader or exporter thread; the child exports the spans, as many."""
    monkeypatch.setenv(names.ENV_SPAN_BUILDER, "process")
    monkeypatch.setenv("OTEL_METRICS_EXPORTER", "otlp")  # a reader would be made for it
    telemetry = ServerTelemetry.from_env("process-private", set_global=False)
    try:
        assert telemetry.tracer_provider is not trace.get_tracer_provider()
        assert telemetry.tracer_provider._active_span_processor._span_processors == ()
        assert telemetry.meter_provider._metric_readers == []
        serve_two_tokens(telemetry)
    finally:
        telemetry.shutdown()
    assert len(receiver.spans) == 7 and telemetry.stats().export_exported == 7


def test_the_child_dies_with_its_server_process(receiver, tmp_path):
    code = (
        "from phaselens.instrumentation.server.telemetry import ServerTelemetry; import time; "
        "t = ServerTelemetry(builder='process'); print(t.span_builder_pid, flush=True); time.sleep(60)"
    )
    server = subprocess.Popen(
        [sys.executable, "-c", code], stdout=subprocess.PIPE, cwd=os.path.dirname(os.path.dirname(__file__))
    )
    child = int(server.stdout.readline())
    server.kill()
    server.wait()
    assert gone(child)


def test_unknown_builder_is_a_clear_error():
    with pytest.raises(ValueError, match="builder='fork'"):
        ServerTelemetry(builder="fork")


def test_records_are_frozen_plain_data_that_cross_the_pipe_unchanged():
    import marshal

    from phaselens.instrumentation.process import wire

    submitted = []
    rig = make_rig(capture_content=True, poll_interval_s=3600)
    rig.telemetry._closer._submit = submitted.append
    rig.telemetry.step_observer.submit = submitted.append
    traced = script_request(rig, prompt=[{"role": "user", "content": "hi"}])
    rig.telemetry.step_observer.step(StepStats(2_000_000, 2_010_000, 0, 2, 5, 16, 0, 1), [traced, NULL_REQUEST])
    step, request, both = submitted
    assert request.root.span_id == traced.span.get_span_context().span_id and request.sampled
    assert (request.parent.trace_id, request.parent.span_id) == (int(TRACE_ID, 16), int(PARENT_ID, 16))
    assert request.token_ts.tolist() == [1_730_000, 1_740_000, 1_750_000, 1_960_000, 1_970_000]
    assert (both.num_seqs, both.links) == (2, traced.link) and unpack_link(traced.link)[:2] == (
        request.root.trace_id,
        request.root.span_id,
    )
    with pytest.raises(AttributeError):
        request.responded_ts = 0
    frame = wire.encode_request(request)
    assert wire.decode_request(marshal.loads(frame[wire.HEADER.size :])) == request
    for record in (step, both):  # a step is read with its sampled members' links packed end to end
        decoded = wire.decode_step(marshal.loads(wire.encode_step(record)[wire.HEADER.size :]))
        assert decoded == record and type(decoded) is StepRecord
    assert decoded.num_seqs == 2 and decoded.links == traced.link
    rig.telemetry.shutdown()
