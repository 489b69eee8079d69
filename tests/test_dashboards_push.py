"""`phaselens dashboards push` against a RECORDING HTTP STAND-IN for Grafana (tests/dashboards_fixtures.py;
no Grafana server can run here): the exact API calls and bodies, idempotence, and the errors."""

from __future__ import annotations

import pytest

from phaselens.cli import main
from phaselens.common.process import free_port
from phaselens.dashboards import generate
from phaselens.dashboards.datasource import DATASOURCE_UID, ClickHouseTarget, datasource
from phaselens.dashboards.push import PUSH_MESSAGE, PushError, connect, push
from tests.dashboards_fixtures import ADMIN_TOKEN, BASIC_USER, VIEWER_TOKEN, GrafanaStandIn


@pytest.fixture()
def grafana():
    with GrafanaStandIn() as g:
        yield g


def _cli_push(url: str, *extra: str) -> int:
    return main(["dashboards", "push", "--grafana", url, "--clickhouse-host", "ch.internal", "--timeout", "5", *extra])


def test_first_push_makes_exactly_these_calls(grafana, capsys):
    assert _cli_push(grafana.url, "--token", ADMIN_TOKEN) == 0
    boards = generate.dashboards()
    ds = datasource(ClickHouseTarget(host="ch.internal"))
    expected = [
        ("GET", "/api/frontend/settings", None),
        ("GET", f"/api/datasources/uid/{DATASOURCE_UID}", None),
        ("POST", "/api/datasources", ds),
        ("GET", "/api/folders/phaselens", None),
        ("POST", "/api/folders", {"title": "phaselens", "uid": "phaselens"}),
    ]
    for board in boards:
        body = {k: v for k, v in board.items() if k != "version"}
        expected += [
            ("GET", f"/api/dashboards/uid/{board['uid']}", None),
            (
                "POST",
                "/api/dashboards/db",
                {
                    "dashboard": {**body, "id": None},
                    "folderUid": "phaselens",
                    "overwrite": True,
                    "message": PUSH_MESSAGE,
                },
            ),
        ]
    assert grafana.state.calls == expected
    assert ds["jsonData"]["host"] == "ch.internal" and ds["jsonData"]["port"] == 9000
    assert {b["uid"] for b in boards} == set(grafana.state.dashboards)
    out = capsys.readouterr().out
    assert f"created {2 + len(boards)}, updated 0, unchanged 0" in out


def test_second_push_writes_nothing(grafana, capsys):
    assert _cli_push(grafana.url, "--token", ADMIN_TOKEN) == 0
    versions = {uid: d["dashboard"]["version"] for uid, d in grafana.state.dashboards.items()}
    grafana.state.calls.clear()
    assert _cli_push(grafana.url, "--token", ADMIN_TOKEN) == 0
    assert grafana.state.writes() == []
    assert len(grafana.state.calls) == 3 + len(versions)  # settings, datasource, folder, one GET per board
    assert {uid: d["dashboard"]["version"] for uid, d in grafana.state.dashboards.items()} == versions
    assert f"created 0, updated 0, unchanged {2 + len(versions)}" in capsys.readouterr().out.splitlines()[-1]


def test_changes_are_written_and_only_they(grafana):
    api = connect(grafana.url, token=ADMIN_TOKEN)
    boards = generate.dashboards()
    push(api, datasource(), boards, "phaselens", "phaselens")
    edited = boards[0]["uid"]
    grafana.state.dashboards[edited]["dashboard"]["title"] = "edited in the UI"
    grafana.state.calls.clear()

    result = push(api, datasource(ClickHouseTarget(host="other", protocol="http")), boards, "phaselens", "phaselens")
    assert result.updated == [f"datasource {DATASOURCE_UID}", f"dashboard {edited}"]
    writes = grafana.state.writes()
    assert [(m, p) for m, p, _ in writes] == [
        ("PUT", f"/api/datasources/uid/{DATASOURCE_UID}"),
        ("POST", "/api/dashboards/db"),
    ]
    assert writes[0][2]["jsonData"]["port"] == 8123 and writes[0][2]["jsonData"]["protocol"] == "http"
    assert grafana.state.dashboards[edited]["dashboard"]["title"] == boards[0]["title"]
    assert grafana.state.dashboards[edited]["dashboard"]["version"] == 2


def test_dashboard_in_another_folder_is_moved(grafana):
    api = connect(grafana.url, user=BASIC_USER[0], password=BASIC_USER[1])
    boards = generate.dashboards()[:1]
    push(api, datasource(), boards, "phaselens", "phaselens")
    result = push(api, datasource(), boards, "team-llm", "team-llm")
    assert result.updated == [f"dashboard {boards[0]['uid']}"]
    assert grafana.state.dashboards[boards[0]["uid"]]["meta"]["folderUid"] == "team-llm"


def _one_error_line(capsys) -> str:
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and captured.out == ""
    return lines[0]


def test_wrong_url_is_one_clear_line(capsys):
    url = f"http://127.0.0.1:{free_port()}"
    assert _cli_push(url, "--token", ADMIN_TOKEN) == 1
    line = _one_error_line(capsys)
    assert line == (
        f"error: cannot connect to Grafana at {url}: [Errno 111] Connection refused (is it running? check --grafana)"
    )


def test_bad_token_is_one_clear_line(grafana, capsys):
    assert _cli_push(grafana.url, "--token", "wrong") == 1
    line = _one_error_line(capsys)
    assert "401" in line and "--token" in line
    assert grafana.state.writes() == []


def test_bad_password_is_401(grafana, capsys):
    assert _cli_push(grafana.url, "--user", "admin", "--password", "nope") == 1
    assert "401" in _one_error_line(capsys)


def test_viewer_token_is_403(grafana, capsys):
    assert _cli_push(grafana.url, "--token", VIEWER_TOKEN) == 1
    line = _one_error_line(capsys)
    assert "403" in line and "Admin" in line
    assert grafana.state.datasources == {}


@pytest.mark.parametrize("url", ["localhost:3000", "ftp://grafana", "http://"])
def test_not_a_url(url):
    with pytest.raises(PushError, match="not a Grafana URL"):
        connect(url, token=ADMIN_TOKEN)


def test_user_without_password():
    with pytest.raises(PushError, match="--password"):
        connect("http://127.0.0.1:3000", user="admin")
