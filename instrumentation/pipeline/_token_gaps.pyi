# Types of the C extension _token_gaps.c (see its header comment).

from typing import Any, TypeVar, overload

from typing_extensions import Buffer

_T = TypeVar("_T")

def token_gaps(first_token_ts: int, token_ts: Buffer, token_n: Buffer) -> tuple[int, bytes]: ...
def itl_ms(gaps: Buffer, /) -> tuple[float, float, float, float]: ...
@overload
def phase_terms(timeline: object, /) -> tuple[Any, ...]: ...
@overload
def phase_terms(timeline: object, into: type[_T], /) -> _T: ...
