"""Where the spans are stored: ClickHouse. One way to connect (`clickhouse_url`) and a real
ClickHouse server from chdb-core for machines without one (`embedded`)."""
