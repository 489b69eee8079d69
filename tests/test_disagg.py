"""Disaggregated prefill/decode in the engine: a prefill engine sends real KV bytes over TCP to a
decode engine, which continues the request in its own batch (reference_server.engine.disagg)."""

from __future__ import annotations

import socket
import time

import pytest
from opentelemetry.sdk.trace import SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanContext, TraceFlags

from phaselens.instrumentation import names
from phaselens.instrumentation.hotpath.records import SpanIds
from phaselens.reference_server.engine import kv_transfer
from phaselens.reference_server.engine.disagg import KvHandoff, ReceivedKv
from phaselens.reference_server.engine.kv_transfer import KvReceiver
from phaselens.reference_server.engine.sequence import FINISH_TRANSFERRED
from phaselens.reference_server.pd.pd_spans import PdSpans
from tests.server_fixtures import Collected, greedy, make_engine


def _wait(predicate, timeout_s: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.01)
    return predicate()


@pytest.fixture()
def pd():
    """(prefill engine, decode engine, the decode engine's KV receiver), threads running."""
    prefill = make_engine(kv_cache_tokens=2048, max_num_batched_tokens=64)
    decode = make_engine(kv_cache_tokens=2048)
    received: list[ReceivedKv] = []

    def handler(transfer: kv_transfer.Transfer) -> None:
        item = ReceivedKv(transfer, time.monotonic_ns())
        received.append(item)
        decode.receive_kv(item)

    receiver = KvReceiver("127.0.0.1", 0, handler, check=decode.check_kv_header)
    for part in (prefill, decode, receiver):
        part.start()
    yield prefill, decode, receiver, received
    receiver.stop()
    prefill.stop()
    decode.stop()


def _disaggregated(
    prefill, decode, receiver, prompt: list[int], params, transfer_id: str
) -> tuple[Collected, KvHandoff]:
    first, rest = Collected(), Collected()
    handoff = KvHandoff(receiver.address, transfer_id)
    prefill.submit(prompt, params, sink=first, handoff=handoff)
    assert _wait(lambda: first.final is not None)
    assert first.final.finish_reason == FINISH_TRANSFERRED, first.final
    decode.claim(transfer_id, params, sink=rest)
    assert _wait(lambda: rest.final is not None)
    return rest, handoff


