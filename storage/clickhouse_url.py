"""One way to turn a `--clickhouse URL` into a clickhouse-connect client, for every command."""

from __future__ import annotations

import functools
from typing import Any
from urllib.parse import unquote, urlsplit

import clickhouse_connect
from clickhouse_connect.driver.client import Client
from clickhouse_connect.driver.httputil import get_pool_manager


def connect(url: str, database: str | None = None, ca_cert: str | None = None, **kwargs: Any) -> Client:
    """`http[s]://[user[:password]@]host:port` → a clickhouse-connect HTTP client. An https:// server's
    certificate is verified against `ca_cert` (a PEM CA bundle), else the system's trust store
    (which honours SSL_CERT_FILE); there is no switch that turns verification off."""
    parts = urlsplit(url if "://" in url else f"http://{url}")
    if parts.scheme not in ("http", "https"):
        raise ValueError(f"ClickHouse URL must be http:// or https://, not {url!r}")
    return clickhouse_connect.get_client(
        host=parts.hostname or "127.0.0.1",
        port=parts.port or (8443 if parts.scheme == "https" else 8123),
        username=unquote(parts.username or "default"),
        password=unquote(parts.password or ""),
        secure=parts.scheme == "https",
        database=database or "",
        **({"pool_mgr": _pool_for(ca_cert)} if ca_cert else {}),
        **kwargs,
    )


@functools.cache
def _pool_for(ca_cert: str):
    """One connection pool per CA bundle, shared by the clients that use it, as clickhouse-connect
    shares its default pool: a client that owned its pool would close it on `close()`, which fails
    (AttributeError) where urllib3-future has replaced urllib3 (grafana-client pulls it in)."""
    return get_pool_manager(ca_cert=ca_cert)
