"""The latency budget as Python objects (`latency_budget`), as text (`budget_format`), and across
the machines of disaggregated serving (`pd_budget`)."""
