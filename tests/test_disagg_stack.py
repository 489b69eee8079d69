"""Disaggregated serving across "hosts": router, prefill and two decode instances as separate
processes, the prefill instance's wall clock 1 h behind, the decode instances' 1 h ahead
(libfaketime; monotonic clocks untouched), tracing to a real collector and ClickHouse. The budget
of every request must hold on its own clocks: every term ≥ 0 and the parts sum to the client's TTFT.
"""

from __future__ import annotations

import json
import math
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest

from phaselens.analysis import queries as queries
from phaselens.analysis.budget.pd_budget import pd_budget
from phaselens.analysis.diagnose.diagnosis import diagnose
from phaselens.analysis.queries import pd_queries, sketch
from phaselens.analysis.report import report, report_page
from phaselens.analysis.rollup import rollup
from phaselens.analysis.schema.pd_schema import PD_TERMS
from phaselens.pd_stack import PdStack, faketime_library
from phaselens.stack import Stack, StackError
from tests.dashboards_fixtures import ALL, GrafanaQueryContext, expand_grafana_sql
from tests.pd_clocks import assert_instances_skewed, sleep_shim
from tests.server_fixtures import Collected, greedy, make_engine

REQUESTS = 12
SKEW_S = 3600
# edges no request of this stack stamps: the budget shows them unobserved (NULL), never 0
UNSTAMPED_HERE = frozenset({"inbound_ms", "client_late_est_ms"})


def _faketime_present() -> bool:
    try:
        faketime_library()
    except StackError:
        return False
    return True


@pytest.fixture(scope="module")
def pd(tmp_path_factory):
    if not _faketime_present():
        pytest.fail("libfaketime is missing: ./setup.sh --test installs it (apt-get install faketime)")
    data = tmp_path_factory.mktemp("pd")
    shim = sleep_shim(data)
    stack = Stack(str(data), stop_timeout_s=20)
    skews = {"prefill": "-1h", "decode": "+1h"}
    with PdStack(stack, decode_count=2, skews=skews, preload=(str(shim),)) as pd:
        yield pd


@pytest.fixture(scope="module")
def rows(pd):
    """One bench run through the router (2 streams), then the per-request rows once all are in (a
    request's spans land in several exports: a row is read once it has every view the tests use)."""
    argv = f"--model tiny --concurrency 2 --requests {REQUESTS} --input-len 40 --output-len 12 --ignore-eos --quiet"
    pd.bench(argv.split(), timeout_s=300)
    sql = (
        f"SELECT * FROM {pd.stack.database}.phaselens_requests "
        "WHERE client_ttft_ms IS NOT NULL AND kv_bytes_received IS NOT NULL AND router_ttfc_ms IS NOT NULL "
        "AND decode_first_chunk_ms IS NOT NULL AND kv_transfer_ms IS NOT NULL AND residual_ms IS NOT NULL "
        "ORDER BY server_start_time"
    )
    deadline = time.monotonic() + 60
    with pd.stack.client() as ch:
        while time.monotonic() < deadline:
            found = list(ch.query(sql).named_results())
            if len(found) >= REQUESTS:
                return found
            time.sleep(0.5)
    pytest.fail(f"{len(found)} of {REQUESTS} requests complete in ClickHouse")


def test_budget_across_three_clocks_sums_to_client_ttft_with_no_negative_term(rows):
    for row in rows:
        terms = {name: row[name] for name in PD_TERMS}
        assert all(v is not None for v in terms.values()), terms
        assert min(terms.values()) >= -1e-6 and row["residual_ms"] >= -1e-6, terms
        # the router's and the client's own time (and its estimated wait TCP's coalescing hid)
        edges = (row["inbound_ms"] or 0) + (row["client_ms"] or 0) + (row["client_late_est_ms"] or 0)
        total = sum(terms.values()) + row["residual_ms"] + edges
        assert total == pytest.approx(row["client_ttft_ms"], abs=1e-3)
        # the hops are residuals of durations: an hour of clock skew cannot show in them
        assert row["prefill_hop_ms"] < 1000 and row["decode_hop_ms"] < 1000
        assert row["kv_transfer_ms"] > 0 and row["prefill_compute_ms"] > 0


