"""The per-request tables and views in ClickHouse: the analysis schema (`schema`), the per-request
tables of disaggregated serving (`pd_schema`), their building blocks (`parts`), and what each span
model can separate (`span_models`)."""

from phaselens.analysis.schema import schema
from phaselens.analysis.schema.schema import FACTS_VIEW, SPANS_VIEW

__all__ = ["FACTS_VIEW", "SPANS_VIEW", "schema"]
