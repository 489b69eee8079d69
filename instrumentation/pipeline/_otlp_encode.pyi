# Types of the C extension _otlp_encode.c (see its header comment).

from collections.abc import Sequence
from typing import Any

def encode_spans(spans: Sequence[tuple[Any, ...]], limits: tuple[int, ...]) -> list[bytes]: ...
def encode_step(
    step: tuple[Any, ...],
    trace_id: int,
    span_id: int,
    start_ns: int,
    end_ns: int,
    name: str,
    keys: tuple[str, ...],
    limits: tuple[int, ...],
) -> bytes: ...
def encode_request(
    resource_attributes: dict[str, Any], scope_name: str, scope_version: str, spans: Sequence[bytes]
) -> bytes: ...
