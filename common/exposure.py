"""Who may reach a listener: loopback by default; any other address needs a way to authenticate its
clients, a bearer token or mutual TLS (a client certificate, common/tls.py), or an explicit opt-out.
Shared by every phaselens server (reference server, collector).

TLS without client certificates encrypts but lets anyone in, so on its own it does not open a
non-loopback address; a token without TLS is accepted (the existing contract) but travels in clear:
docs/collectors.md says to pair it with --tls-cert."""

from __future__ import annotations

import hmac
import ipaddress


class InsecureBindError(ValueError):
    """A non-loopback address was asked for without an auth token, without mutual TLS and without --insecure."""


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_exposure(host: str, auth_token: str | None, insecure: bool, mutual_tls: bool = False) -> None:
    """Raises InsecureBindError unless `host` is loopback, or clients must authenticate (a token or
    mutual TLS), or the caller opted out with `insecure`."""
    if not is_loopback(host) and not auth_token and not mutual_tls and not insecure:
        raise InsecureBindError(
            f"listening on {host} (not loopback) needs --auth-token or mutual TLS (--tls-client-ca), or --insecure"
        )


def authorized(authorization: str | None, auth_token: str | None) -> bool:
    """The `Authorization` header value carries `Bearer <auth_token>` (always true without a token).
    Compared in constant time, so the answer's timing does not leak how much of a guess was right."""
    if auth_token is None:
        return True
    return hmac.compare_digest((authorization or "").encode(), f"Bearer {auth_token}".encode())
