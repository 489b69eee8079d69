"""An OTLP/gRPC tee for tests: each trace export it receives is forwarded, byte for byte, to every
target collector, and acknowledged only when all of them acknowledged it (else it answers with the
first failure's code, and the exporter retries). So real SDK exporters feed two collectors exactly
the same requests: the packaged Rotel agent takes one traces exporter only, so it cannot fan out.
`retarget` points a running tee elsewhere, so one long-lived exporter (a server) can feed one run's
collectors, then another's."""

from __future__ import annotations

from concurrent import futures

import grpc

EXPORT_METHOD = "/opentelemetry.proto.collector.trace.v1.TraceService/Export"


class OtlpTee:
    def __init__(self, targets: list[str]):
        self._channels: list[grpc.Channel] = []
        self._calls: list[grpc.UnaryUnaryMultiCallable] = []
        self.retarget(targets)
        self.requests = 0
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=8, thread_name_prefix="otlp-tee"))
        handler = grpc.unary_unary_rpc_method_handler(self._export)
        service = grpc.method_handlers_generic_handler(
            "opentelemetry.proto.collector.trace.v1.TraceService", {"Export": handler}
        )
        self._server.add_generic_rpc_handlers((service,))
        self.port = self._server.add_insecure_port("127.0.0.1:0")
        self._server.start()

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.port}"

    def _export(self, payload: bytes, context: grpc.ServicerContext) -> bytes:
        reply = b""
        for call in self._calls:
            try:
                reply = call(payload, timeout=10)
            except grpc.RpcError as exc:
                context.abort(exc.code(), f"tee target refused: {exc.details()}")
        self.requests += 1
        return reply

    def retarget(self, targets: list[str]) -> None:
        """Forward the next exports to `targets`; the caller waits until the last ones landed."""
        old = self._channels
        self._channels = [grpc.insecure_channel(target) for target in targets]
        self._calls = [channel.unary_unary(EXPORT_METHOD) for channel in self._channels]
        for channel in old:
            channel.close()

    def close(self) -> None:
        self._server.stop(grace=2).wait()
        for channel in self._channels:
            channel.close()
