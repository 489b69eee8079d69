"""Latency budgets in ClickHouse: the per-request schema (`schema`), every query in one place
(`queries`, rendered for the CLI with bound parameters or for Grafana by `dialect`; checked in as
`sql/*.sql` by `sql_files`), the Python API (`budget.budget(client, …) -> BudgetReport`) and the
HTML report (`report` builds `report_data`, `report_page` draws it)."""
