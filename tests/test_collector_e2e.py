"""Real OTel SDK exporters (gRPC, HTTP/protobuf), OTLP/JSON and raw HTTP → Collector → embedded ClickHouse."""

from __future__ import annotations

import base64
import gzip
import json

import grpc
import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as GrpcExporter
from opentelemetry.exporter.otlp.proto.http import Compression as HttpCompression
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as HttpExporter
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import AnyValue
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import Link, SpanContext, SpanKind, Status, StatusCode, TraceFlags

from phaselens.collectors.otlp_json import parse_traces
from phaselens.collectors.service import Collector
from phaselens.common.exposure import InsecureBindError
from tests.collector_fixtures import collector, rows, traces_db, wait_rows

EXPORT = "/opentelemetry.proto.collector.trace.v1.TraceService/Export"
ATTRIBUTES = {
    "str": "x",
    "int": -42,
    "float_whole": 1.0,
    "float_frac": 0.1,
    "float_tiny": 1e-7,
    "float_huge": 1e21,
    "float_big": 1e20,
    "bool": True,
    "str_list": ["a", "<b>"],
    "int_list": [1, 2, 3],
    "float_list": [1.5, 2.0],
    "bool_list": [True, False],
}
EXPECTED_ATTRIBUTES = {
    "str": "x",
    "int": "-42",
    "float_whole": "1",
    "float_frac": "0.1",
    "float_tiny": "1e-7",
    "float_huge": "1e+21",
    "float_big": "100000000000000000000",
    "bool": "true",
    "str_list": '["a","\\u003cb\\u003e"]',
    "int_list": "[1,2,3]",
    "float_list": "[1.5,2]",
    "bool_list": "[true,false]",
}
LINKED = SpanContext(
    trace_id=0x0102030405060708090A0B0C0D0E0F10, span_id=0x1112131415161718, is_remote=True, trace_flags=TraceFlags(1)
)


def _emit(exporter) -> list:
    """A SERVER root with a CLIENT child (event, link, error status), sent through `exporter`."""
    memory = InMemorySpanExporter()
    provider = TracerProvider(resource=Resource.create({"service.name": "svc-under-test", "deployment": "t"}))
    provider.add_span_processor(SimpleSpanProcessor(memory))
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracer = provider.get_tracer("phaselens.test", "9.9")
    with tracer.start_as_current_span("root", kind=SpanKind.SERVER, attributes=ATTRIBUTES):
        with tracer.start_as_current_span("child", kind=SpanKind.CLIENT, links=[Link(LINKED, {"link.n": 3})]) as child:
            child.add_event("tick", {"n": 2.5})
            child.set_status(Status(StatusCode.ERROR, "boom"))
    provider.shutdown()
    return memory.get_finished_spans()


def _expected(span) -> dict:
    return {
        "Timestamp_ns": span.start_time,
        "TraceId": f"{span.context.trace_id:032x}",
        "SpanId": f"{span.context.span_id:016x}",
        "ParentSpanId": f"{span.parent.span_id:016x}" if span.parent else "",
        "TraceState": "",
        "SpanName": span.name,
        "SpanKind": span.kind.name.capitalize(),
        "ServiceName": "svc-under-test",
        "ScopeName": "phaselens.test",
        "ScopeVersion": "9.9",
        "Duration": span.end_time - span.start_time,
        "StatusCode": {StatusCode.UNSET: "Unset", StatusCode.OK: "Ok", StatusCode.ERROR: "Error"}[
            span.status.status_code
        ],
        "StatusMessage": span.status.description or "",
    }


def _actual(row: dict, timestamp_ns: int) -> dict:
    keys = (
        "TraceId",
        "SpanId",
        "ParentSpanId",
        "TraceState",
        "SpanName",
        "SpanKind",
        "ServiceName",
        "ScopeName",
        "ScopeVersion",
        "Duration",
        "StatusCode",
        "StatusMessage",
    )
    return {k: row[k] for k in keys} | {"Timestamp_ns": timestamp_ns}


