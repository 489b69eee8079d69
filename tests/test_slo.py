"""One SLO syntax for `bench --goodput` and `budget|report|demo --slo`, with the same checks."""

import pytest

from phaselens.analysis.budget import AnalysisError, parse_slo
from phaselens.instrumentation.slo import parse_slo_ms


def test_parses_lists_and_comma_text_alike():
    assert parse_slo_ms(["ttft:200", "tpot:50,e2el:900"]) == parse_slo_ms("ttft:200,tpot:50,e2el:900") \
        == {"ttft": 200.0, "tpot": 50.0, "e2el": 900.0}
    assert parse_slo("ttft:200, tpot:50") == {"ttft_slo_ms": 200.0, "tpot_slo_ms": 50.0}
    assert parse_slo(None) == {}


@pytest.mark.parametrize("bad", ["ttft:0", "ttft:-5", "ttft:1,ttft:2", "tpot:x", "p99:5", "e2el:100"])
def test_budget_refuses_what_bench_refuses(bad):
    with pytest.raises(AnalysisError, match="--slo takes ttft:MS,tpot:MS"):
        parse_slo(bad)
