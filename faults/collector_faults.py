"""Fault scenarios of the trace pipeline, each under steady SDK load (faults/load.py):

- collector_sigkill: the collector SIGKILLed, restarted at once on the same ports and spool;
  recover_s = kill → the new process answers /health; `cold_start_s` its first start (spawn → serving).
- clickhouse_outage: ClickHouse SIGKILLed for `outage_s`, then restarted on its data and ports;
  recover_s = ClickHouse back → every span acknowledged so far is stored.
- clickhouse_slow: inserts pass a SlowLink (stand-in) delaying each 64 KiB by `slow_delay_s` for
  `slow_s`; recover_s = delay removed → everything acknowledged so far stored.
- spool_full: a small spool cap, inserts stalled (SlowLink) for `full_s`: the collector answers
  UNAVAILABLE + RetryInfo and the SDK retries; recover_s = stall ended → everything acknowledged stored.

- rotel_sigkill, rotel_clickhouse_outage: the first two with Rotel (`rotel-agent`, run as
  docs/collectors.md recommends) in the collector's place; recover_s of the kill = kill → Rotel
  listens again.

- no_fault: the same load with nothing broken (the same-run baseline).

Ledger per scenario: sent, acknowledged (SDK SUCCESS), stored (distinct span ids in ClickHouse),
lost = acknowledged − stored, duplicated = stored rows − distinct stored span ids, client_dropped.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from phaselens.collectors.rotel_agent import RotelAgent
from phaselens.common.process import restartable_port
from phaselens.faults.load import Ledger, SpanLoad
from phaselens.faults.outcome import Outcome
from phaselens.faults.params import Params
from phaselens.faults.parts import CollectorProcess, SlowLink, collector_counters, wait_until
from phaselens.storage.clickhouse_url import connect
from phaselens.storage.embedded import EmbeddedClickHouse


@dataclass(slots=True)
class Pipeline:
    """Embedded ClickHouse with the schema; collectors and links are made per scenario."""

    work_dir: Path
    database: str = "faults"
    # the longest wait for acknowledged spans to be visible after a scenario: bounds a scenario
    # whose collector lost some (Rotel's) instead of waiting for them in vain
    store_timeout_s: float = 60.0
    clickhouse: EmbeddedClickHouse | None = field(default=None, init=False)

    def start(self) -> Pipeline:
        from phaselens.collectors import schema

        ports = restartable_port(), restartable_port()  # the outage restarts it on them
        self.clickhouse = EmbeddedClickHouse(str(self.work_dir / "clickhouse"), *ports).start()
        with connect(self.clickhouse.url) as client:
            schema.apply(client, schema.statements(self.database))
        return self

    def collector(self, name: str, clickhouse_url: str | None = None, **kwargs) -> CollectorProcess:
        return CollectorProcess(
            clickhouse_url or self.clickhouse.url,
            str(self.work_dir / f"spool-{name}"),
            str(self.work_dir / f"collector-{name}.log"),
            database=self.database,
            **kwargs,
        )

    def rotel(self, name: str) -> RotelAgent:
        return RotelAgent(self.clickhouse.url, self.database, str(self.work_dir / f"rotel-{name}.log"))

    def stored(self, service: str) -> tuple[set[str], int]:
        """(distinct span ids, rows) of `service` in ClickHouse."""
        sql = "SELECT SpanId, count() FROM {db:Identifier}.otel_traces WHERE ServiceName = {s:String} GROUP BY SpanId"
        with connect(self.clickhouse.url) as client:
            rows = client.query(sql, parameters={"db": self.database, "s": service}).result_rows
        return {r[0] for r in rows}, sum(int(r[1]) for r in rows)

    def wait_stored(self, service: str, acknowledged: set[str]) -> float | None:
        return wait_until(lambda: acknowledged <= self.stored(service)[0], self.store_timeout_s, 0.1)

    def stop(self) -> None:
        if self.clickhouse is not None:
            self.clickhouse.stop()


def _snapshot(ledger: Ledger) -> set[str]:
    with ledger.lock:
        return set(ledger.acknowledged)


def _counters(collector: CollectorProcess | RotelAgent) -> dict[str, int]:
    """phaselens's /metrics counters ({} for Rotel, whose HTTP port serves OTLP only)."""
    return {} if isinstance(collector, RotelAgent) else collector_counters(collector.http_port)


def _finish(
    pipeline: Pipeline,
    name: str,
    load: SpanLoad,
    collector: CollectorProcess | RotelAgent,
    recover_s: float | None,
    **detail,
) -> Outcome:
    ledger = load.stop()
    pipeline.wait_stored(load.service, ledger.acknowledged)
    detail["collector"] = {
        k: v
        for k, v in _counters(collector).items()
        if k in ("requests_retryable", "requests_deduplicated", "insert_retries", "spans_dropped")
    }
    collector.stop()
    ids, rows = pipeline.stored(load.service)
    return Outcome.of(name, ledger, ids, rows, recover_s, detail)


