"""Who may reach a listener: loopback by default; any other address needs a bearer token or an
explicit opt-out. Shared by every phaselens server (reference server, collector)."""

from __future__ import annotations

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
