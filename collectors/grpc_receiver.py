"""OTLP/gRPC `TraceService/Export`, `LogsService/Export`, `MetricsService/Export`. Registered as
raw-bytes handlers: the payload is decoded once (validation) and spooled as received, without a
re-serialization."""

from __future__ import annotations

from collections.abc import Sequence
from concurrent import futures

import grpc
from google.protobuf.duration_pb2 import Duration
from google.rpc.error_details_pb2 import RetryInfo

from phaselens.collectors.ingest import RETRY_AFTER_S, Ingest, Refused
from phaselens.common.ports import listener_owner, port_in_use_error
from phaselens.common.tls import ServerTls

_STATUS = {
    "invalid": grpc.StatusCode.INVALID_ARGUMENT,
    "too_large": grpc.StatusCode.INVALID_ARGUMENT,
    "unsupported": grpc.StatusCode.INVALID_ARGUMENT,
    "unauthenticated": grpc.StatusCode.UNAUTHENTICATED,
    "full": grpc.StatusCode.UNAVAILABLE,  # retryable for OTLP exporters
}
_RETRY_INFO_KEY = "google.rpc.retryinfo-bin"
_RETRY_INFO = RetryInfo(retry_delay=Duration(seconds=RETRY_AFTER_S)).SerializeToString()


class GrpcBindError(OSError):
    pass


def _export_handler(ingest: Ingest) -> grpc.RpcMethodHandler:
    def export(payload: bytes, context: grpc.ServicerContext) -> bytes:
        try:
            ingest.check_auth(dict(context.invocation_metadata()).get("authorization"))
            ingest.accept(payload)
        except Refused as exc:
            if exc.kind == "full":  # OTLP exporters wait this long before their retry
                context.set_trailing_metadata(((_RETRY_INFO_KEY, _RETRY_INFO),))
            context.abort(_STATUS[exc.kind], str(exc))
        return ingest.signal.response

    return grpc.unary_unary_rpc_method_handler(export, request_deserializer=None, response_serializer=None)


def _credentials(tls: ServerTls) -> grpc.ServerCredentials:
    cert, key, client_ca = tls.pem_bytes()
    return grpc.ssl_server_credentials([(key, cert)], root_certificates=client_ca, require_client_auth=tls.mutual)


def start_grpc(
    ingests: Sequence[Ingest], host: str, port: int, workers: int = 16, tls: ServerTls | None = None
) -> tuple[grpc.Server, int]:
    """Starts the server (over TLS with `tls`), one Export service per signal in `ingests`; returns
    it and the bound port. Raises GrpcBindError if the port is taken (naming its owner) or the
    address cannot be bound (gRPC's reason), and TlsConfigError for unusable certificate files."""
    credentials = _credentials(tls) if tls is not None else None
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=workers, thread_name_prefix="otlp-grpc"),
        options=[
            ("grpc.max_receive_message_length", max(i.max_body_bytes for i in ingests)),
            # gRPC sets SO_REUSEADDR on its listeners itself (a restart rebinds at once:
            # tests/test_restart.py); SO_REUSEPORT would let two live collectors share the port
            ("grpc.so_reuseport", 0),
        ],
    )
    server.add_generic_rpc_handlers(
        tuple(
            grpc.method_handlers_generic_handler(ingest.signal.grpc_service, {"Export": _export_handler(ingest)})
            for ingest in ingests
        )
    )
    reason = "the bind failed"
    try:
        address = f"{host}:{port}"
        bound = server.add_secure_port(address, credentials) if credentials else server.add_insecure_port(address)
    except RuntimeError as exc:  # some grpcio versions raise, for any cause, instead of returning 0
        bound, reason = 0, str(exc)
    if not bound:
        if port and listener_owner(port) is not None:
            raise GrpcBindError(str(port_in_use_error(host, port, "OTLP/gRPC")))
        raise GrpcBindError(f"cannot listen for OTLP/gRPC on {host}:{port}: {reason}")  # not a taken port
    server.start()
    return server, bound
