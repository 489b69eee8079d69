# Types of the C extension _otlp_rows.c (see its header comment).

from collections.abc import Callable
from typing import overload

class InvalidSpans(ValueError): ...  # malformed protobuf, or a span the exporter could not store (bad ids)

@overload
def render(payload: bytes, any_value: Callable[[bytes], str]) -> tuple[bytes, int]: ...
@overload
def render(payload: bytes, any_value: Callable[[bytes], str], slots: int) -> tuple[list[bytes], int]: ...
