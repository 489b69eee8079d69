"""The ClickHouse data source phaselens dashboards read, as Grafana's API and provisioning take it.

One definition serves both `phaselens dashboards push` (HTTP API body) and the provisioning YAML
that docker-compose mounts, so the two cannot disagree. jsonData keys are those of the
grafana-clickhouse-datasource plugin (v4): `host`, `port`, `protocol`, `defaultDatabase`, and the
`traces` block that lets Explore and the traces panel find `otel_traces` and its
`otel_traces_trace_id_ts` lookup table.
"""

from __future__ import annotations

from dataclasses import dataclass

from phaselens.collectors.schema import TRACE_ID_TS_TABLE, TRACES_TABLE
from phaselens.dashboards.model import PLUGIN_TYPE

DATASOURCE_UID = "phaselens-clickhouse"
DATASOURCE_NAME = "phaselens ClickHouse"
DEFAULT_PORTS = {"native": 9000, "http": 8123}


@dataclass(slots=True, frozen=True)
class ClickHouseTarget:
    """Where Grafana's backend reaches ClickHouse (an address as seen from Grafana, not from us)."""

    host: str = "clickhouse"
    port: int | None = None  # None → the protocol's default port
    protocol: str = "native"
    database: str = "otel"
    username: str = "default"

    def __post_init__(self) -> None:
        if self.protocol not in DEFAULT_PORTS:
            raise ValueError(f"protocol must be one of {sorted(DEFAULT_PORTS)}, not {self.protocol!r}")

    @property
    def resolved_port(self) -> int:
        return self.port or DEFAULT_PORTS[self.protocol]


def datasource(target: ClickHouseTarget = ClickHouseTarget(), is_default: bool = False) -> dict:
    """The data source body for `POST /api/datasources` and for provisioning (where, alone in the
    compose stack's Grafana, it is the default)."""
    suffix = TRACE_ID_TS_TABLE.removeprefix(TRACES_TABLE)
    return {
        "uid": DATASOURCE_UID,
        "name": DATASOURCE_NAME,
        "type": PLUGIN_TYPE,
        "access": "proxy",
        "isDefault": is_default,
        "jsonData": {
            "host": target.host,
            "port": target.resolved_port,
            "protocol": target.protocol,
            "secure": False,
            "username": target.username,
            "defaultDatabase": target.database,
            "traces": {
                "defaultDatabase": target.database,
                "defaultTable": TRACES_TABLE,
                "otelEnabled": True,
                "otelVersion": "latest",
                "durationUnit": "nanoseconds",
                "traceTimestampTableSuffix": suffix,
            },
        },
    }
