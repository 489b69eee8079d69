"""OTLP collector into ClickHouse (exporter-compatible schema).

`phaselens.collectors.Collector` is imported lazily so that the commands that only need the schema
or the row rendering (`phaselens schema`, `phaselens demo`) do not load gRPC.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from phaselens.collectors.service import Collector


def __getattr__(name: str) -> type[Collector]:
    if name == "Collector":
        from phaselens.collectors.service import Collector

        return Collector
    raise AttributeError(name)
