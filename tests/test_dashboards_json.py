"""The generated dashboards: well-formed, every target on `${datasource}`, SQL only from
phaselens.analysis.queries, variables present, links and field selections valid, checked-in = generated."""

from __future__ import annotations

import json
import re

import pytest
import yaml

from phaselens.analysis import queries as queries
from phaselens.analysis.schema.schema import TRACE_TIMES_VIEW
from phaselens.cli import main
from phaselens.dashboards import generate
from phaselens.dashboards.datasource import DATASOURCE_UID
from phaselens.dashboards.definitions import UID_BUDGET, UID_ENGINE, UID_TRACE
from phaselens.dashboards.model import DATASOURCE_REF, GRID_COLUMNS, PLUGIN_TYPE

CHECKED_IN = generate.PACKAGE_DIR


@pytest.fixture(scope="module")
def boards() -> dict[str, dict]:
    """The checked-in JSON, as Grafana's provisioning reads it."""
    out = {}
    for path in sorted((CHECKED_IN / generate.GENERATED_DIR).glob("*.json")):
        board = json.loads(path.read_text())
        assert path.stem == board["uid"]
        out[board["uid"]] = board
    return out


def _panels(boards):
    return [(uid, p) for uid, b in boards.items() for p in b["panels"]]


def test_checked_in_files_equal_a_fresh_generation():
    assert generate.stale_files(CHECKED_IN) == [], "run `phaselens dashboards generate`"
    assert main(["dashboards", "check"]) == 0


