"""Latency budgets in ClickHouse, in rooms: `schema/` (the per-request tables and views), `queries/`
(every query in one place, rendered for the CLI with bound parameters or for Grafana), `rollup/`
(per-minute rollups), `sql/` (every statement as text, checked in as `sql/*.sql`), `budget/` (the
Python API, `latency_budget.budget(client, …) -> BudgetReport`), `diagnose/`, `report/` (the HTML
report) and `harness/` (another harness's export imported); `terms` and `thresholds` declare the
budget terms and the diagnosis thresholds every room reads."""
