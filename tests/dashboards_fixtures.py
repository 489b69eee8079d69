"""A RECORDING HTTP STAND-IN for Grafana (no Grafana server can run on these machines).

A loopback HTTP server implementing only the API calls `phaselens dashboards push` makes through
grafana-client, with Grafana's paths, status codes and response shapes: frontend settings (the
client's health check), data source get/create/update by uid, folder get/create, dashboard get by
uid and POST /api/dashboards/db (which bumps `version`, as Grafana does). Every request is recorded
as (method, path, JSON body) so tests can assert the exact calls.
"""

from __future__ import annotations

import base64
import copy
import json
import re
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Self

ADMIN_TOKEN = "admin-token"
VIEWER_TOKEN = "viewer-token"  # may read, every write is 403, as a Viewer service account
BASIC_USER = ("admin", "secret")


@dataclass
class GrafanaState:
    datasources: dict = field(default_factory=dict)
    folders: dict = field(default_factory=dict)
    dashboards: dict = field(default_factory=dict)  # uid → {"dashboard": …, "meta": …}
    calls: list = field(default_factory=list)
    next_id: int = 1

    def writes(self) -> list:
        return [c for c in self.calls if c[0] != "GET"]


def _role(headers) -> str | None:
    auth = headers.get("Authorization", "")
    if auth == f"Bearer {ADMIN_TOKEN}":
        return "admin"
    if auth == f"Bearer {VIEWER_TOKEN}":
        return "viewer"
    if auth.startswith("Basic "):
        user, _, password = base64.b64decode(auth[6:]).decode().partition(":")
        return "admin" if (user, password) == BASIC_USER else None
    return None


class _Handler(BaseHTTPRequestHandler):
    state: GrafanaState

    def log_message(self, *args) -> None:
        pass

    def _reply(self, status: int, body) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _handle(self, method: str) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        body = json.loads(self.rfile.read(length)) if length else None
        self.state.calls.append((method, self.path, body))
        role = _role(self.headers)
        if role is None:
            return self._reply(401, {"message": "Invalid API key"})
        if method != "GET" and role != "admin":
            return self._reply(403, {"message": "You'll need additional permissions to perform this action."})
        status, payload = _route(self.state, method, self.path, body)
        self._reply(status, payload)

    def do_GET(self) -> None:
        self._handle("GET")

    def do_POST(self) -> None:
        self._handle("POST")

    def do_PUT(self) -> None:
        self._handle("PUT")


def _route(s: GrafanaState, method: str, path: str, body):
    parts = path.split("?")[0].strip("/").split("/")
    match (method, parts):
        case ("GET", ["api", "frontend", "settings"]):
            return 200, {"buildInfo": {"version": "13.2.2", "edition": "Open Source"}}
        case ("GET", ["api", "datasources", "uid", uid]):
            return (200, s.datasources[uid]) if uid in s.datasources else (404, {"message": "Data source not found"})
        case ("POST", ["api", "datasources"]):
            stored = {**copy.deepcopy(body), "id": s.next_id, "orgId": 1, "readOnly": False, "version": 1}
            s.next_id += 1
            s.datasources[body["uid"]] = stored
            return 200, {"datasource": stored, "id": stored["id"], "message": "Datasource added"}
        case ("PUT", ["api", "datasources", "uid", uid]) if uid in s.datasources:
            old = s.datasources[uid]
            s.datasources[uid] = {
                **copy.deepcopy(body),
                "id": old["id"],
                "orgId": 1,
                "readOnly": False,
                "version": old["version"] + 1,
            }
            return 200, {"datasource": s.datasources[uid], "message": "Datasource updated"}
        case ("GET", ["api", "folders", uid]):
            return (200, s.folders[uid]) if uid in s.folders else (404, {"message": "folder not found"})
        case ("POST", ["api", "folders"]):
            s.folders[body["uid"]] = {"uid": body["uid"], "title": body["title"], "id": s.next_id}
            s.next_id += 1
            return 200, s.folders[body["uid"]]
        case ("GET", ["api", "dashboards", "uid", uid]):
            return (200, s.dashboards[uid]) if uid in s.dashboards else (404, {"message": "Dashboard not found"})
        case ("POST", ["api", "dashboards", "db"]):
            return _save_dashboard(s, body)
    return 404, {"message": "Not found"}


def _save_dashboard(s: GrafanaState, body: dict):
    board = copy.deepcopy(body["dashboard"])
    old = s.dashboards.get(board["uid"])
    if old is not None and not body.get("overwrite"):
        return 412, {"message": "A dashboard with the same uid already exists", "status": "name-exists"}
    if body.get("folderUid") and body["folderUid"] not in s.folders:
        return 400, {"message": "folder not found"}
    board["id"] = old["dashboard"]["id"] if old else s.next_id
    board["version"] = old["dashboard"]["version"] + 1 if old else 1
    s.next_id += 1
    s.dashboards[board["uid"]] = {"dashboard": board, "meta": {"folderUid": body.get("folderUid", "")}}
    return 200, {"id": board["id"], "uid": board["uid"], "status": "success", "version": board["version"]}


