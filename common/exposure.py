"""Who may reach a listener: loopback by default; any other address needs a bearer token or an
explicit opt-out. Shared by every phaselens server (reference server, collector)."""

from __future__ import annotations

import hmac
import ipaddress


class InsecureBindError(ValueError):
    """A non-loopback address was asked for without an auth token and without --insecure."""


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_exposure(host: str, auth_token: str | None, insecure: bool) -> None:
    if not is_loopback(host) and not auth_token and not insecure:
        raise InsecureBindError(f"listening on {host} (not loopback) needs --auth-token (or --insecure)")


def authorized(authorization: str | None, auth_token: str | None) -> bool:
    """The `Authorization` header value carries `Bearer <auth_token>` (always true without a token).
    Compared in constant time, so the answer's timing does not leak how much of a guess was right."""
    if auth_token is None:
        return True
    return hmac.compare_digest((authorization or "").encode(), f"Bearer {auth_token}".encode())
