"""The HTML report: its data read from ClickHouse (`report`), its types (`report_data`), and the
page drawn from them (`report_page`, `report_charts`, `report_waterfall`; template and CSS in
`report_assets/`)."""

from phaselens.analysis.report import report_page
from phaselens.analysis.report.report import build, write_report

__all__ = ["build", "report_page", "write_report"]