def test_check_finds_drift_and_generate_repairs_it(tmp_path, capsys):
    assert main(["dashboards", "generate", "--out", str(tmp_path)]) == 0
    assert main(["dashboards", "check", "--out", str(tmp_path)]) == 0
    edited = tmp_path / generate.GENERATED_DIR / f"{UID_ENGINE}.json"
    edited.write_text(edited.read_text().replace("Queue depth", "Queue length"))
    (tmp_path / generate.GENERATED_DIR / "old-uid.json").write_text("{}")
    assert main(["dashboards", "check", "--out", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert f"{UID_ENGINE}.json" in err and "old-uid.json" in err
    main(["dashboards", "generate", "--out", str(tmp_path)])
    assert generate.stale_files(tmp_path) == []
    assert not (tmp_path / generate.GENERATED_DIR / "old-uid.json").exists()


def test_three_dashboards_with_unique_uids_and_titles(boards):
    assert set(boards) == {UID_BUDGET, UID_ENGINE, UID_TRACE}
    assert len({b["title"] for b in boards.values()}) == 3
    for b in boards.values():
        assert b["schemaVersion"] >= 39 and b["description"] and "phaselens" in b["tags"]


def test_panels_laid_out_on_the_grid_without_overlap(boards):
    for uid, board in boards.items():
        cells = set()
        ids = [p["id"] for p in board["panels"]]
        assert len(ids) == len(set(ids)), uid
        for p in board["panels"]:
            g = p["gridPos"]
            assert g["x"] >= 0 and g["x"] + g["w"] <= GRID_COLUMNS, (uid, p["title"])
            area = {(x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])}
            assert not area & cells, f"{uid}: {p['title']} overlaps another panel"
            cells |= area


def test_every_panel_describes_its_question(boards):
    for uid, p in _panels(boards):
        assert "?" in p["description"] and len(p["description"]) > 40, (uid, p["title"])


def test_every_target_uses_the_datasource_variable_and_raw_sql(boards):
    for uid, p in _panels(boards):
        assert p["datasource"] == DATASOURCE_REF == {"type": PLUGIN_TYPE, "uid": "${datasource}"}
        assert p["targets"], (uid, p["title"])
        for t in p["targets"]:
            assert t["datasource"] == DATASOURCE_REF
            assert t["editorType"] == "sql" and t["format"] in (0, 1, 3)


def test_panel_sql_comes_only_from_analysis_queries(boards):
    rendered = {queries.render_grafana(name): name for name in queries.PANEL_COLUMNS}
    used = {rendered.get(t["rawSql"]) for _, p in _panels(boards) for t in p["targets"]}
    assert None not in used, "a panel carries SQL that is not an analysis query"
    assert used == set(queries.PANEL_COLUMNS), "every panel query is shown somewhere"


def test_field_selections_and_overrides_name_real_columns(boards):
    rendered = {queries.render_grafana(name): name for name in queries.PANEL_COLUMNS}
    for uid, p in _panels(boards):
        cols = set(queries.PANEL_COLUMNS[rendered[p["targets"][0]["rawSql"]]])
        for tr in p.get("transformations", []):
            kept = set(tr["options"]["include"]["names"])
            assert "time" in kept and len(kept) > 1 and kept <= cols, (uid, p["title"])
        for o in p["fieldConfig"]["overrides"]:
            m = o["matcher"]
            if m["id"] == "byName":
                assert m["options"] in cols, (uid, p["title"], m)
            else:
                assert any(re.search(m["options"], c) for c in cols), (uid, p["title"], m)


def test_variables(boards):
    def variables(uid):
        return {v["name"]: v for v in boards[uid]["templating"]["list"]}

    for uid in boards:
        ds = variables(uid)["datasource"]
        assert ds["type"] == "datasource" and ds["query"] == PLUGIN_TYPE
        assert ds["current"]["value"] == DATASOURCE_UID
    budget = variables(UID_BUDGET)
    assert {"service", "model", "ttft_slo_ms", "tpot_slo_ms"} <= set(budget)
    for name in ("service", "model"):
        v = budget[name]
        assert v["type"] == "query" and v["includeAll"] and v["multi"] and v["datasource"] == DATASOURCE_REF
    assert budget["ttft_slo_ms"]["type"] == "textbox" and float(budget["ttft_slo_ms"]["query"]) > 0
    assert budget["tpot_slo_ms"]["type"] == "textbox" and float(budget["tpot_slo_ms"]["query"]) > 0
    assert variables(UID_ENGINE)["service"]["type"] == "query"
    assert variables(UID_TRACE)["trace_id"]["type"] == "textbox"
    # every ${var} a panel's SQL names is a variable of its dashboard
    for uid, p in _panels(boards):
        for t in p["targets"]:
            names = set(re.findall(r"\$\{?(\w+)", t["rawSql"])) - {
                "__timeFilter",
                "__timeInterval",
                "__conditionalAll",
                "__interval_s",
                "__fromTime",
                "__toTime",
            }
            assert names <= set(variables(uid)), (uid, p["title"], names)


def test_slowest_requests_link_to_the_trace_dashboard(boards):
    table = next(p for p in boards[UID_BUDGET]["panels"] if p["title"] == "Slowest requests")
    links = [
        link
        for o in table["fieldConfig"]["overrides"]
        if o["matcher"]["options"] == "trace_id"
        for prop in o["properties"]
        if prop["id"] == "links"
        for link in prop["value"]
    ]
    assert len(links) == 1
    assert links[0]["url"].startswith(f"/d/{UID_TRACE}/")
    assert "var-trace_id=${__value.raw}" in links[0]["url"] and "${__url_time_range}" in links[0]["url"]


def test_trace_dashboard_is_a_traces_panel_in_format_3(boards):
    (panel,) = boards[UID_TRACE]["panels"]
    assert panel["type"] == "traces"
    (t,) = panel["targets"]
    assert t["format"] == 3 and t["queryType"] == "traces"
    assert TRACE_TIMES_VIEW in t["rawSql"] and "${trace_id}" in t["rawSql"]  # the lookup table, every shard


def test_time_series_panels_use_time_series_format(boards):
    for uid, p in _panels(boards):
        if p["type"] == "timeseries":
            assert all(t["format"] == 0 for t in p["targets"]), (uid, p["title"])
        elif p["type"] in ("table", "barchart"):
            assert all(t["format"] == 1 for t in p["targets"]), (uid, p["title"])


def test_other_database_renders_into_every_query():
    for board in generate.dashboards("llm_prod"):
        for p in board["panels"]:
            for t in p["targets"]:
                assert '"llm_prod".' in t["rawSql"] and '"otel".' not in t["rawSql"]


def test_provisioning_yaml_is_valid():
    ds = yaml.safe_load((CHECKED_IN / generate.DATASOURCES_YAML).read_text())
    (source,) = ds["datasources"]
    assert source["uid"] == DATASOURCE_UID and source["type"] == PLUGIN_TYPE and source["isDefault"]
    assert source["jsonData"]["traces"]["defaultTable"] == "otel_traces"
    assert source["jsonData"]["traces"]["traceTimestampTableSuffix"] == "_trace_id_ts"
    providers = yaml.safe_load((CHECKED_IN / generate.PROVIDERS_YAML).read_text())["providers"]
    assert providers[0]["type"] == "file" and providers[0]["folderUid"] == generate.FOLDER
