"""Push the data source and the dashboards to a running Grafana through its HTTP API (grafana-client).

Idempotent by comparing before writing: each object is read by uid first and written only when
it is missing or differs from what phaselens would write, so a second run makes no write at all
(no dashboard version bump, no data source update). "Differs" means a key phaselens sets has
another value; keys Grafana adds on its own (id, version, readOnly, …) are ignored.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from urllib.parse import urlparse

import niquests
from grafana_client import GrafanaApi
from grafana_client.client import GrafanaClientError, GrafanaException, GrafanaTimeoutError

PUSH_MESSAGE = "phaselens dashboards push"


class PushError(RuntimeError):
    """One line a user can act on: which Grafana, what went wrong, what to check."""


@dataclass(slots=True)
class PushResult:
    created: list[str] = field(default_factory=list)
    updated: list[str] = field(default_factory=list)
    unchanged: list[str] = field(default_factory=list)

    def summary(self) -> str:
        return f"created {len(self.created)}, updated {len(self.updated)}, unchanged {len(self.unchanged)}"


def connect(
    url: str, token: str | None = None, user: str | None = None, password: str | None = None, timeout_s: float = 10.0
) -> GrafanaApi:
    """A client for `url`; a token wins over user/password; neither → anonymous access."""
    parsed = urlparse(url)
    if parsed.scheme not in ("http", "https") or not parsed.hostname:
        raise PushError(f"not a Grafana URL: {url!r} (expected http(s)://host:port)")
    if (user is None) != (password is None):
        raise PushError("give both --user and --password, or a --token")
    credential = token or ((user, password) if user is not None else None)
    return GrafanaApi.from_url(url, credential=credential, timeout=timeout_s)


def contains(actual, wanted) -> bool:
    """True when every key/value of `wanted` is in `actual` (recursively for dicts; lists equal)."""
    if isinstance(wanted, dict):
        return isinstance(actual, dict) and all(k in actual and contains(actual[k], v) for k, v in wanted.items())
    if isinstance(wanted, list):
        return (
            isinstance(actual, list)
            and len(actual) == len(wanted)
            and all(contains(a, w) for a, w in zip(actual, wanted, strict=False))
        )
    return actual == wanted


def _get_or_none(getter, uid: str):
    try:
        return getter(uid)
    except GrafanaClientError as exc:
        if exc.status_code == 404:
            return None
        raise


def push_datasource(api: GrafanaApi, body: dict, result: PushResult) -> None:
    uid = body["uid"]
    existing = _get_or_none(api.datasource.get_datasource_by_uid, uid)
    label = f"datasource {uid}"
    if existing is None:
        api.datasource.create_datasource(body)
        result.created.append(label)
    elif not contains(existing, body):
        api.datasource.update_datasource_by_uid(uid, body)
        result.updated.append(label)
    else:
        result.unchanged.append(label)


def push_folder(api: GrafanaApi, uid: str, title: str, result: PushResult) -> None:
    if _get_or_none(api.folder.get_folder, uid) is None:
        api.folder.create_folder(title, uid=uid)
        result.created.append(f"folder {uid}")
    else:
        result.unchanged.append(f"folder {uid}")


def push_dashboard(api: GrafanaApi, board: dict, folder_uid: str, result: PushResult) -> None:
    """`version` is Grafana's to count: left out of the comparison and of the body (overwrite)."""
    uid = board["uid"]
    wanted = {k: v for k, v in board.items() if k not in ("id", "version")}
    existing = _get_or_none(api.dashboard.get_dashboard, uid)
    label = f"dashboard {uid}"
    if (
        existing is not None
        and contains(existing.get("dashboard"), wanted)
        and existing.get("meta", {}).get("folderUid") == folder_uid
    ):
        result.unchanged.append(label)
        return
    api.dashboard.update_dashboard(
        {"dashboard": {**wanted, "id": None}, "folderUid": folder_uid, "overwrite": True, "message": PUSH_MESSAGE}
    )
    (result.created if existing is None else result.updated).append(label)


def push(api: GrafanaApi, datasource: dict, boards: list[dict], folder_uid: str, folder_title: str) -> PushResult:
    """Check access, then make Grafana hold `datasource` and `boards` (in the folder), writing only changes."""
    url = api.url or "Grafana"
    result = PushResult()
    try:
        api.health.check()
        push_datasource(api, datasource, result)
        push_folder(api, folder_uid, folder_title, result)
        for board in boards:
            push_dashboard(api, board, folder_uid, result)
    except (GrafanaException, niquests.exceptions.RequestException) as exc:
        raise PushError(describe(exc, url)) from exc
    return result


def describe(exc: Exception, url: str) -> str:
    """One line for a failed call: unreachable, 401, 403 or whatever Grafana said."""
    if isinstance(exc, niquests.exceptions.ConnectionError):
        return f"cannot connect to Grafana at {url}: {_connect_reason(exc)} (is it running? check --grafana)"
    if isinstance(exc, (GrafanaTimeoutError, niquests.exceptions.Timeout)):
        return f"Grafana at {url} did not answer in time: {_first_line(exc)}"
    status = getattr(exc, "status_code", None)
    if status == 401:
        return f"Grafana at {url} rejected the credentials (401 Unauthorized): check --token or --user/--password"
    if status == 403:
        return (
            f"Grafana at {url} refused the request (403 Forbidden): the token or user needs the "
            f"Admin role to write data sources and Editor to write dashboards ({_first_line(exc)})"
        )
    return f"Grafana at {url} answered an error: {_first_line(exc)}"


def _connect_reason(exc: Exception) -> str:
    """The socket-level cause, without urllib3's wrapping (`[Errno 111] Connection refused`)."""
    text = str(exc)
    if unresolved := re.search(r"Failed to resolve '([^']+)'", text):
        return f"unknown host {unresolved[1]}"
    errno = re.search(r"\[Errno -?\d+\] [^'\")]+", text)
    return errno[0] if errno else _first_line(exc)


def _first_line(exc: Exception) -> str:
    text = str(getattr(exc, "message", None) or exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
