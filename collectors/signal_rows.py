"""What the logs and metrics renderers share: parsing with a clear error, ids as the exporter
writes them, the resource and scope columns."""

from __future__ import annotations

from collections.abc import Iterable
from typing import TypeVar

from google.protobuf.message import Message
from opentelemetry.proto.common.v1.common_pb2 import KeyValue

from phaselens.collectors import rowbinary
from phaselens.collectors.attr_string import attributes

MAX_ROWS_BYTES = 256 << 20  # as for spans: one request's rows must fit one insert block comfortably
M = TypeVar("M", bound=Message)


class InvalidPayload(ValueError):
    """An export request that is not valid OTLP: refused (400 / INVALID_ARGUMENT), never stored."""


def parse(message_type: type[M], payload: bytes) -> M:
    try:
        message: M = message_type.FromString(payload)
    except Exception as exc:  # noqa: BLE001 — upb DecodeError (bad wire data, bad UTF-8) and friends
        raise InvalidPayload(f"malformed {message_type.__name__}: {exc}") from None
    return message


def hex_id(raw: bytes, size: int, what: str) -> str:
    """Lowercase hex; `''` for an absent or all-zero id (pdata's String() of an empty id)."""
    if len(raw) != size:
        if raw:
            raise InvalidPayload(f"{what} must be {size} bytes, got {len(raw)}")
        return ""
    return "" if not any(raw) else raw.hex()


def string_attributes(kvs: Iterable[KeyValue]) -> dict[str, str]:
    """attr_string.attributes, its failures on absurd values (nesting depth) as InvalidPayload."""
    try:
        return attributes(kvs)
    except (RecursionError, ValueError) as exc:
        raise InvalidPayload(f"malformed attribute value: {exc}") from None


def service_name(resource_attributes: dict[str, str]) -> str:
    return resource_attributes.get("service.name", "")


def check_size(rows: bytearray) -> None:
    if len(rows) > MAX_ROWS_BYTES:
        raise InvalidPayload(
            f"its rows would exceed {MAX_ROWS_BYTES >> 20} MiB (resource or scope attributes repeated over "
            "many records?): send fewer records per request"
        )


def encode_map(m: dict[str, str]) -> bytes:
    out = bytearray()
    rowbinary.string_map(out, m)
    return bytes(out)