@contextmanager
def _loaded_collector(
    pipeline: Pipeline, name: str, params: Params, rotel: bool = False, **kwargs
) -> Iterator[tuple[CollectorProcess | RotelAgent, SpanLoad, float]]:
    """A serving collector (Rotel with `rotel`) under `params.warm_s` of load, with the seconds its
    cold start took (spawn → serving, on fresh ports: a restart's same-run yardstick). The scenario ends
    both (_finish); when it fails instead, they are ended here (the collector would hold its ports
    and spool otherwise)."""
    collector = pipeline.rotel(name) if rotel else pipeline.collector(name, **kwargs)
    started = time.monotonic()
    collector.start_serving()
    cold_start_s = time.monotonic() - started
    load = None
    try:
        load = SpanLoad(collector.grpc_endpoint, f"faults-{name}", params.load_spans_per_s).start()
        time.sleep(params.warm_s)
        yield collector, load, cold_start_s
    except BaseException:
        if load is not None:
            load.stop(flush_timeout_s=1.0)
        collector.stop()
        raise


def no_fault(pipeline: Pipeline, params: Params) -> Outcome:
    """The same-run baseline: the same load, nothing broken."""
    with _loaded_collector(pipeline, "no_fault", params) as (collector, load, _):
        time.sleep(params.after_s)
        return _finish(pipeline, "no_fault", load, collector, 0.0)


def collector_sigkill(pipeline: Pipeline, params: Params) -> Outcome:
    return _sigkill(pipeline, params, "collector_sigkill", rotel=False)


def rotel_sigkill(pipeline: Pipeline, params: Params) -> Outcome:
    return _sigkill(pipeline, params, "rotel_sigkill", rotel=True)


def clickhouse_outage(pipeline: Pipeline, params: Params) -> Outcome:
    return _outage(pipeline, params, "clickhouse_outage", rotel=False)


def rotel_clickhouse_outage(pipeline: Pipeline, params: Params) -> Outcome:
    return _outage(pipeline, params, "rotel_clickhouse_outage", rotel=True)


def _sigkill(pipeline: Pipeline, params: Params, name: str, rotel: bool) -> Outcome:
    with _loaded_collector(pipeline, name, params, rotel=rotel) as (collector, load, cold_start_s):
        acked_before = len(_snapshot(load.ledger))
        collector.kill()
        killed_at = time.monotonic()
        collector.start()  # at once, as a supervisor would
        healthy = wait_until(collector.healthy, 30)
        recover_s = None if healthy is None else time.monotonic() - killed_at
        time.sleep(params.after_s)
        return _finish(
            pipeline,
            name,
            load,
            collector,
            recover_s,
            acknowledged_before_kill=acked_before,
            restart_exit=collector.exit_code(),
            cold_start_s=round(cold_start_s, 2),
        )


def _outage(pipeline: Pipeline, params: Params, name: str, rotel: bool) -> Outcome:
    with _loaded_collector(pipeline, name, params, rotel=rotel) as (collector, load, _):
        os.kill(pipeline.clickhouse.pid, signal.SIGKILL)
        pipeline.clickhouse.stop()  # reaps it
        time.sleep(params.outage_s)
        pipeline.clickhouse.start()  # same data directory and ports
        recover_s = pipeline.wait_stored(load.service, _snapshot(load.ledger))
        time.sleep(params.after_s)
        return _finish(pipeline, name, load, collector, recover_s, outage_s=params.outage_s)


def clickhouse_slow(pipeline: Pipeline, params: Params) -> Outcome:
    link = SlowLink(pipeline.clickhouse.http_port, params.slow_delay_s).start()
    try:
        with _loaded_collector(pipeline, "clickhouse_slow", params, clickhouse_url=link.url) as (collector, load, _):
            time.sleep(params.slow_s)
            link.delay_s = 0.0
            recover_s = pipeline.wait_stored(load.service, _snapshot(load.ledger))
            time.sleep(params.after_s)
            return _finish(
                pipeline,
                "clickhouse_slow",
                load,
                collector,
                recover_s,
                stand_in="SlowLink proxy",
                delay_per_64k_s=params.slow_delay_s,
                slow_s=params.warm_s + params.slow_s,
            )
    finally:
        link.close()


def spool_full(pipeline: Pipeline, params: Params) -> Outcome:
    link = SlowLink(pipeline.clickhouse.http_port).start()
    try:
        with _loaded_collector(
            pipeline, "spool_full", params, clickhouse_url=link.url, max_spool_bytes=params.spool_cap_bytes
        ) as (collector, load, _):
            link.delay_s = 30.0  # inserts stall: the backlog reaches the cap
            time.sleep(params.full_s)
            link.delay_s = 0.0
            recover_s = pipeline.wait_stored(load.service, _snapshot(load.ledger))
            time.sleep(params.after_s)
            quarantined = list((Path(collector.spool_dir) / "quarantine").glob("*.pb"))
            return _finish(
                pipeline,
                "spool_full",
                load,
                collector,
                recover_s,
                spool_cap_bytes=params.spool_cap_bytes,
                full_s=params.full_s,
                quarantined_records=len(quarantined),
            )
    finally:
        link.close()
