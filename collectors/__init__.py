"""OTLP collector into ClickHouse (exporter-compatible schema) and an embedded ClickHouse server.

`phaselens.collectors.Collector` is imported lazily so that `python -m phaselens.collectors.embedded` (the ClickHouse
server process) does not load gRPC and protobuf.
"""


def __getattr__(name: str):
    if name == "Collector":
        from phaselens.collectors.service import Collector

        return Collector
    raise AttributeError(name)
