"""The latency budget as Python objects (`latency_budget`), as text (`budget_format`), and across
the machines of disaggregated serving (`pd_budget`)."""

from phaselens.analysis.budget import budget_format, pd_budget
from phaselens.analysis.budget.latency_budget import AnalysisError, BudgetReport, budget, open_client
from phaselens.analysis.budget.pd_budget import PdBudget

__all__ = ["AnalysisError", "BudgetReport", "PdBudget", "budget", "budget_format", "open_client", "pd_budget"]
