# Types of the C extension _token_gaps.c (see its header comment).

from typing_extensions import Buffer

def token_gaps(first_token_ts: int, token_ts: Buffer, token_n: Buffer) -> tuple[int, bytes]: ...