def test_wall_clocks_really_disagree_by_an_hour(pd, rows):
    """The span timestamps show the skew: the prefill instance's spans start ~1 h before the
    router's, the decode instance's ~1 h after (what a budget from wall stamps would subtract)."""
    assert_instances_skewed(pd.stack, rows[0]["trace_id"], SKEW_S)


def test_kv_bytes_received_equal_kv_bytes_sent(rows):
    for row in rows:
        assert row["kv_bytes"] == row["kv_bytes_received"] > 0
        assert row["prefill_instance"] and row["decode_instance"]
        assert row["decode_itl_p99_ms"] > 0  # from the decode instance's llm.decode span


def test_router_spreads_requests_over_both_decode_instances_by_load(rows):
    per_instance: dict[str, int] = {}
    for row in rows:
        per_instance[row["decode_instance"]] = per_instance.get(row["decode_instance"], 0) + 1
    assert len(per_instance) == 2 and min(per_instance.values()) >= REQUESTS // 4, per_instance


def test_budget_and_diagnose_read_the_disaggregated_terms(pd, rows):
    """The P/D budget's mean terms partition the mean client TTFT; `phaselens budget` prints it and
    `diagnose` weighs the KV transfer as a cause."""
    with pd.stack.client() as ch:
        report = pd_budget(ch, database=pd.stack.database, since=None)
        diagnosis = diagnose(ch, database=pd.stack.database, since=None)
    assert report.complete == REQUESTS and report.kv_bytes_mismatch == 0 and report.decode_instances == 2
    observed = [c for c in report.terms if c.ms.mean is not None]  # an edge no request stamped: NULL, not 0
    assert {c.name for c in report.terms} - {c.name for c in observed} <= UNSTAMPED_HERE
    assert sum(c.ms.mean for c in observed) == pytest.approx(report.side["client_ttft_ms"].mean, rel=1e-9)
    assert sum(c.share.mean for c in observed) == pytest.approx(1.0, rel=1e-9)
    kv = next(s for s in diagnosis.signals if s.cause == "kv_transfer")
    assert kv.p50_signal == pytest.approx(report.term("kv_transfer_ms").p50 / report.side["client_ttft_ms"].p50)
    assert ("kv_transfer" in diagnosis.causes) == (kv.flagged_p50 or kv.flagged_p99)
    argv = ["budget", "--clickhouse", pd.stack.clickhouse_url, "--database", pd.stack.database]
    shown = subprocess.run(
        [sys.executable, "-m", "phaselens", *argv, "--since", "all", "--format", "json"],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    assert json.loads(shown.stdout)["disaggregated"]["complete"] == REQUESTS


def test_the_grafana_pd_panel_shows_the_budget_of_phaselens_budget_within_the_sketch_error(pd, rows):
    """The P/D panel's SQL (the rollups' states; Grafana macros expanded by the stand-in) gives the
    means of `phaselens budget` (exact) and each term's p50/p90/p99 within the sketch's stated error:
    within ALPHA of an order statistic next to rank q·(n − 1), where the exact path interpolates."""
    now = int(time.time())
    ctx = GrafanaQueryContext(now - 3600, now + 60, 10, {"service": ALL, "model": ALL}, {"model": ["tiny"]})
    with pd.stack.client() as ch:
        rollup.refresh_now(ch, pd.stack.database)  # the views run: the live states as of now
        report = pd_budget(ch, database=pd.stack.database, since=None)
        sql = expand_grafana_sql(queries.render_grafana("pd_budget_stack_rollup", pd.stack.database), ctx)
        panel = {r["statistic"]: r for r in ch.query(sql).named_results()}
        terms = ", ".join(pd_queries.pd_rollup_terms())
        every = f"SELECT *, {pd_queries.PD_COMPLETE} AS pd_complete FROM {pd.stack.database}.phaselens_requests"
        (values,) = ch.query(f"SELECT groupArray([{terms}]) FROM ({every})").result_rows[0]
    assert list(panel) == ["p50", "p90", "p99", "mean"] and report.complete == REQUESTS
    for i, term in enumerate(report.terms):
        if term.ms.mean is None:  # unobserved: NULL at every statistic of the panel too
            assert term.name in UNSTAMPED_HERE and {panel[s][term.name] for s in panel} == {None}, term.name
            continue
        assert panel["mean"][term.name] == pytest.approx(term.ms.mean, rel=1e-9, abs=1e-9), term.name
        ordered = sorted(v[i] for v in values if v[i] is not None)
        assert len(ordered) == REQUESTS
        for stat, level in zip(("p50", "p90", "p99"), sketch.LEVELS, strict=True):
            h = level * (len(ordered) - 1)
            lo, hi = ordered[math.floor(h)], ordered[math.ceil(h)]
            got = panel[stat][term.name]
            assert lo - sketch.ALPHA * abs(lo) - 1e-9 <= got <= hi + sketch.ALPHA * abs(hi) + 1e-9, (term.name, stat)
    total = sum(v for k, v in panel["mean"].items() if k != "statistic" and v is not None)
    assert total == pytest.approx(report.side["client_ttft_ms"].mean, rel=1e-9)


def test_the_report_draws_each_request_across_its_instances_on_their_own_clocks(pd, rows):
    """The report's waterfalls (typical and slowest request): router, prefill instance with its KV
    transfer, decode instance, each at offsets on its own clock (an hour apart on the wall), the hops
    drawn as residuals of durations; nothing an hour off the axis."""
    with pd.stack.client() as ch:
        data = report.build(ch, database=pd.stack.database, since=None)
    assert data.traces
    by_trace = {r["trace_id"]: r for r in rows}
    for view in data.traces:
        lanes, total = report_page.layout_trace(view.spans, view.hops_ms)
        labels = [ln.label for ln in lanes]
        roots = [ln for ln in lanes if ln.label.endswith(" clock)")]
        assert [ln.label.split(" · ")[0] for ln in roots] == ["router", "prefill", "decode"], labels
        hops = [ln for ln in lanes if ln.label.startswith("hop → ")]
        assert [h.label for h in hops] == ["hop → prefill (residual)", "hop → decode (residual)"]
        assert "llm.kv_transfer" in labels and "llm.kv_receive" in labels
        client_ms = lanes[0].duration_ms
        # every lane on the client's axis, no hour's offset (3.6e6 ms). A process's spans may end after
        # the client's (the prefill root outlasts its answer: 123 ms after a 465 ms request on a loaded
        # machine), so the bound is far from what load shows and far below the hour
        ends = [(ln.label, round(ln.start_ms + ln.duration_ms, 1)) for ln in lanes]
        assert 0.95 * client_ms <= total <= client_ms + 60_000, (client_ms, ends)
        assert all(0.0 <= ln.start_ms <= total for ln in lanes), [(ln.label, ln.start_ms) for ln in lanes]
        row = by_trace[view.trace_id]  # the hops are the P/D budget's residuals, the KV lane its span
        assert [h.duration_ms for h in hops] == [
            pytest.approx(row["prefill_hop_ms"]),
            pytest.approx(row["decode_hop_ms"]),
        ]
        kv = next(ln for ln in lanes if ln.label == "llm.kv_transfer")
        assert kv.duration_ms >= row["kv_transfer_ms"] - 1e-6


def test_greedy_output_through_the_router_equals_a_colocated_engine(pd):
    engine = make_engine()
    engine.start()
    try:
        for prompt in ([5, 6, 7, 8], list(range(20, 90))):
            colocated = Collected()
            engine.submit(prompt, greedy(10, ignore_eos=True), sink=colocated)
            body = {"model": "tiny", "prompt": prompt, "max_tokens": 10, "temperature": 0, "ignore_eos": True}
            answer = httpx.post(f"{pd.router_url}/v1/completions", json=body, timeout=60).json()
            deadline = time.monotonic() + 30
            while colocated.final is None and time.monotonic() < deadline:
                time.sleep(0.01)
            assert answer["choices"][0]["text"] == colocated.content
            assert answer["usage"]["completion_tokens"] == 10
    finally:
        engine.stop()


def test_router_answers_bad_requests_with_openai_errors(pd):
    url = f"{pd.router_url}/v1/completions"
    not_json = httpx.post(url, content=b"{nope", headers={"content-type": "application/json"}, timeout=30)
    assert not_json.status_code == 400 and "not valid JSON" in not_json.json()["error"]["message"]
    unknown = httpx.post(url, json={"model": "nope", "prompt": "hi"}, timeout=30)  # the prefill instance's own 400
    assert unknown.status_code == 400 and unknown.json()["error"]["code"] == "model_not_found"
    too_big = httpx.post(url, content=b" " * (2 << 20), headers={"content-type": "application/json"}, timeout=30)
    assert too_big.status_code == 413


def test_decode_killed_mid_stream_errors_the_client_and_frees_the_prefill_blocks(pd):
    """Runs last: it kills a decode instance."""
    body = {"model": "tiny", "prompt": "hello", "max_tokens": 3000, "ignore_eos": True, "stream": True}
    events: list[str] = []
    with httpx.stream("POST", f"{pd.router_url}/v1/completions", json=body, timeout=30) as response:
        lines = response.iter_lines()
        for line in lines:
            if line.startswith("data: "):
                events.append(line)
                break
        busy = [d["url"] for d in httpx.get(f"{pd.router_url}/health").json()["decode"] if d["inflight"]]
        victim = next(c for c in pd.decodes if c.url in busy)
        victim.proc.send_signal(signal.SIGKILL)
        started = time.monotonic()
        events += [line for line in lines if line.startswith("data: ")]
    assert time.monotonic() - started < 15
    last = json.loads(events[-1][6:])
    assert last["error"]["code"] == "decode_failed" and victim.url in last["error"]["message"]
    assert "data: [DONE]" not in events
    prefill = httpx.get(f"{pd.prefill.url}/health").json()
    assert prefill["kv_blocks_used"] == 0 and prefill["running"] == 0
    assert all(d["inflight"] == 0 for d in httpx.get(f"{pd.router_url}/health").json()["decode"])


def test_prefill_killed_mid_prompt_errors_the_client_and_leaves_no_kv_staged(pd):
    """Runs after the decode kill (whose dead instance the router now passes over): the prefill
    instance dies while a long prompt is in it."""
    live = next(c for c in pd.decodes if c.proc.poll() is None)
    prompt = [3 + i % 200 for i in range(3500)]
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 4, "ignore_eos": True}
    answers: list[httpx.Response] = []
    caller = threading.Thread(
        target=lambda: answers.append(httpx.post(f"{pd.router_url}/v1/completions", json=body, timeout=60))
    )
    caller.start()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and not httpx.get(f"{pd.router_url}/health").json()["prefill"][0]["inflight"]:
        time.sleep(0.01)
    pd.prefill.proc.send_signal(signal.SIGKILL)
    caller.join(15)
    assert not caller.is_alive() and answers[0].status_code == 502
    assert answers[0].json()["error"]["code"] == "prefill_failed"
    health = httpx.get(f"{live.url}/health").json()
    assert health["kv_staged"] == 0 and health["kv_blocks_used"] == 0