def test_greedy_output_equals_colocated_and_kv_bytes_arrive_whole(pd):
    """Three prompts, one longer than the prefill step budget (chunked prefill): the decode engine
    continues each exactly as one colocated engine generates it; every byte sent is received and
    written, and both sides free every block."""
    prefill, decode, receiver, received = pd
    colocated = make_engine(kv_cache_tokens=2048)
    colocated.start()
    try:
        for i, prompt in enumerate(([5, 6, 7], list(range(3, 40)), list(range(10, 170)))):
            params = greedy(12, ignore_eos=True)
            alone = Collected()
            colocated.submit(prompt, params, sink=alone)
            rest, handoff = _disaggregated(prefill, decode, receiver, prompt, params, f"t{i}")
            assert _wait(lambda a=alone: a.final is not None)
            assert rest.content == alone.content and rest.final.output_tokens == 12
            blocks = -(-len(prompt) // 16)
            assert handoff.kv_bytes == blocks * prefill.runner.cache.bytes_per_block() == received[-1].transfer.nbytes
            assert handoff.received_bytes == handoff.kv_bytes and handoff.ack_ts > handoff.send_start_ts
    finally:
        colocated.stop()
    assert _wait(lambda: prefill.scheduler.blocks.num_used == 0 and decode.scheduler.blocks.num_used == 0)
    assert (prefill.stats.kv_sent, decode.stats.kv_received, decode.num_staged) == (3, 3, 0)


def test_decode_side_down_fails_the_request_and_frees_the_prefill_blocks(pd):
    prefill, _, _, _ = pd
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        dead = s.getsockname()
    out = Collected()
    handoff = KvHandoff(dead, "gone")
    prefill.submit(list(range(3, 60)), greedy(8, ignore_eos=True), sink=out, handoff=handoff)
    assert _wait(lambda: out.final is not None)
    assert out.final.finish_reason == "error" and "127.0.0.1" in out.final.error
    assert "failed" in handoff.error and prefill.stats.kv_send_failed == 1
    assert prefill.scheduler.blocks.num_used == 0


def test_refused_transfers_name_their_reason_and_stage_nothing(pd):
    """A transfer for another model, or one whose blocks do not match its tokens, is refused in the
    ack; one never claimed is freed after the stage timeout."""
    _, decode, receiver, _ = pd
    cache = decode.runner.cache
    good = {
        "transfer_id": "x",
        "model": "tiny",
        "token_ids": [1, 2, 3, 4],
        "num_prompt_tokens": 3,
        "num_blocks": 1,
        "bytes_per_block": cache.bytes_per_block(),
    }
    parts = cache.export_blocks([0])
    for bad, reason in (
        ({"model": "other"}, "model"),
        ({"num_blocks": 2}, "blocks"),
        ({"num_prompt_tokens": 9}, "token"),
    ):
        with pytest.raises(kv_transfer.KvTransferError, match=reason):
            kv_transfer.send(receiver.address, good | bad, parts, 10)
    with pytest.raises(kv_transfer.KvTransferError, match="tensors"):  # refused before its bytes are read
        kv_transfer.send(receiver.address, good, [*parts, b"x" * 100], 10)
    assert decode.num_staged == 0 and decode.scheduler.blocks.num_used == 0
    decode.stage_timeout_ns = 0
    kv_transfer.send(receiver.address, good, parts, 10)
    assert _wait(lambda: decode.stats.kv_expired == 1)
    assert decode.num_staged == 0 and decode.scheduler.blocks.num_used == 0
    with pytest.raises(KeyError):
        decode.claim("x", greedy(4))


def test_malformed_frames_are_refused_without_hanging(pd):
    _, decode, receiver, _ = pd
    with socket.create_connection(receiver.address, timeout=10) as sock:
        sock.sendall(b"GET / HTTP/1.1\r\n\r\n")
        ack = sock.recv(4096)
    assert b"bad magic" in ack
    assert decode.num_staged == 0


class _Handle:
    """What PdSpans reads of a request handle: its SERVER span ids and two stamps."""

    def __init__(self) -> None:
        self.root = SpanIds(0xABC, 0x123, 1)
        self.received_ts, self.first_token_ts = 1_000_000, 5_000_000


def test_kv_spans_chain_prefill_to_decode_with_durations_of_one_clock_each():
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    prefill, decode, handle = PdSpans(provider), PdSpans(provider), _Handle()
    handoff = KvHandoff(("127.0.0.1", 9), "t", traceparent=prefill.kv_send_traceparent(handle))
    handoff.send_start_ts, handoff.ack_ts, handoff.kv_bytes, handoff.received_bytes = 7_000_000, 9_500_000, 64, 64
    prefill.kv_sent(handle, handoff, 10_000_000)
    header = {"transfer_id": "t", "traceparent": handoff.traceparent}
    received = ReceivedKv(kv_transfer.Transfer(header, [b"x" * 64], accepted_ts=100), 400)
    decode.kv_received(received, 900)
    prefill.shutdown()
    decode.shutdown()
    sent, got = sorted(exporter.get_finished_spans(), key=lambda s: s.name, reverse=True)
    assert (sent.name, got.name) == (names.SPAN_KV_TRANSFER, names.SPAN_KV_RECEIVE)
    assert sent.parent.span_id == 0x123 and sent.context.trace_id == 0xABC
    assert got.parent.span_id == sent.context.span_id and got.context.trace_id == 0xABC
    assert sent.attributes[names.PL_KV_TRANSFER_MS] == 2.5 and sent.attributes[names.PL_KV_WAIT_MS] == 2.0
    assert sent.attributes[names.PL_PD_PREFILL_ANSWER_MS] == 9.0 and sent.end_time - sent.start_time == 2_500_000
    assert got.attributes[names.PL_KV_BYTES] == 64 and got.attributes[names.PL_KV_STAGE_MS] == 0.0005


def test_a_span_that_cannot_be_emitted_is_counted_not_raised():
    class Broken(SpanProcessor):
        def on_end(self, span) -> None:
            raise RuntimeError("exporter gone")

    provider = TracerProvider()
    provider.add_span_processor(Broken())
    spans = PdSpans(provider)
    spans.submit("x", SpanContext(1, 2, False, TraceFlags(1)), None, 1, 2, {})
    spans.shutdown()
    assert (spans.emitted, spans.failed) == (0, 1)