class GrafanaStandIn:
    """`with GrafanaStandIn() as g:` → `g.url`, `g.state` (stored objects and recorded calls)."""

    def __init__(self) -> None:
        self.state = GrafanaState()
        handler = type("Handler", (_Handler,), {"state": self.state})
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    def __enter__(self) -> Self:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)


# --- a STAND-IN for Grafana's macro engine ----------------------------------------------------
# Expands panel SQL the way the ClickHouse plugin does before ClickHouse sees it: first the
# frontend (`$__conditionalAll`, then template variables with the plugin's formatter: a list becomes
# 'a','b', a single value stays raw), then the backend macros (pkg/macros/macros.go: second
# precision `toDateTime(<unix>)` bounds, `toStartOfInterval(toDateTime(col), INTERVAL n second)`).


@dataclass
class GrafanaQueryContext:
    from_unix_s: int
    to_unix_s: int
    interval_s: int
    variables: dict  # name → str, or list of str; ALL → every value in `options`
    options: dict = field(default_factory=dict)  # name → all values (what "All" expands to)


ALL = "$__all"


def _macro_args(sql: str, open_paren: int) -> tuple[list[str], int]:
    """Top-level comma-separated arguments of the call whose '(' is at `open_paren`; end index."""
    depth, args, start, quote = 0, [], open_paren + 1, None
    for i in range(open_paren, len(sql)):
        ch = sql[i]
        if quote:
            quote = None if ch == quote and sql[i - 1] != "\\" else quote
        elif ch in "'\"`":
            quote = ch
        elif ch == "(":
            depth += 1
        elif ch == ")":
            depth -= 1
            if depth == 0:
                args.append(sql[start:i])
                return [a.strip() for a in args], i + 1
        elif ch == "," and depth == 1:
            args.append(sql[start:i])
            start = i + 1
    raise ValueError(f"unbalanced macro call at {open_paren}: {sql[open_paren : open_paren + 60]!r}")


def _replace_calls(sql: str, name: str, render) -> str:
    token = f"$__{name}("
    while (at := sql.find(token)) != -1:
        args, end = _macro_args(sql, at + len(token) - 1)
        sql = sql[:at] + render(args) + sql[end:]
    return sql


def _is_all(ctx: GrafanaQueryContext, name: str) -> bool:
    value = ctx.variables.get(name)
    return value in ("", ALL, [ALL], [], None)


def _conditional_all(ctx: GrafanaQueryContext, args: list[str]) -> str:
    m = re.search(r"\$\{?(\w+)", args[1])
    return "1=1" if m and _is_all(ctx, m[1]) else args[0]


def _format(ctx: GrafanaQueryContext, name: str, fmt: str | None) -> str:
    value = ctx.options[name] if _is_all(ctx, name) and name in ctx.options else ctx.variables[name]
    values = value if isinstance(value, list) else [value]
    if fmt == "singlequote":
        return ",".join("'" + v.replace("'", "\\'") + "'" for v in values)
    if fmt == "sqlstring":
        return ",".join("'" + v.replace("'", "''") + "'" for v in values)
    if fmt in (None, "raw"):
        return "'" + "','".join(values) + "'" if isinstance(value, list) and fmt is None else ",".join(values)
    raise ValueError(f"variable format {fmt!r} not supported by the stand-in")


def expand_grafana_sql(sql: str, ctx: GrafanaQueryContext) -> str:
    sql = _replace_calls(sql, "conditionalAll", lambda a: _conditional_all(ctx, a))
    frm, to = f"toDateTime({ctx.from_unix_s})", f"toDateTime({ctx.to_unix_s})"
    sql = (
        sql.replace("$__interval_s", str(ctx.interval_s))
        .replace("$__interval_ms", str(ctx.interval_s * 1000))
        .replace("$__interval", f"{ctx.interval_s}s")
    )
    sql = re.sub(r"\$\{(\w+)(?::(\w+))?\}", lambda m: _format(ctx, m[1], m[2]), sql)
    sql = re.sub(r"\$(?!__)(\w+)", lambda m: _format(ctx, m[1], None), sql)
    sql = _replace_calls(sql, "timeFilter", lambda a: f"{a[0]} >= {frm} AND {a[0]} <= {to}")
    sql = _replace_calls(
        sql,
        "timeInterval",
        lambda a: f"toStartOfInterval(toDateTime({a[0]}), INTERVAL {max(ctx.interval_s, 1)} second)",
    )
    sql = (
        sql.replace("$__fromTime_ms", f"fromUnixTimestamp64Milli({ctx.from_unix_s * 1000})")
        .replace("$__toTime_ms", f"fromUnixTimestamp64Milli({ctx.to_unix_s * 1000})")
        .replace("$__fromTime", frm)
        .replace("$__toTime", to)
    )
    if "$" in sql:
        raise ValueError(f"unexpanded macro or variable left in: {sql}")
    return sql
