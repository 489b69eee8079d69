"""The latency budget as Python objects (`latency_budget`), as text (`budget_format`), across
the machines of disaggregated serving (`pd_budget`), and from NVIDIA Dynamo's own spans
(`dynamo_budget`)."""

from phaselens.analysis.budget import budget_format, dynamo_budget, pd_budget
from phaselens.analysis.budget.dynamo_budget import DynamoBudget
from phaselens.analysis.budget.latency_budget import AnalysisError, BudgetReport, budget, open_client
from phaselens.analysis.budget.pd_budget import PdBudget

__all__ = [
    "AnalysisError",
    "BudgetReport",
    "DynamoBudget",
    "PdBudget",
    "budget",
    "budget_format",
    "dynamo_budget",
    "open_client",
    "pd_budget",
]
