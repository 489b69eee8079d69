# Types of the C extension _outputs.c (see its header comment).

from collections.abc import Awaitable, Callable, Generator, Sequence
from contextvars import ContextVar
from typing import Any

from phaselens.common.clocks import MonoTs

class Taking:
    def __init__(self, awaitable: Awaitable[Any], handle: Any, on_error: Callable[[BaseException], Any], /) -> None: ...
    def __await__(self) -> Generator[Any, Any, Any]: ...
    def send(self, value: Any, /) -> Any: ...
    def throw(self, *args: Any) -> Any: ...
    def close(self) -> None: ...

def output_taken(handle: Any, output: Any, /) -> None: ...

class CollectorHook:
    __wrapped__: Callable[..., Any]
    def __init__(
        self,
        original: Callable[..., Any],
        current: ContextVar[Any],
        on_error: Callable[[BaseException], Any],
        awaits: bool,
        /,
    ) -> None: ...
    def __call__(self, *args: Any, **kwargs: Any) -> Any: ...
    def __get__(self, obj: Any, owner: type | None = None) -> Any: ...

def open_outputs(outputs: Sequence[Any], open: dict[str, Any], /) -> list[Any] | None: ...
def stamp_tokens(seen: list[Any], now: int, members: list[Any], /) -> bool: ...

KV_SCALE: int

def engine_step(
    observer: Any,
    members: list[Any],
    scheduler_stats: Any,
    iteration_stats: Any,
    end_s: float | None,
    start_floor_ts: int,
    first_tokens: int,
    clock_ns: Callable[[], int],
    /,
) -> MonoTs: ...
