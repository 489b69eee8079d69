"""Private helpers of the TLS tests: a certificate authority made in the test (the `cryptography`
package), certificates it signs for loopback servers and clients, and a TLS-terminating TCP proxy.

Why a proxy: the embedded ClickHouse (chdb-core 26.9 runs clickhouse-local) opens HTTP and TCP
listeners only; `SYSTEM START LISTEN HTTPS` answers "SYSTEM START/STOP LISTEN in clickhouse-local
supports only TCP and HTTP listeners" and an `https_port` in its config.xml is never opened. So the
HTTPS hop to ClickHouse is tested through a real TLS endpoint (Python's ssl, OpenSSL) that forwards
the decrypted bytes to the real ClickHouse behind it, as a TLS-terminating load balancer would.
"""

from __future__ import annotations

import datetime
import ipaddress
import select
import socket
import ssl
import threading
from dataclasses import dataclass, field
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID


@dataclass(frozen=True, slots=True)
class Pair:
    cert: str  # PEM file paths
    key: str


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _write(directory: Path, stem: str, cert: x509.Certificate, key: ec.EllipticCurvePrivateKey) -> Pair:
    cert_path, key_path = directory / f"{stem}.pem", directory / f"{stem}.key"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    return Pair(str(cert_path), str(key_path))


@dataclass(slots=True)
class Authority:
    """A CA whose certificate is `ca.cert`; `issue` signs server or client certificates."""

    directory: Path
    name: str
    ca: Pair = field(init=False)
    _cert: x509.Certificate = field(init=False)
    _key: ec.EllipticCurvePrivateKey = field(init=False)

    def __post_init__(self) -> None:
        self._key = ec.generate_private_key(ec.SECP256R1())
        now = datetime.datetime.now(datetime.UTC)
        self._cert = (
            x509.CertificateBuilder()
            .subject_name(_name(self.name))
            .issuer_name(_name(self.name))
            .public_key(self._key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .add_extension(x509.KeyUsage(True, False, False, False, False, True, True, False, False), critical=True)
            .sign(self._key, hashes.SHA256())
        )
        self.ca = _write(self.directory, f"{self.name}-ca", self._cert, self._key)

    def issue(self, stem: str, server: bool = True) -> Pair:
        """A leaf certificate: for 127.0.0.1 and localhost (server), or for a client."""
        key = ec.generate_private_key(ec.SECP256R1())
        now = datetime.datetime.now(datetime.UTC)
        usage = ExtendedKeyUsageOID.SERVER_AUTH if server else ExtendedKeyUsageOID.CLIENT_AUTH
        builder = (
            x509.CertificateBuilder()
            .subject_name(_name(stem))
            .issuer_name(self._cert.subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
        )
        if server:
            names = [x509.IPAddress(ipaddress.ip_address("127.0.0.1")), x509.DNSName("localhost")]
            builder = builder.add_extension(x509.SubjectAlternativeName(names), critical=False)
        return _write(self.directory, stem, builder.sign(self._key, hashes.SHA256()), key)


class TlsProxy:
    """TLS on `port` (loopback), plaintext to `target_port`: one thread per connection."""

    def __init__(self, server: Pair, target_port: int):
        self._context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        self._context.load_cert_chain(server.cert, server.key)
        self._target_port = target_port
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._accept, daemon=True)
        self._thread.start()

    @property
    def url(self) -> str:
        return f"https://127.0.0.1:{self.port}"

    def _accept(self) -> None:
        self._listener.settimeout(0.1)
        while not self._stop.is_set():
            try:
                client, _ = self._listener.accept()
            except TimeoutError:
                continue
            threading.Thread(target=self._pipe, args=(client,), daemon=True).start()

    def _pipe(self, client: socket.socket) -> None:
        try:
            tls = self._context.wrap_socket(client, server_side=True)
        except (ssl.SSLError, OSError):
            client.close()
            return
        with tls, socket.create_connection(("127.0.0.1", self._target_port)) as upstream:
            peers = {tls: upstream, upstream: tls}
            while not self._stop.is_set():
                # SSL buffers decrypted bytes select() cannot see: read them before waiting
                ready = [tls] if tls.pending() else select.select(list(peers), [], [], 0.2)[0]
                for sock in ready:
                    try:
                        data = sock.recv(65536)
                    except (ssl.SSLError, OSError):
                        return
                    if not data:
                        return
                    peers[sock].sendall(data)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(2)
        self._listener.close()
