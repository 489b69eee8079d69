"""collectors/otelcol.yaml (the writer tier) and otelcol-gateway.yaml (the load-balancing tier): the
real collector writes where `phaselens schema apply` created the table, with an on-disk queue, and
the gateway routes every trace to one writer."""

from __future__ import annotations

from pathlib import Path

import yaml

from phaselens.collectors import schema

COLLECTORS = Path(__file__).resolve().parent.parent / "collectors"
CONFIG = COLLECTORS / "otelcol.yaml"
GATEWAY = COLLECTORS / "otelcol-gateway.yaml"
COMPOSE = COLLECTORS.parent / "docker-compose.yml"


def _queue_is_on_disk(config: dict, queue: dict) -> str:
    """The file_storage extension the sending queue names, enabled in the service; its directory."""
    assert queue["enabled"] is True and queue["queue_size"] > 0
    storage = queue["storage"]
    assert storage.split("/")[0] == "file_storage" and storage in config["service"]["extensions"]
    return config["extensions"][storage]["directory"]


def test_otelcol_config_targets_our_schema():
    config = yaml.safe_load(CONFIG.read_text())
    exporter = config["exporters"]["clickhouse"]
    assert (exporter["database"], exporter["traces_table_name"]) == ("otel", schema.TRACES_TABLE)
    assert exporter["create_schema"] is False
    assert set(config["receivers"]["otlp"]["protocols"]) == {"grpc", "http"}
    pipeline = config["service"]["pipelines"]["traces"]
    assert pipeline["receivers"] == ["otlp"] and pipeline["exporters"] == ["clickhouse"]
    assert "batch" in pipeline["processors"]


def test_writer_queue_is_on_a_compose_volume():
    config = yaml.safe_load(CONFIG.read_text())
    directory = _queue_is_on_disk(config, config["exporters"]["clickhouse"]["sending_queue"])
    assert config["exporters"]["clickhouse"]["retry_on_failure"]["enabled"] is True
    service = yaml.safe_load(COMPOSE.read_text())["services"]["otel-collector"]
    assert any(volume.split(":")[1] == directory for volume in service["volumes"])


def test_gateway_routes_by_trace_id_to_writers_with_a_disk_queue():
    config = yaml.safe_load(GATEWAY.read_text())
    exporter = config["exporters"]["loadbalancing"]
    assert exporter["routing_key"] == "traceID"
    hostnames = exporter["resolver"]["static"]["hostnames"]
    assert len(hostnames) >= 2 and all(h.rstrip("}").endswith(":4317") for h in hostnames)
    _queue_is_on_disk(config, exporter["protocol"]["otlp"]["sending_queue"])
    pipeline = config["service"]["pipelines"]["traces"]
    assert pipeline["exporters"] == ["loadbalancing"]
    assert set(config["receivers"]["otlp"]["protocols"]) == {"grpc", "http"}
