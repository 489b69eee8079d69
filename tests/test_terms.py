"""Budget terms are declared once (analysis/terms.py): every surface reads the declarations, the
rollups' positions never move, the docs' table is their rendering, and a term used in the shipped
source but not declared fails here."""

import ast
import json
import re
import subprocess
import sys

import pytest
from source_tree import ROOT

from phaselens.analysis import queries as q
from phaselens.analysis import terms
from phaselens.analysis.queries import pd_queries
from phaselens.analysis.report import report_page
from phaselens.analysis.schema import pd_schema, schema

# The rollups' array positions as sealed rows hold them (append-only: a new series goes at the end).
ROLLUP_ORDER = (
    *("ttft_ms", "client_ttft_ms", "server_ttft_ms", "client_ttfo_ms", "server_ttfc_ms", "inbound_ms"),
    *("ingress_ms", "queue_ms", "prefill_ms", "first_token_ms", "before_engine_ms", "held_back_ms"),
    *("first_chunk_ms", "client_ms", "residual_ms", "loop_wait_ms", "encode_ms", "write_ms"),
    *("kernel_wait_ms", "dispatch_ms", "client_send_ms", "client_read_ms", "client_observed_ms"),
    *("held_back_observed_ms", "e2e_residual_ms", "client_tpot_ms", "server_tpot_ms", "client_itl_p99_ms"),
    *("server_itl_p99_ms", "client_e2e_ms", "server_e2e_ms", "stall_ms", "queue_all_waits_ms"),
    *("diag_tpot_ms", "diag_e2e_ms", "diag_input_tokens", "diag_output_tokens", "diag_prefill_ms"),
    *("diag_ingress_ms", "first_chunk_stamped_ms", "client_late_est_ms", "client_late_est_observed_ms"),
    "diag_client_ms",
    "client_end_read_ms",
)
# The P/D rollup's positions (pd_terms_qs / pd_terms_avg), likewise append-only.
PD_ORDER = (
    *("inbound_ms", "client_ms", "client_late_est_ms", "residual_ms", "router_ingress_ms", "prefill_hop_ms"),
    *("prefill_ingress_ms", "prefill_queue_ms", "prefill_compute_ms", "prefill_first_token_ms", "kv_wait_ms"),
    *("kv_transfer_ms", "prefill_respond_ms", "router_gap_ms", "decode_hop_ms", "decode_ingress_ms"),
    *("decode_queue_ms", "decode_first_token_ms", "decode_first_chunk_ms", "router_relay_ms"),
)
# ...then the witnesses of the edges counted 0 where unstamped (their columns), from slot 21 on.
PD_WITNESS_ORDER = ("inbound_ms", "client_ms", "client_late_est_ms")
# `*_ms` names in the shipped source that are not budget terms: figures, parameters, load-generator
# metrics (a budget term goes into analysis/terms.py instead).
NOT_TERMS = frozenset(
    {
        *("client_p90_ms", "ttft_p90_ms", "failure_adjusted_ms", "latency_ms", "slo_ms", "elapsed_ms"),
        *("intended_ms", "sent_ms", "schedule_lag_ms", "timestamp_ms", "delay_ms", "interval_ms"),
        *("e2e_ms", "itl_ms", "ttfo_ms", "network_ms", "hops_ms", "start_ms", "mark_ms", "since_ms"),
        *("decode_step_ms", "mixed_step_ms", "decode_token_ms", "extra_ms", "step_baseline_ms"),
        *("ttft_slo_ms", "tpot_slo_ms"),
    }
)
SCANNED = ("analysis", "dashboards", "phaselens", "loadgen")
_MS_NAME = re.compile(r"(?<![\w.])([a-z][a-z0-9_]*_ms)\b")


def test_rollup_positions_are_pinned():
    assert q.ROLLUP_POSITIONS == ROLLUP_ORDER
    assert pd_queries.TTFT_TERMS == PD_ORDER
    witnesses = terms.REGISTRY.pd_gated()
    assert [(t.name, t.pd_witness_position) for t in witnesses] == [
        (name, len(PD_ORDER) + i) for i, name in enumerate(PD_WITNESS_ORDER, start=1)
    ]
    assert pd_queries.pd_rollup_terms()[len(PD_ORDER) :] == [f"if(pd_complete, {t}, NULL)" for t in PD_WITNESS_ORDER]


def test_every_list_reads_the_declarations():
    r = terms.REGISTRY
    assert tuple((t.name, t.sql) for t in r.components()) == q.COMPONENTS
    assert [name for name, _ in q.COMPONENTS][:2] == ["inbound_ms", "ingress_ms"]
    assert q.COMPONENTS[-1] == ("residual_ms", "residual_ms") and dict(q.COMPONENTS)["queue_ms"] == "ttft_queue_ms"
    assert {"client_late_est_ms"} == q.ESTIMATED
    assert q.OBSERVED_BY["inbound_ms"] == "kernel_wait_ms"
    assert [name for name, _ in q.FIRST_CHUNK_SPLIT] == ["loop_wait_ms", "encode_ms", "write_ms"]
    assert [c[0] for c in report_page.COMPONENTS] == [name for name, _ in q.COMPONENTS]
    assert PD_ORDER[4:] == pd_schema.PD_TERMS