@pytest.mark.parametrize("protocol", ["grpc", "http"])
@pytest.mark.parametrize("gzip_on", [False, True])
def test_sdk_exporter_rows_match_exporter_rendering(protocol, gzip_on, collector, ch_client, traces_db):
    if protocol == "grpc":
        exporter = GrpcExporter(
            endpoint=collector.grpc_endpoint,
            insecure=True,
            compression=grpc.Compression.Gzip if gzip_on else grpc.Compression.NoCompression,
        )
    else:
        exporter = HttpExporter(
            endpoint=f"{collector.http_endpoint}/v1/traces",
            compression=HttpCompression.Gzip if gzip_on else HttpCompression.NoCompression,
        )
    spans = {s.name: s for s in _emit(exporter)}
    assert wait_rows(ch_client, traces_db, 2) == 2
    got = {r["SpanName"]: r for r in rows(ch_client, traces_db)}
    ns = {
        r[0]: r[1]
        for r in ch_client.query(
            f"SELECT SpanName, toUnixTimestamp64Nano(Timestamp) FROM {traces_db}.otel_traces"
        ).result_rows
    }
    for name, span in spans.items():
        assert _actual(got[name], ns[name]) == _expected(span)
    root, child = got["root"], got["child"]
    assert root["SpanAttributes"] == EXPECTED_ATTRIBUTES
    assert root["ResourceAttributes"]["service.name"] == "svc-under-test"
    assert root["ResourceAttributes"]["deployment"] == "t"
    assert child["Events.Name"] == ["tick"] and child["Events.Attributes"] == [{"n": "2.5"}]
    assert child["Links.TraceId"] == ["0102030405060708090a0b0c0d0e0f10"]
    assert child["Links.SpanId"] == ["1112131415161718"]
    assert child["Links.Attributes"] == [{"link.n": "3"}]
    # The lookup table's part commits right after the traces part: poll it too.
    assert wait_rows(ch_client, traces_db, 1, table="otel_traces_trace_id_ts") == 1
    lookup = ch_client.query(f"SELECT TraceId FROM {traces_db}.otel_traces_trace_id_ts").result_rows
    assert [r[0] for r in lookup] == [root["TraceId"]]


def _json_request(trace_hex="5b8efff798038103d269b633813fc60c", span_hex="eee19b7ec3c1b174") -> dict:
    return {
        "resourceSpans": [
            {
                "resource": {"attributes": [{"key": "service.name", "value": {"stringValue": "json-svc"}}]},
                "scopeSpans": [
                    {
                        "scope": {"name": "s", "version": "1"},
                        "spans": [
                            {
                                "traceId": trace_hex,
                                "spanId": span_hex,
                                "parentSpanId": "",
                                "name": "json-span",
                                "kind": 2,
                                "startTimeUnixNano": "1700000000000000000",
                                "endTimeUnixNano": "1700000000000001500",
                                "attributes": [
                                    {"key": "i", "value": {"intValue": "7"}},
                                    {"key": "d", "value": {"doubleValue": 2.0}},
                                    {"key": "by", "value": {"bytesValue": base64.b64encode(b"\x01\x02").decode()}},
                                    {
                                        "key": "m",
                                        "value": {
                                            "kvlistValue": {
                                                "values": [
                                                    {"key": "b", "value": {"stringValue": "x"}},
                                                    {"key": "a", "value": {"intValue": "1"}},
                                                ]
                                            }
                                        },
                                    },
                                    {
                                        "key": "arr",
                                        "value": {
                                            "arrayValue": {
                                                "values": [
                                                    {"stringValue": "s"},
                                                    {"doubleValue": 0.5},
                                                    {"boolValue": False},
                                                ]
                                            }
                                        },
                                    },
                                ],
                                "status": {"code": 1},
                            }
                        ],
                    }
                ],
            }
        ]
    }


