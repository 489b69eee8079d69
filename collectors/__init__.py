"""OTLP collector into ClickHouse (exporter-compatible schema) and an embedded ClickHouse server.

`collectors.Collector` is imported lazily so that `python -m collectors.embedded` (the ClickHouse
server process) does not load gRPC and protobuf.
"""


def __getattr__(name: str):
    if name == "Collector":
        from collectors.service import Collector

        return Collector
    raise AttributeError(name)
