# Types of the C extension _wire_pack.c (see its header comment).

from typing import Any

def pack(records: list[Any], request_type: type, step_type: type, /) -> tuple[bytes, bytes, int, int]: ...
