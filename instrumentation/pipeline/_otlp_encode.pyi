# Types of the C extension _otlp_encode.c (see its header comment).

from collections.abc import Callable, Sequence
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
def encode_steps(
    steps: Sequence[tuple[Any, ...]],
    random_bits: Callable[[int], int] | None,
    new_ids: Callable[[], tuple[int, int]],
    offset_ns: int,
    name: str,
    keys: tuple[str, ...],
    limits: tuple[int, ...],
) -> list[bytes]: ...
def encode_phases(
    new_span_id: Callable[[], int],
    random_bits: Callable[[int], int] | None,
    root: tuple[int, int, int, str],
    offset_ns: int,
    stamps: tuple[int, ...],
    waits: Sequence[tuple[int, int]],
    chunks: Sequence[int],
    decode: tuple[dict[str, Any], Sequence[tuple[str, int, dict[str, Any]]]] | None,
    names: tuple[str, ...],
    keys: tuple[str, ...],
    limits: tuple[int, ...],
) -> list[bytes]: ...
def encode_root(
    record: tuple[Any, ...],
    phases: Any,
    offset_ns: int,
    texts: tuple[str | None, ...],
    summary: dict[str, Any] | None,
    keys: tuple[str, ...],
    constants: tuple[str, ...],
    limits: tuple[int, ...],
    /,
) -> bytes: ...
def encode_request(
    resource_attributes: dict[str, Any], scope_name: str, scope_version: str, spans: Sequence[bytes]
) -> bytes: ...
def present(keys: tuple[str, ...], values: tuple[Any, ...], into: dict[str, Any] = ..., /) -> dict[str, Any]: ...
