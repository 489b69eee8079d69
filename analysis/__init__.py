"""Latency budgets in ClickHouse: the per-request schema (`schema`), every query in one place
(`queries`, rendered for the CLI with bound parameters or for Grafana by `dialect`), and the Python
API (`budget.budget(client, …) -> BudgetReport`)."""