def test_otlp_json_with_gzip(collector, ch_client, traces_db):
    body = gzip.compress(json.dumps(_json_request()).encode())
    r = httpx.post(
        f"{collector.http_endpoint}/v1/traces",
        content=body,
        headers={"Content-Type": "application/json", "Content-Encoding": "gzip"},
    )
    assert r.status_code == 200 and r.json() == {}
    assert wait_rows(ch_client, traces_db, 1) == 1
    row = rows(ch_client, traces_db)[0]
    assert (row["TraceId"], row["SpanId"], row["SpanKind"], row["StatusCode"], row["Duration"]) == (
        "5b8efff798038103d269b633813fc60c",
        "eee19b7ec3c1b174",
        "Server",
        "Ok",
        1500,
    )
    assert row["ServiceName"] == "json-svc" and (row["ScopeName"], row["ScopeVersion"]) == ("s", "1")
    assert row["SpanAttributes"] == {"i": "7", "d": "2", "by": "AQI=", "m": '{"a":1,"b":"x"}', "arr": '["s",0.5,false]'}


# The first is the insert's first bytes, little endian: tab, space, CR, LF, whitespace the server
# must not skip after `FORMAT RowBinary`; 2**63 - 1 is the last DateTime64(9) instant.
EDGE_TIMES_NS = (0x0A0D2009, 999_999_999, 10**18 - 1, 1_700_000_000_123_456_789, 2**63 - 1)
ODD_TEXT = 'q"uote\\back\nline\ttab\x00nul\x1fctl é 漢 🙂 </script>'


def test_timestamps_and_text_survive_the_insert_exactly(collector, ch_client, traces_db):
    """The writer ships RowBinary: nanoseconds and every character (quotes, backslashes, control
    characters, non-BMP) must arrive unchanged, and a first row starting with whitespace whole."""
    request = ExportTraceServiceRequest()
    scope_spans = request.resource_spans.add().scope_spans.add()
    for i, start_ns in enumerate(EDGE_TIMES_NS):
        span = scope_spans.spans.add(
            trace_id=bytes([i + 1]) * 16,
            span_id=bytes([i + 1]) * 8,
            name=f"{ODD_TEXT}{i}",
            start_time_unix_nano=start_ns,
            end_time_unix_nano=start_ns + 7,
        )
        span.attributes.add(key=ODD_TEXT, value=AnyValue(string_value=ODD_TEXT))
        span.events.add(time_unix_nano=EDGE_TIMES_NS[-1 - i], name=ODD_TEXT)
    assert _post(collector, request.SerializeToString()).status_code == 200
    assert wait_rows(ch_client, traces_db, len(EDGE_TIMES_NS)) == len(EDGE_TIMES_NS)
    got = ch_client.query(
        f"SELECT toUnixTimestamp64Nano(Timestamp), Duration, SpanName, SpanAttributes, Events.Name, "
        f"arrayMap(t -> toUnixTimestamp64Nano(t), Events.Timestamp) FROM {traces_db}.otel_traces "
        f"ORDER BY SpanId"
    ).result_rows
    assert got == [
        (start_ns, 7, f"{ODD_TEXT}{i}", {ODD_TEXT: ODD_TEXT}, [ODD_TEXT], [EDGE_TIMES_NS[-1 - i]])
        for i, start_ns in enumerate(EDGE_TIMES_NS)
    ]


_HTTP = httpx.Client(timeout=10)


def _post(collector, body: bytes, content_type="application/x-protobuf", **headers) -> httpx.Response:
    return _HTTP.post(
        f"{collector.http_endpoint}/v1/traces", content=body, headers={"Content-Type": content_type, **headers}
    )


