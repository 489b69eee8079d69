"""OTLP AnyValue → the string the OTel Collector's ClickHouse exporter stores (pdata `Value.AsString`).

bool `true`/`false`; int decimal; double as Go's JSON encoder writes it (ES6 number → string: the
shortest round-trip digits, fixed notation, exponent form when |x| < 1e-6 or |x| ≥ 1e21, `e-7` not
`e-07`); bytes standard base64; arrays and maps compact JSON (Go `json.Marshal`: sorted map keys,
`<>&` escaped); empty → ``.
"""

from __future__ import annotations

import base64
import json
import math
from collections.abc import Iterable
from decimal import Decimal

from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue

_GO_HTML_ESCAPES = str.maketrans(
    {"<": "\\u003c", ">": "\\u003e", "&": "\\u0026", "\u2028": "\\u2028", "\u2029": "\\u2029"}
)


class _Unencodable(ValueError):
    """Go's json.Marshal fails on NaN/Inf; AsString then yields an empty string."""


def go_float(f: float) -> str:
    if math.isnan(f) or math.isinf(f):
        return "json: unsupported value: " + ("NaN" if math.isnan(f) else ("+Inf" if f > 0 else "-Inf"))
    text = repr(f)
    magnitude = abs(f)
    if magnitude != 0 and (magnitude < 1e-6 or magnitude >= 1e21):
        # repr() already uses exponent form here, as `1e-07` / `1e+21`, like Go; Go then trims e-0X.
        mantissa, exponent = text.split("e")
        if exponent[0] == "-" and exponent[1] == "0":
            exponent = "-" + exponent[2:]
        return f"{mantissa}e{exponent}"
    if "e" in text:  # repr() switches to exponent form earlier than Go (from 1e16 and below 1e-4)
        text = format(Decimal(text), "f")
    return text.removesuffix(".0")


def _json_str(s: str) -> str:
    return json.dumps(s, ensure_ascii=False).translate(_GO_HTML_ESCAPES)


def _json(value: AnyValue) -> str:
    kind = value.WhichOneof("value")
    if kind == "string_value":
        return _json_str(value.string_value)
    if kind == "bool_value":
        return "true" if value.bool_value else "false"
    if kind == "int_value":
        return str(value.int_value)
    if kind == "double_value":
        f = value.double_value
        if math.isnan(f) or math.isinf(f):
            raise _Unencodable
        return go_float(f)
    if kind == "bytes_value":
        return '"' + base64.b64encode(value.bytes_value).decode() + '"'
    if kind == "array_value":
        return "[" + ",".join(_json(v) for v in value.array_value.values) + "]"
    if kind == "kvlist_value":
        return _json_kvlist(value.kvlist_value.values)
    return "null"


def _json_kvlist(kvs: Iterable[KeyValue]) -> str:
    latest = {kv.key: kv.value for kv in kvs}  # a repeated key: the last one wins, as in a Go map
    return "{" + ",".join(f"{_json_str(k)}:{_json(latest[k])}" for k in sorted(latest)) + "}"


def as_string(value: AnyValue) -> str:
    kind = value.WhichOneof("value")
    if kind == "string_value":
        return value.string_value
    if kind == "int_value":
        return str(value.int_value)
    if kind == "double_value":
        return go_float(value.double_value)
    if kind == "bool_value":
        return "true" if value.bool_value else "false"
    if kind == "bytes_value":
        return base64.b64encode(value.bytes_value).decode()
    if kind is None:
        return ""
    try:
        return _json(value)
    except _Unencodable:
        return ""


def attributes(kvs: Iterable[KeyValue]) -> dict[str, str]:
    """Repeated KeyValue → {key: string}. Hot path: a non-empty string_value is the common case
    and, the value being a oneof, proves the type without a WhichOneof call."""
    out = {}
    for kv in kvs:
        v = kv.value
        out[kv.key] = v.string_value or as_string(v)
    return out
