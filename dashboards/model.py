"""Small builders for Grafana dashboard JSON: plain dicts, no Grafana SDK.

Every target points at the `${datasource}` variable (type `grafana-clickhouse-datasource`), so one
dashboard works with whichever ClickHouse data source a user picks. Panels are laid out on Grafana's
24-column grid by `layout`, so the definitions list panels and widths, never coordinates.
"""

from __future__ import annotations

PLUGIN_TYPE = "grafana-clickhouse-datasource"
DATASOURCE_VAR = "datasource"
DATASOURCE_REF = {"type": PLUGIN_TYPE, "uid": f"${{{DATASOURCE_VAR}}}"}
SCHEMA_VERSION = 41  # the dashboard JSON schema Grafana 12/13 writes
GRID_COLUMNS = 24

# The ClickHouse plugin's `format` values (sqlds): how the backend shapes the result frame.
FORMAT_TIME_SERIES = 0
FORMAT_TABLE = 1
FORMAT_TRACES = 3
_QUERY_TYPE = {FORMAT_TIME_SERIES: "timeseries", FORMAT_TABLE: "table", FORMAT_TRACES: "traces"}


def target(sql: str, fmt: int, ref_id: str = "A") -> dict:
    """A raw-SQL ClickHouse target; `queryType` only steers Explore's visualisation."""
    return {
        "refId": ref_id,
        "datasource": dict(DATASOURCE_REF),
        "editorType": "sql",
        "format": fmt,
        "queryType": _QUERY_TYPE[fmt],
        "rawSql": sql,
    }


def panel(
    kind: str,
    title: str,
    description: str,
    targets: list[dict],
    *,
    width: int = 12,
    height: int = 8,
    unit: str | None = None,
    options: dict | None = None,
    custom: dict | None = None,
    overrides: list[dict] | None = None,
    transformations: list[dict] | None = None,
) -> dict:
    """A panel without `id`/`gridPos` (assigned by `layout`); `description` is the question it answers."""
    defaults: dict = {"custom": custom or {}}
    if unit:
        defaults["unit"] = unit
    out = {
        "type": kind,
        "title": title,
        "description": description,
        "datasource": dict(DATASOURCE_REF),
        "targets": targets,
        "fieldConfig": {"defaults": defaults, "overrides": overrides or []},
        "options": options or {},
        "gridPos": {"w": width, "h": height},
    }
    if transformations:
        out["transformations"] = transformations
    return out


def keep_fields(names: list[str]) -> dict:
    """Transformation that shows only `names` of a query's columns (one query, several panels)."""
    return {"id": "filterFieldsByName", "options": {"include": {"names": list(names)}}}


def link_override(field: str, title: str, url: str) -> dict:
    """A data link on one column of a table: clicking a cell opens `url`."""
    return {
        "matcher": {"id": "byName", "options": field},
        "properties": [{"id": "links", "value": [{"title": title, "url": url}]}],
    }


def layout(panels: list[dict]) -> list[dict]:
    """Assign ids and flow panels left to right into rows of GRID_COLUMNS columns."""
    x = y = row_height = 0
    out = []
    for number, p in enumerate(panels, start=1):
        w, h = p["gridPos"]["w"], p["gridPos"]["h"]
        if x + w > GRID_COLUMNS:
            x, y, row_height = 0, y + row_height, 0
        out.append({**p, "id": number, "gridPos": {"h": h, "w": w, "x": x, "y": y}})
        x, row_height = x + w, max(row_height, h)
    return out


# --- template variables -------------------------------------------------------------------------


def _variable(name: str, label: str, kind: str, description: str, **fields) -> dict:
    return {"name": name, "label": label, "description": description, "type": kind, "hide": 0, "options": [], **fields}


def datasource_variable(default_uid: str, default_name: str) -> dict:
    """Any ClickHouse data source of this Grafana; the phaselens one is selected by default."""
    return _variable(
        DATASOURCE_VAR,
        "ClickHouse",
        "datasource",
        "the ClickHouse holding otel_traces",
        query=PLUGIN_TYPE,
        refresh=1,
        regex="",
        current={"selected": True, "text": default_name, "value": default_uid},
    )


def query_variable(name: str, label: str, sql: str, description: str) -> dict:
    """Multi-select with All; `$__conditionalAll` in panel SQL turns All (or nothing) into `1=1`."""
    return _variable(
        name,
        label,
        "query",
        description,
        datasource=dict(DATASOURCE_REF),
        definition=sql,
        query={"editorType": "sql", "rawSql": sql, "format": FORMAT_TABLE},
        includeAll=True,
        multi=True,
        regex="",
        sort=1,
        refresh=2,  # on time-range change: new models/services show up
        current={"selected": True, "text": ["All"], "value": ["$__all"]},
    )


def textbox_variable(name: str, label: str, default: str, description: str) -> dict:
    option = {"selected": True, "text": default, "value": default}
    return _variable(name, label, "textbox", description, query=default, current=option, options=[option])


def dashboard(
    uid: str,
    title: str,
    description: str,
    panels: list[dict],
    variables: list[dict],
    *,
    time_from: str = "now-1h",
    refresh: str = "30s",
    links: list[dict] | None = None,
) -> dict:
    return {
        "uid": uid,
        "title": title,
        "description": description,
        "tags": ["phaselens", "llm", "opentelemetry"],
        "timezone": "browser",
        "editable": True,
        "graphTooltip": 1,  # shared crosshair: a spike in one panel lines up with the others
        "schemaVersion": SCHEMA_VERSION,
        "version": 1,
        "refresh": refresh,
        "time": {"from": time_from, "to": "now"},
        "templating": {"list": variables},
        "annotations": {"list": []},
        "links": links or [],
        "panels": layout(panels),
    }


def dashboard_link(title: str, tag: str = "phaselens") -> dict:
    """A header drop-down of the other phaselens dashboards, keeping time range and variables."""
    return {
        "title": title,
        "type": "dashboards",
        "tags": [tag],
        "asDropdown": True,
        "includeVars": True,
        "keepTime": True,
    }