def test_bad_input_is_refused_with_a_message(collector):
    assert _post(collector, b"\x0a\xff\xff\xff\xff\x0f").status_code == 400
    assert _post(collector, b"{not json", "application/json").status_code == 400
    r = _post(collector, b"x", "text/plain")
    assert r.status_code == 415 and b"Content-Type" in r.content
    bad_id = json.dumps(_json_request(trace_hex="zz")).encode()
    r = _post(collector, bad_id, "application/json")
    assert r.status_code == 400 and "traceId" in r.json()["message"]
    zero = json.dumps(_json_request(trace_hex="0" * 32)).encode()
    assert _post(collector, zero, "application/json").status_code == 400
    assert _post(collector, b"x" * (2 << 20)).status_code == 413
    bomb = gzip.compress(b"\0" * (64 << 20))  # 64 MiB of zeros in ~64 KiB: refused, not inflated
    assert len(bomb) < (1 << 20)
    assert _post(collector, bomb, **{"Content-Encoding": "gzip"}).status_code == 413
    assert _post(collector, b"abc", **{"Content-Encoding": "br"}).status_code == 415
    assert _post(collector, b"not gzip", **{"Content-Encoding": "gzip"}).status_code == 400
    snapshot = collector.metrics.snapshot()
    assert snapshot["requests_rejected"] == 9 and snapshot["spans_received"] == 0
    assert httpx.get(f"{collector.http_endpoint}/health").status_code == 200


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(body=st.binary(max_size=300), as_json=st.booleans())
def test_fuzzed_bodies_never_break_the_collector(collector, body, as_json):
    r = _post(collector, body, "application/json" if as_json else "application/x-protobuf")
    assert r.status_code in (200, 400), r.content
    assert collector.metrics.snapshot()["spans_dropped"] == 0


def test_grpc_invalid_argument_and_metrics_endpoint(collector):
    with grpc.insecure_channel(collector.grpc_endpoint) as channel, pytest.raises(grpc.RpcError) as err:
        channel.unary_unary(EXPORT)(b"\x0a\x05\x12\x03\x12\x01\x0a", timeout=5)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    text = httpx.get(f"{collector.http_endpoint}/metrics").text
    assert "phaselens_collector_requests_rejected_total 1" in text
    assert "phaselens_collector_spans_dropped_total 0" in text
    assert "# TYPE phaselens_collector_spool_bytes gauge" in text


def test_auth_token_on_both_protocols(clickhouse, traces_db, tmp_path, ch_client):
    with Collector(
        clickhouse.url, database=traces_db, spool_dir=str(tmp_path / "s"), auth_token="s3cret", flush_interval_s=0.05
    ) as c:
        body = json.dumps(_json_request()).encode()
        assert _post(c, body, "application/json").status_code == 401
        assert _post(c, body, "application/json", Authorization="Bearer wrong").status_code == 401
        assert _post(c, body, "application/json", Authorization="Bearer s3cret").status_code == 200
        assert httpx.get(f"{c.http_endpoint}/metrics").status_code == 401
        assert httpx.get(f"{c.http_endpoint}/metrics", headers={"Authorization": "Bearer s3cret"}).status_code == 200
        assert httpx.get(f"{c.http_endpoint}/health").status_code == 200
        with grpc.insecure_channel(c.grpc_endpoint) as channel:
            with pytest.raises(grpc.RpcError) as err:
                channel.unary_unary(EXPORT)(b"", timeout=5)
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        spans = _emit(GrpcExporter(endpoint=c.grpc_endpoint, insecure=True, headers={"authorization": "Bearer s3cret"}))
        assert wait_rows(ch_client, traces_db, 1 + len(spans)) == 1 + len(spans)


def test_non_loopback_needs_a_token_or_insecure(clickhouse):
    with pytest.raises(InsecureBindError):
        Collector(clickhouse.url, host="0.0.0.0").start()


def test_spool_cap_answers_retryable(clickhouse, traces_db, tmp_path):
    with Collector(clickhouse.url, database=traces_db, spool_dir=str(tmp_path / "s"), max_spool_bytes=64) as c:
        r = _post(c, json.dumps(_json_request()).encode(), "application/json")
        assert r.status_code == 503 and r.headers["Retry-After"].isdigit()
        payload = httpx.Request("POST", "http://x", json=_json_request()).content
        with grpc.insecure_channel(c.grpc_endpoint) as channel, pytest.raises(grpc.RpcError) as err:
            channel.unary_unary(EXPORT)(parse_traces(payload).SerializeToString(), timeout=5)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        assert c.metrics.snapshot()["requests_retryable"] == 2
