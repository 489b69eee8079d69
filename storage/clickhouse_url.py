"""One way to turn a `--clickhouse URL` into a clickhouse-connect client, for every command."""

from __future__ import annotations

from urllib.parse import unquote, urlsplit

import clickhouse_connect


def connect(url: str, database: str | None = None, **kwargs):
    """`http://[user[:password]@]host:port` → a clickhouse-connect HTTP client."""
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
        **kwargs,
    )
