# Types of the C extension _wire_pack.c (see its header comment).

from collections.abc import Callable
from typing import Any

def pack(records: list[Any], request_type: type, step_type: type, /) -> tuple[bytes, bytes, int, int]: ...
def decode_request(fields: tuple[Any, ...], types: tuple[type, ...], /) -> Any: ...
def split_runs(
    data: bytes, step_type: type, decode_step: Callable[[tuple[Any, ...]], Any], /
) -> tuple[list[tuple[int, Any]], int]: ...
