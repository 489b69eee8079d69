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

KV_SCALE: int
SWEEP_EVERY_STEPS: int

class Batch:
    open: dict[str, Any]
    members: list[Any]
    finished_now: dict[str, Any]
    states: dict[str, Any] | None
    first_tokens: int
    scheduled_ts: int
    prev_end_ts: MonoTs
    steps_seen: int
    idle: bool
    def __init__(self, open: dict[str, Any], observer: Any, clock_ns: Callable[[], int], /) -> None: ...
    def before(
        self, outputs: Sequence[Any], end_s: float | None, iteration_stats: Any, states: dict[str, Any], /
    ) -> list[Any] | None: ...
    def after(self, seen: list[Any], now: int, /) -> bool: ...
    def step(self, scheduler_stats: Any, /) -> bool: ...

OUTPUTS_HOOK: int
STATS_HOOK: int

class BatchHook:
    __wrapped__: Callable[..., Any]
    def __init__(
        self,
        kind: int,
        original: Callable[..., Any],
        namespace: dict[str, Any],
        untraced: Callable[[], Any],
        on_error: Callable[[BaseException], Any],
        /,
    ) -> None: ...
    def __call__(self, *args: Any, **kwargs: Any) -> Any: ...
    def __get__(self, obj: Any, owner: type | None = None) -> Any: ...
