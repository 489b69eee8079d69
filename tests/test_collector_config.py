"""collectors/otelcol.yaml: the real collector writes where `phaselens schema apply` created the table."""

from __future__ import annotations

from pathlib import Path

import yaml

from phaselens.collectors import schema

CONFIG = Path(__file__).resolve().parent.parent / "collectors" / "otelcol.yaml"


def test_otelcol_config_targets_our_schema():
    config = yaml.safe_load(CONFIG.read_text())
    exporter = config["exporters"]["clickhouse"]
    assert (exporter["database"], exporter["traces_table_name"]) == ("otel", schema.TRACES_TABLE)
    assert exporter["create_schema"] is False
    assert set(config["receivers"]["otlp"]["protocols"]) == {"grpc", "http"}
    pipeline = config["service"]["pipelines"]["traces"]
    assert pipeline["receivers"] == ["otlp"] and pipeline["exporters"] == ["clickhouse"]
    assert "batch" in pipeline["processors"]
