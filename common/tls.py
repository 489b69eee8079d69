"""TLS for phaselens listeners and clients: one description of a server's certificate files, turned
into what each server library takes (an `ssl.SSLContext` for HTTP servers, gRPC credentials for
gRPC), and a client context that trusts one CA bundle.

Mutual TLS: with `client_ca`, a client must present a certificate signed by that CA; the handshake
refuses any other client, so a listener with mutual TLS authenticates its clients the way a bearer
token does (common/exposure.py counts it as such).
"""

from __future__ import annotations

import ssl
from dataclasses import dataclass
from pathlib import Path


class TlsConfigError(ValueError):
    """A certificate, key or CA file is missing or unreadable, or the key does not match."""


@dataclass(frozen=True, slots=True)
class ServerTls:
    """PEM files: the server's certificate chain and key, and optionally the CA of client certificates."""

    cert_file: str
    key_file: str
    client_ca_file: str | None = None

    @property
    def mutual(self) -> bool:
        return self.client_ca_file is not None

    def ssl_context(self) -> ssl.SSLContext:
        """For HTTP servers (TLS 1.2 at least). Raises TlsConfigError naming the file at fault."""
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.minimum_version = ssl.TLSVersion.TLSv1_2
        try:
            context.load_cert_chain(self.cert_file, self.key_file)
        except (OSError, ssl.SSLError) as exc:
            raise TlsConfigError(
                f"cannot load --tls-cert {self.cert_file} / --tls-key {self.key_file}: {exc}"
            ) from None
        if self.client_ca_file is not None:
            context.verify_mode = ssl.CERT_REQUIRED
            try:
                context.load_verify_locations(cafile=self.client_ca_file)
            except (OSError, ssl.SSLError) as exc:
                raise TlsConfigError(f"cannot load --tls-client-ca {self.client_ca_file}: {exc}") from None
        return context

    def pem_bytes(self) -> tuple[bytes, bytes, bytes | None]:
        """(certificate chain, key, client CA or None), checked by loading them as `ssl_context` does,
        for libraries that take PEM bytes (gRPC)."""
        self.ssl_context()
        ca = Path(self.client_ca_file).read_bytes() if self.client_ca_file else None
        return Path(self.cert_file).read_bytes(), Path(self.key_file).read_bytes(), ca


def server_tls(cert_file: str | None, key_file: str | None, client_ca_file: str | None = None) -> ServerTls | None:
    """The `--tls-cert/--tls-key/--tls-client-ca` flags → ServerTls, or None for plaintext.
    Raises TlsConfigError when only one of cert and key is given, or a client CA without them."""
    if cert_file is None and key_file is None:
        if client_ca_file is not None:
            raise TlsConfigError("--tls-client-ca needs --tls-cert and --tls-key")
        return None
    if cert_file is None or key_file is None:
        raise TlsConfigError("--tls-cert and --tls-key go together")
    return ServerTls(cert_file, key_file, client_ca_file)


def client_context(ca_file: str | None) -> ssl.SSLContext:
    """A client context verifying the server against `ca_file` (None: the system's trust store)."""
    try:
        return ssl.create_default_context(cafile=ca_file)
    except (OSError, ssl.SSLError) as exc:
        raise TlsConfigError(f"cannot load CA bundle {ca_file}: {exc}") from None