def test_every_term_has_its_column_in_the_views():
    facts = {name for name, _ in schema.REQUEST_COLUMNS + schema.EXTRA_COLUMNS}
    pd_columns = {name for name, _ in pd_schema.PD_COLUMNS}
    for t in terms.DECLARED:
        assert t.column in (facts if t.aggregated else pd_columns), t.name


def test_the_docs_table_is_the_declarations():
    page = (ROOT / "docs" / "budget-method.md").read_text(encoding="utf-8")
    assert terms.docs_table() in page, "paste terms.docs_table() into docs/budget-method.md#the-terms"


@pytest.mark.parametrize(
    ("change", "error"),
    [
        ({"name": "ingress_ms"}, "declared twice"),
        ({"name": "fake_s"}, "does not end in its unit"),
        ({"rollup_position": 7}, "share a rollup_position"),
        ({"pd_position": 1}, "share a pd_position"),
        ({"pd_position": 24, "sql": "ifNull(ingress_ms, 0)"}, "needs a pd_witness_position"),
        ({"pd_position": 25}, "without a gap"),
    ],
)
def test_a_bad_declaration_is_refused(change, error):
    fake = terms.Term("fake_ms", "fake", "#123456", "server", "", "ingress_ms", "ingress_ms")
    fields = {f: getattr(fake, f) for f in terms.Term.__dataclass_fields__} | change
    with pytest.raises(ValueError, match=error):
        terms.Registry((*terms.DECLARED, terms.Term(**fields)))


def _ms_names(source: str) -> set[str]:
    """`*_ms` names in the string literals of a module (SQL, dict keys, column lists)."""
    out: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            out.update(_MS_NAME.findall(node.value))
    return out


def _known_names() -> set[str]:
    """Declared terms and the other names declared where they live: view columns, parts, query
    columns, rolled-up series."""
    known = set(terms.REGISTRY.names()) | {t.column for t in terms.DECLARED} | set(q.ROLLUP_POSITIONS)
    known |= {c for c, _ in schema.REQUEST_COLUMNS + schema.EXTRA_COLUMNS + schema.STEP_COLUMNS}
    known |= {c for c, _ in pd_schema.PD_COLUMNS} | {p.column for p in (*schema.PARTS, *pd_schema.PD_PARTS)}
    return known | {c for query in q.QUERIES.values() for c in query.columns} | NOT_TERMS


def test_no_undeclared_term_in_the_shipped_source():
    known = _known_names()
    undeclared = {
        f"{path.relative_to(ROOT)}: {name}"
        for folder in SCANNED
        for path in sorted((ROOT / folder).rglob("*.py"))
        for name in _ms_names(path.read_text(encoding="utf-8")) - known
    }
    assert not undeclared, "declare these in analysis/terms.py (or NOT_TERMS if not a budget term)"


def test_the_scan_catches_a_term_nobody_declared():
    assert _ms_names('COMPONENTS = (("warmup_ms", "ifNull(warmup_ms, 0)"),)') - _known_names() == {"warmup_ms"}


# Run in a fresh interpreter: the extra term is declared before any surface is imported, as an edit
# to DECLARED would be, and the real registry of this process stays as it is.
_ONE_EDIT = """
import json
from phaselens.analysis import terms
fake = terms.Term("warmup_ms", "warm-up", "#123456", "server", "`x`", "ifNull(ingress_ms, 0)", "ingress_ms",
                  rollup_position=45, pd_position=24, pd_witness_position=25)
terms.DECLARED = (*terms.DECLARED, fake)
terms.REGISTRY = terms.Registry(terms.DECLARED)
from phaselens.analysis.sql import cookbook
from phaselens.analysis import queries
from phaselens.analysis.queries import pd_queries
from phaselens.analysis.report import report_page
from phaselens.dashboards import generate
dashboards = json.dumps(generate.dashboards("otel"))
print(json.dumps({
    "components": [name for name, _ in queries.COMPONENTS],
    "rollup_last": queries.ROLLUP_POSITIONS[-1],
    "pd_terms": list(pd_queries.TTFT_TERMS),
    "report": [list(c) for c in report_page.COMPONENTS],
    "summary": queries.render_cli("budget_summary")[0],
    "pd_stack": queries.render_grafana("pd_budget_stack_rollup"),
    "stack_columns": list(queries.QUERIES["budget_stack"].columns),
    "cookbook": cookbook.markdown(),
    "docs": terms.docs_table(),
    "dashboards": dashboards,
}))
"""


def test_adding_a_term_is_one_edit():
    out = subprocess.run([sys.executable, "-c", _ONE_EDIT], capture_output=True, text=True, check=True, cwd=ROOT)
    s = json.loads(out.stdout)
    assert s["components"][-1] == "warmup_ms" and s["rollup_last"] == "warmup_ms"
    assert s["pd_terms"][-1] == "warmup_ms" and s["report"][-1] == ["warmup_ms", "warm-up", "#123456"]
    assert "if(pd_mean[25] IS NULL, NULL, pd_mean[24])" in s["pd_stack"]
    assert "AS warmup_ms_q" in s["summary"] and "AS warmup_ms_tail_mean" in s["summary"]
    assert "AS warmup_ms" in s["pd_stack"] and s["stack_columns"][-1] == "warmup_ms"
    assert "ifNull(ingress_ms, 0) AS warmup_ms" in s["cookbook"] and "| warmup |" in s["docs"]
    assert "#123456" in s["dashboards"]
