"""One SLO syntax for `bench --goodput` and `budget|report|demo --slo`, with the same checks."""

import pytest

from phaselens.common.slo import GOODPUT_SLO_KEYS, SLO, parse_slo


def test_parses_lists_and_comma_text_alike():
    assert (
        parse_slo(["ttft:200", "tpot:50,e2el:900"])
        == parse_slo("ttft:200,tpot:50,e2el:900")
        == SLO(ttft_ms=200.0, tpot_ms=50.0, e2el_ms=900.0)
    )
    assert parse_slo("ttft:200, tpot:50", GOODPUT_SLO_KEYS) == SLO(ttft_ms=200.0, tpot_ms=50.0)
    assert parse_slo("tpot:50").describe() == {"tpot_ms": 50.0}


@pytest.mark.parametrize("bad", ["ttft:0", "ttft:-5", "ttft:1,ttft:2", "tpot:x", "p99:5", "", " , "])
def test_bad_or_empty_slos_raise(bad):
    with pytest.raises(ValueError, match="SLO"):
        parse_slo(bad)


def test_budget_takes_ttft_and_tpot_only():
    with pytest.raises(ValueError, match="use ttft:MS, tpot:MS"):
        parse_slo("e2el:100", GOODPUT_SLO_KEYS)
